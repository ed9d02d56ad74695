"""`table_demo`: block tables filled by real generation; `block_size_study`: waste vs table size.

table_demo runs phase 2.3's continuous-batching scheduler (real model, real
greedy tokens, its own DynamicCache for the maths) and books every token each
forward pass feeds into a `BlockTable` on a shared `BlockAllocator`: the slot
each token's K and V would take in the pool. With one sequence it prints
the table after prefill and at every block boundary; with `--concurrent N`,
N sequences at a time compete for one small pool, and the pool's event log
shows blocks being claimed, returned, and claimed again by someone else.
"""

from __future__ import annotations

from common.prompts import TABLE_DEMO_PROMPT, interleaved_latency_prompts
from measure.bench import kv_bytes_per_token
from measure.demos import Option, RunConfig, demo
from measure.report import Report, shorten
from phases.p2_3_continuous_batching.scheduler import ContinuousScheduler
from phases.p3_1_block_allocator.allocator import DEFAULT_BLOCK_SIZE, BlockAllocator, blocks_for
from phases.p3_1_block_allocator.demo import workload, workload_options
from phases.p3_2_block_table.block_table import BlockTable

TABLE_DEMO_MAX_TOKENS_CPU = 128
TABLE_DEMO_MAX_TOKENS_GPU = 1024
QUICK_MAX_NEW_TOKENS = 6
STUDY_BLOCK_SIZES = [1, 2, 4, 8, 16, 32, 64, 128]
BLOCK_TABLE_ENTRY_BYTES = 4  # one int32 per entry in the block-table tensor the kernels read
KiB = 1024


class TableTracingScheduler(ContinuousScheduler):
    """Phase 2.3's scheduler, with each forward pass's tokens also booked into a BlockTable.

    The model still attends over its DynamicCache; the tables record where a
    paged cache would put each token's K/V, driven by the real token counts.
    """

    def __init__(self, lm, pool: BlockAllocator, max_running: int):
        super().__init__(lm, max_running)
        self.pool = pool
        self.tables: dict[int, BlockTable] = {}
        self.events: list[dict] = []  # one per forward pass and per release, in order

    def new_kv(self, seq):
        self.tables[seq.seq_id] = BlockTable(self.pool.block_size)
        return super().new_kv(seq)

    def _book(self, seq, n: int, kind: str) -> None:
        """Claim room for `n` new tokens in seq's table, as a paged cache would before the forward pass."""
        table = self.tables[seq.seq_id]
        claimed = table.ensure_capacity(self.pool, n)
        table.append_slots(self.pool, n)
        self.events.append(dict(step=self.n_steps, seq=seq.seq_id, kind=kind, tokens=n, n_filled=table.n_filled,
                                claimed=claimed, block_ids=list(table.block_ids), free=self.pool.n_free))

    def _prefill(self, seqs):
        for seq in seqs:
            self._book(seq, len(seq.prompt_ids), "prefill")   # the whole prompt
        return super()._prefill(seqs)

    def _decode(self, seqs):
        for seq in seqs:
            self._book(seq, 1, "decode")                      # its last generated token
        return super()._decode(seqs)

    def free_kv(self, seq):
        table = self.tables[seq.seq_id]
        returned = list(table.block_ids)
        table.release(self.pool)
        # It finished in the step of its last forward pass.
        step = next(e["step"] for e in reversed(self.events) if e["seq"] == seq.seq_id)
        self.events.append(dict(step=step, seq=seq.seq_id, kind="done", returned=returned,
                                free=self.pool.n_free))
        super().free_kv(seq)


def table_rows(block_ids: list[int], n_filled: int, bs: int) -> list[list]:
    """(logical, physical, token range, fill) for every block of a table holding n_filled tokens."""
    rows = []
    for logical, physical in enumerate(block_ids):
        first, last = logical * bs, min((logical + 1) * bs, n_filled) - 1
        rows.append([logical, physical, f"{first}–{last}", f"{last - first + 1}/{bs}"])
    return rows


def _single(cfg: RunConfig, report: Report, sched: TableTracingScheduler, seq) -> None:
    bs = sched.pool.block_size
    n_prompt, n_gen = len(seq.prompt_ids), len(seq.output_ids)
    s = report.table("One sequence", ["prompt tokens", "generated", "total", "K/V written", "block size",
                                      "blocks", "tail waste (tok)"])
    last = [e for e in sched.events if e["kind"] != "done"][-1]
    s.add_row(n_prompt, n_gen, n_prompt + n_gen, last["n_filled"], bs, len(last["block_ids"]),
              len(last["block_ids"]) * bs - last["n_filled"])
    s.notes += [f"prompt: {seq.prompt!r}", f"output: {shorten(sched.lm.decode(seq.output_ids), 100)!r}",
                "K/V written = total - 1: the last generated token is never fed back, so its K/V is never computed"]
    for e in sched.events:
        if e["kind"] == "done":
            continue
        if e["kind"] == "prefill":
            title = f"after prefill: {e['n_filled']} prompt tokens in the KV cache"
        elif e["n_filled"] % bs == 0:
            title = f"after token {e['n_filled']}: logical block {e['n_filled'] // bs - 1} just filled"
        elif e is last:
            title = f"finished: {e['n_filled']} tokens in the KV cache"
        else:
            continue
        t = report.table(title, ["logical", "physical", "tokens", "fill"])
        for row in table_rows(e["block_ids"], e["n_filled"], bs):
            t.add_row(*row)


def _concurrent(cfg: RunConfig, report: Report, sched: TableTracingScheduler, done: list) -> None:
    pool = sched.pool
    final = {e["seq"]: e for e in sched.events if e["kind"] != "done"}  # last write of each sequence
    returned_by: dict[int, int] = {}   # block -> the sequence that gave it back most recently
    reused: dict[int, list[int]] = {s.seq_id: [] for s in done}
    log = report.table(f"Pool events ({pool.n_blocks} blocks shared by {cfg.concurrent} running sequences)",
                       ["step", "seq", "event", "blocks", "free after"])
    for e in sched.events:
        if e["kind"] == "done":
            returned_by.update({b: e["seq"] for b in e["returned"]})
            log.add_row(e["step"], e["seq"], "done, returns", str(e["returned"]), e["free"])
        elif e["claimed"]:
            was = [f"{b} from seq {returned_by[b]}" for b in e["claimed"] if b in returned_by]
            reused[e["seq"]] += [b for b in e["claimed"] if b in returned_by]
            log.add_row(e["step"], e["seq"], f"{e['kind']} ({e['n_filled']} tok), claims",
                        str(e["claimed"]) + (f"  (reused: {', '.join(was)})" if was else ""), e["free"])
    t = report.table("Sequences and their block tables", ["seq", "prompt", "prompt tok", "generated",
                                                          "blocks", "physical ids (logical order)", "reused"])
    for s in done:
        e = final[s.seq_id]
        t.add_row(s.seq_id, shorten(s.prompt, 28), len(s.prompt_ids), len(s.output_ids), len(e["block_ids"]),
                  str(e["block_ids"]), len(reused[s.seq_id]))
    total = sum(len(final[s.seq_id]["block_ids"]) for s in done)
    t.notes += [f"{len(done)} sequences took {total} blocks in all from a pool of {pool.n_blocks}; "
                f"{sum(map(len, reused.values()))} were claimed again after their first owner finished",
                f"after the run: {pool.n_free}/{pool.n_blocks} blocks free (nothing leaked)"]


def plot_pool(report: Report, png_path) -> None:
    """Which sequence held which physical block, step by step (one row per block)."""
    from measure.plots import gantt
    n = report.data["pool_blocks"]
    spans = [dict(row=s["block"], start=s["start"], end=s["end"], color=s["seq"], label=f"seq {s['seq']}")
             for s in report.data["spans"]]
    gantt(png_path, {"": spans}, n_rows=n, row_name="block", xlabel="scheduler step", inches_per_row=0.22,
          fontsize=7, title=f"Who holds each physical block of a {n}-block pool, step by step")


def _spans(events: list[dict]) -> list[dict]:
    """[{block, seq, start, end}]: when each block was claimed and returned."""
    open_at: dict[int, tuple[int, int]] = {}
    spans = []
    for e in events:
        for b in e.get("claimed", []):
            open_at[b] = (e["seq"], e["step"])
        for b in e.get("returned", []):
            seq, start = open_at.pop(b)
            spans.append(dict(block=b, seq=seq, start=start, end=e["step"] + 1))
    return spans


@demo("table_demo", phase="p3_2", plot=plot_pool,
      help="one sequence's block table at each block boundary (--concurrent N: N sequences share one pool)",
      options=[Option("max_new_tokens", int, cpu=TABLE_DEMO_MAX_TOKENS_CPU, gpu=TABLE_DEMO_MAX_TOKENS_GPU,
                      help="cap on generated tokens per sequence"),
               Option("block_size", int, cpu=DEFAULT_BLOCK_SIZE, help="tokens per block"),
               Option("concurrent", int, cpu=1, help="sequences running at once (>1: they compete for a "
                      "pool just big enough for that many worst-case sequences)")])
def table_demo(cfg: RunConfig) -> Report:
    lm = cfg.load()
    max_new = min(cfg.max_new_tokens, QUICK_MAX_NEW_TOKENS) if cfg.quick else cfg.max_new_tokens
    n = cfg.concurrent
    if n < 1:
        raise ValueError(f"--concurrent must be >= 1, got {n}")
    # With company, the table demo's prompt goes first, then the latency workload's prompts:
    # twice as many sequences as run at once, so later ones inherit blocks earlier ones returned.
    queue = [TABLE_DEMO_PROMPT] if n == 1 else ([TABLE_DEMO_PROMPT] + interleaved_latency_prompts())[:2 * n]
    ids = [lm.prompt_ids(p) for p in queue]
    # Room for n sequences at their worst case, so the run never runs dry (a running sequence keeps its
    # blocks to the end), and no more, so blocks that come back are soon handed out again.
    worst = blocks_for(max(map(len, ids)) + max_new, cfg.block_size)
    pool = BlockAllocator.for_model(lm, block_size=cfg.block_size, n_blocks=n * worst)
    sched = TableTracingScheduler(lm, pool, max_running=n)
    for p in queue:
        sched.add(p, max_new)
    done = sched.run()
    assert pool.n_free == pool.n_blocks, "blocks leaked"
    report = cfg.new_report("table_demo")
    if n == 1:
        _single(cfg, report, sched, done[0])
    else:
        _concurrent(cfg, report, sched, done)
    report.data = dict(block_size=cfg.block_size, pool_blocks=pool.n_blocks, spans=_spans(sched.events))
    return report


# --- block_size_study ---------------------------------------------------------------------
def plot_study(report: Report, png_path) -> None:
    from measure.plots import twin_lines
    d = report.data
    twin_lines(png_path, d["block_sizes"], ("tail waste (% of allocated slots)", d["waste_pct"]),
               ("block-table entries (all sequences, log)", d["table_entries"]), xlabel="block size (tokens)",
               logx=True, right_logy=True,
               title=f"Block size trade-off on the latency workload ({d['n_sequences']} sequences)")


@demo("block_size_study", phase="p3_2", plot=plot_study,
      help="tail waste vs block-table entries across block sizes, on the latency workload's real lengths",
      options=workload_options() + [Option("block_sizes", int, cpu=STUDY_BLOCK_SIZES, many=True,
                                           help="block sizes to compare")])
def block_size_study(cfg: RunConfig) -> Report:
    lm = cfg.load()
    lengths = workload(cfg, lm)
    tokens = [w["prompt_tokens"] + w["generated_tokens"] for w in lengths]
    per_token = kv_bytes_per_token(lm)
    report = cfg.new_report("block_size_study")
    t = report.table(f"Block size vs waste and table size ({len(tokens)} sequences, {sum(tokens)} tokens)",
                     ["block size", "table entries", "longest table", "tail waste (tok)", "waste %",
                      "KV wasted KiB", "table KiB"])
    data = dict(block_sizes=[], table_entries=[], waste_pct=[], n_sequences=len(tokens), tokens=tokens)
    for bs in cfg.block_sizes:
        # Bookkeeping only: a "meta" pool has the real free list and refcounts but no storage.
        pool = BlockAllocator(sum(blocks_for(n, bs) for n in tokens), lm.n_layers, lm.n_kv_heads, lm.head_dim,
                              block_size=bs, device="meta", dtype=lm.dtype)
        tables = [BlockTable(bs) for _ in tokens]
        for table, n in zip(tables, tokens):
            table.append_slots(pool, n)
        entries = sum(tb.n_blocks for tb in tables)
        waste = sum(tb.tail_waste for tb in tables)
        pct = 100 * waste / (entries * bs)
        t.add_row(bs, entries, max(tb.n_blocks for tb in tables), waste, pct, waste * per_token / KiB,
                  entries * BLOCK_TABLE_ENTRY_BYTES / KiB)
        data["block_sizes"].append(bs)
        data["table_entries"].append(entries)
        data["waste_pct"].append(pct)
        for tb in tables:
            tb.release(pool)
        assert pool.n_free == pool.n_blocks
    t.notes += [
        "small blocks: almost no tail waste, but one table entry per few tokens: more metadata, and an attention "
        "kernel that follows the table for every block reads short contiguous runs",
        "large blocks: few entries and long contiguous reads, but each sequence's last block is on average half "
        "empty (waste < block size tokens per sequence); short answers waste most of a block",
        "vLLM's default of 16 sits between the two; backends can also constrain it",
        f"KV wasted KiB at {per_token:,} bytes of K/V per token ({lm.dtype}); table KiB at "
        f"{BLOCK_TABLE_ENTRY_BYTES} bytes per int32 entry"]
    report.data = data
    return report


# --- vm_analogy: a page table and a block table, walked side by side ------------------------------------------
PAGE_SIZE = 4096                 # bytes per page, the common x86 size
PROCESS_PAGE_TABLE = [5, 2, 9]   # an illustrative process: virtual pages 0, 1, 2 in physical frames 5, 2, 9
OTHER_FRAMES = {0: "kernel", 1: "B", 3: "B", 4: "C", 7: "C", 10: "B"}   # frames other processes hold
VM_FRAMES = 12
VM_ADDRESS = 2 * PAGE_SIZE + 300      # the virtual address walked: page 2, offset 300
VM_POOL_BLOCKS = 12
VM_BLOCK_SIZE = 16
VM_GROWTH = [("A", 20), ("B", 20), ("A", 15), ("C", 30), ("A", 10), ("B", 8)]   # tokens appended, in turn
VM_TOKEN = 37                         # sequence A's token walked


def plot_vm(report: Report, png_path) -> None:
    from measure import plots
    plots.table_walks(png_path, report.data["panels"],
                      title="the virtual-memory analogy: a page table and a block table do the same walk")


@demo("vm_analogy", phase="p3_2", plot=plot_vm, needs_model=False,
      help="the virtual-memory analogy drawn: a process's page table beside a sequence's block table, one "
           "address walked through each")
def vm_analogy(cfg: RunConfig) -> Report:
    """Real block tables: three sequences grow in turn in one small pool (their blocks interleave), then
    sequence A's token VM_TOKEN is found the way a CPU finds a virtual address."""
    report = cfg.new_report("vm_analogy")
    allocator = BlockAllocator(VM_POOL_BLOCKS, n_layers=1, n_kv_heads=1, head_dim=1, block_size=VM_BLOCK_SIZE)
    tables = {name: BlockTable(VM_BLOCK_SIZE) for name in "ABC"}
    for name, n in VM_GROWTH:
        tables[name].append_slots(allocator, n)
    owner = {b: name for name, t in tables.items() if name != "A" for b in t.block_ids}
    block, offset = tables["A"].physical_pos(VM_TOKEN)
    t = report.table("one lookup, two systems", ["", "process (virtual memory)", "sequence (paged KV cache)"])
    t.add_row("unit", f"page of {PAGE_SIZE} bytes", f"block of {VM_BLOCK_SIZE} tokens")
    t.add_row("table", f"page table {PROCESS_PAGE_TABLE}", f"block table {tables['A'].block_ids}")
    page, page_offset = divmod(VM_ADDRESS, PAGE_SIZE)
    t.add_row("lookup", f"address {VM_ADDRESS} -> page {page}, offset {page_offset}",
              f"token {VM_TOKEN} -> block {VM_TOKEN // VM_BLOCK_SIZE}, offset {VM_TOKEN % VM_BLOCK_SIZE}")
    t.add_row("found", f"frame {PROCESS_PAGE_TABLE[page]}, offset {page_offset}",
              f"pool block {block}, offset {offset}")
    t.add_row("who fills the table", "the OS, on a page fault", "the allocator, when a token needs a new block")
    t.notes.append(f"The block tables are real: sequences A, B and C grew in turn ({VM_GROWTH}) in a pool of "
                   f"{VM_POOL_BLOCKS} blocks, so A's blocks are not contiguous, as a process's frames are not.")
    report.data["panels"] = [
        dict(title="a process: virtual address -> page table -> frame", owner="process A", unit="page",
             unit_size=PAGE_SIZE, table=PROCESS_PAGE_TABLE, n_physical=VM_FRAMES, others=OTHER_FRAMES,
             address=VM_ADDRESS, address_name="address"),
        dict(title="a sequence: token -> block table -> pool block", owner="sequence A", unit="block",
             unit_size=VM_BLOCK_SIZE, table=tables["A"].block_ids, n_physical=VM_POOL_BLOCKS, others=owner,
             address=VM_TOKEN, address_name="token")]
    return report
