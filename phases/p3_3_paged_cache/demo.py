"""`snapshot`: is paged output identical to DynamicCache output? `tput`: what does paging cost and save?
`grow_demo`: what does one growing sequence copy and allocate in each?

snapshot runs the blog's 4 short + 4 long prompts through phase 2.3's
`ContinuousScheduler` (one DynamicCache per sequence) and through
`PagedScheduler` (one PagedCache per sequence on a shared pool), with the
same max_running, and compares the generated tokens one by one.

grow_demo grows one sequence token by token with a DynamicCache and with a
PagedCache and watches their tensors (measure/grow_bench.py): DynamicCache
reallocates K and V of every layer every step (torch.cat), copying everything
it holds each time; the pool never moves.

tput hands both engines to the batch-size sweep (measure/tput.py): N requests at
a time for each batch size N, the KV memory each engine held at its peak and
its throughput.
"""

from __future__ import annotations

from common.prompts import LATENCY_DEMO_MAX_RUNNING, LATENCY_DEMO_MAX_TOKENS, interleaved_latency_prompts
from measure.demos import Option, RunConfig, demo
from measure.harness import EngineRun, EngineRunner, PeakKV, run_prompts, submit, workload_pool_blocks
from measure.report import Report, shorten
from measure.tput import plot_tput, run_tput, tput_options
from measure.workload import Request
from phases.p2_3_continuous_batching.scheduler import ContinuousScheduler
from phases.p3_1_block_allocator.allocator import DEFAULT_BLOCK_SIZE
from phases.p3_3_paged_cache.scheduler import PagedScheduler, blocks_for, worst_case_tokens

SNAPSHOT_MAX_TOKENS_CPU = 64
SNAPSHOT_MAX_TOKENS_GPU = 2 * LATENCY_DEMO_MAX_TOKENS  # long answers cross many blocks
QUICK_MAX_NEW_TOKENS = 8
PROMPT_WIDTH = 28
KV_ACCOUNTING = ("dyn: bytes of the DynamicCache tensors; paged and later: blocks held x bytes per block "
                 "(the last block's unused tail included)")


def compare_tokens(reference: list[int], candidate: list[int]) -> tuple[bool, int, int | None]:
    """(identical?, tokens compared, index of the first difference or None).

    A length difference counts as a mismatch at the shorter length.
    """
    n = min(len(reference), len(candidate))
    first = next((i for i in range(n) if reference[i] != candidate[i]), None)
    if first is None and len(reference) != len(candidate):
        first = n
    return first is None, n, first


@demo("snapshot", phase="p3_3", help="per prompt: is PagedScheduler's output identical to DynamicCache's?",
      options=[
          Option("max_new_tokens", int, cpu=SNAPSHOT_MAX_TOKENS_CPU, gpu=SNAPSHOT_MAX_TOKENS_GPU,
                 help="cap on generated tokens per sequence"),
          Option("max_running", int, cpu=LATENCY_DEMO_MAX_RUNNING, help="sequences running at once"),
          Option("block_size", int, cpu=DEFAULT_BLOCK_SIZE, help="tokens per block"),
          Option("pool_blocks", int, cpu=0,
                 help="blocks in the pool; 0 = room for every sequence's worst case (nobody waits)"),
      ])
def snapshot(cfg: RunConfig) -> Report:
    lm = cfg.load()
    prompts = interleaved_latency_prompts()
    max_new = min(cfg.max_new_tokens, QUICK_MAX_NEW_TOKENS) if cfg.quick else cfg.max_new_tokens
    dynamic = ContinuousScheduler(lm, cfg.max_running)
    lengths = [len(lm.prompt_ids(p)) for p in prompts]
    n_blocks = cfg.pool_blocks or sum(blocks_for(n + max_new - 1, cfg.block_size) for n in lengths)
    paged = PagedScheduler(lm, cfg.max_running, block_size=cfg.block_size, n_blocks=n_blocks)
    _, ref = run_prompts(dynamic, prompts, max_new, "DynamicCache")
    _, out = run_prompts(paged, prompts, max_new, "PagedCache")

    report = cfg.new_report("snapshot")
    t = report.table(f"PagedCache vs DynamicCache, token for token (max_running {cfg.max_running}, "
                     f"up to {max_new} new tokens)",
                     ["seq", "prompt", "dyn tokens", "paged tokens", "compared", "first mismatch", "identical"])
    rows = []
    for r, o in zip(ref, out):
        same, n, first = compare_tokens(r.output_ids, o.output_ids)
        t.add_row(r.seq_id, shorten(r.prompt, PROMPT_WIDTH), len(r.output_ids), len(o.output_ids), n,
                  "-" if first is None else first, same)
        rows.append(dict(seq=r.seq_id, prompt=r.prompt, dyn=r.output_ids, paged=o.output_ids, identical=same,
                         first_mismatch=first, blocks=blocks_for(worst_case_tokens(o), cfg.block_size)))
    n_same = sum(r["identical"] for r in rows)
    leaked = paged.allocator.n_used
    t.notes += [f"{n_same}/{len(rows)} identical; pool: {n_blocks} blocks of {cfg.block_size} tokens, "
                f"{paged.allocator.bytes_per_block:,} B each; {leaked} blocks still held after the run"
                + (" (LEAK)" if leaked else ""),
                f"sequences that waited for blocks: {sorted(paged.waited_for_blocks) or 'none'}"]
    report.data = dict(rows=rows, identical=n_same, total=len(rows), pool_blocks=n_blocks,
                       block_size=cfg.block_size, waited=sorted(paged.waited_for_blocks), leaked_blocks=leaked)
    return report


# --- tput: phase 2.3's and this phase's engines, measured with the KV they hold at peak -----------
class DynamicPeakScheduler(PeakKV, ContinuousScheduler):
    pass


class PagedPeakScheduler(PeakKV, PagedScheduler):
    pass


def run_dynamic(lm, requests: list[Request], max_running: int) -> EngineRun:
    """Phase 2.3: continuous batching, one DynamicCache per sequence."""
    sched = DynamicPeakScheduler(lm, max_running)
    submit(sched, lm, requests)
    return EngineRun.from_sequences(sched.run(), sched.peak_kv_bytes,
                                    settings=dict(max_running=max_running, kv="one DynamicCache per sequence"))


def run_paged(lm, requests: list[Request], max_running: int, block_size: int = DEFAULT_BLOCK_SIZE) -> EngineRun:
    """Phase 3.3: the same continuous batching, K/V in one paged pool (PagedCache + Python gather)."""
    n_blocks = workload_pool_blocks(lm, requests, block_size)
    sched = PagedPeakScheduler(lm, max_running, block_size=block_size, n_blocks=n_blocks)
    submit(sched, lm, requests)
    finished = sched.run()
    assert sched.allocator.n_free == n_blocks, "blocks leaked"
    return EngineRun.from_sequences(finished, sched.peak_kv_bytes,
                                    note=f"pool of {n_blocks} blocks x {block_size} tokens",
                                    settings=dict(max_running=max_running, block_size=block_size,
                                                  pool_blocks=n_blocks))


TPUT_ENGINES: list[EngineRunner] = [
    EngineRunner("dyn", "ContinuousScheduler + DynamicCache (p2_3): one forward pass per sequence", run_dynamic),
    EngineRunner("paged", "PagedScheduler + PagedCache (p3_3): one forward pass per sequence, Python gather",
                 run_paged),
]


@demo("tput", phase="p3_3", plot=plot_tput, options=tput_options(),
      help="per batch size: KV memory held at peak, tok/s and ms/tok, DynamicCache vs PagedCache")
def tput(cfg: RunConfig) -> Report:
    return run_tput(cfg, TPUT_ENGINES, kv_note=KV_ACCOUNTING)


# --- grow_demo: what one growing sequence costs each cache ---------------------------------------------
GROW_NEW_TOKENS_CPU = 512
GROW_NEW_TOKENS_GPU = 4096
GROW_FIRST_CHECKPOINT = 64      # rows at 64, 128, 256, ... tokens


def dynamic_cache(lm, total_tokens: int):
    """HF's DynamicCache: per layer, K and V tensors grown by torch.cat every step."""
    from transformers import DynamicCache
    cache = DynamicCache(config=lm.model.config)

    def storage():
        return [t for layer in cache.layers if layer.is_initialized for t in (layer.keys, layer.values)]
    return cache, storage, lambda: sum(t.numel() * t.element_size() for t in storage())


def paged_cache(lm, total_tokens: int, block_size: int = DEFAULT_BLOCK_SIZE):
    """Phase 3.3's PagedCache over a pool made once, before the sequence starts, with room for it."""
    from phases.p3_1_block_allocator.allocator import BlockAllocator
    from phases.p3_3_paged_cache.paged_cache import PagedCache
    allocator = BlockAllocator.for_model(lm, block_size=block_size, n_blocks=blocks_for(total_tokens, block_size))
    cache = PagedCache(allocator)
    return cache, lambda: [allocator.kv_store], lambda: cache.table.n_blocks * allocator.bytes_per_block


@demo("grow_demo", phase="p3_3",
      help="one sequence growing: bytes DynamicCache copies and allocates to grow (torch.cat) vs the paged pool",
      options=[Option("new_tokens", int, cpu=GROW_NEW_TOKENS_CPU, gpu=GROW_NEW_TOKENS_GPU,
                      help="tokens the sequence grows by"),
               Option("block_size", int, cpu=DEFAULT_BLOCK_SIZE, help="tokens per block (paged)")])
def grow_demo(cfg: RunConfig) -> Report:
    from common.prompts import DECODE_PROMPT
    from measure.grow_bench import measure_growth
    cfg.use_quick(new_tokens=8)
    lm = cfg.load()
    report = cfg.new_report("grow_demo")
    ids = lm.prompt_ids(DECODE_PROMPT)
    checkpoints, n = [], GROW_FIRST_CHECKPOINT
    while n <= len(ids) + cfg.new_tokens:
        checkpoints.append(n)
        n *= 2
    caches = {"DynamicCache (torch.cat)": dynamic_cache,
              f"PagedCache (pool of {cfg.block_size}-token blocks)":
                  lambda lm_, total: paged_cache(lm_, total, cfg.block_size)}
    t = report.table(f"one sequence growing to {len(ids) + cfg.new_tokens - 1} tokens in its cache "
                     f"({lm.n_layers} layers, {str(lm.dtype).removeprefix('torch.')})",
                     ["cache", "tokens", "held MB", "growth allocations", "largest growth allocation MB",
                      "copied to grow MB", "copied to attend MB", "peak MB"])
    data = {}
    for name, make in caches.items():
        rows = measure_growth(lm, ids, cfg.new_tokens, make, checkpoints)
        for r in rows:
            t.add_row(name, r["tokens"], r["held_mb"], r["allocations"], r["largest_mb"], r["grow_copied_mb"],
                      r["attend_copied_mb"], r["peak_mb"])
        data[name] = rows
    t.notes.append("Measured on the cache's own tensors after every forward pass: an address that changed is a "
                   "reallocation whose old contents were copied (growth); update() returning tensors that are not "
                   "the storage is a copy made for attention. peak: held bytes plus the old copy alive during a "
                   "reallocation. The paged pool is allocated once, before the sequence, and never moves; phase "
                   "3.3's PagedCache still gathers each layer's blocks into a contiguous copy for HF's attention "
                   "every step (copied to attend).")
    report.data["growth"] = data
    return report
