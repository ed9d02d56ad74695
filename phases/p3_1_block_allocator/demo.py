"""`alloc_demo`: how many blocks the latency workload really takes from the pool, vs a static reservation.

Steps: load the model, size the pool from what memory is left (`for_model`),
run the latency workload once with phase 2.3's scheduler to learn each
sequence's real length, then take ceil(tokens / block_size) blocks per
sequence from the pool (all held at once, as if every sequence were resident),
give them back, and compare with StaticCache's worst-case reservation of
`static_tokens` slots per sequence.

Real lengths, not guesses: how many blocks a sequence needs depends on how many
tokens it ends up holding, which nobody knows before it runs ("What is 2 + 2?"
stops after a handful of tokens, "Describe the history of the Roman Empire" runs
to the cap). So this demo accounts blocks for the lengths the model really
produced (`latency_workload_lengths`).
"""

from __future__ import annotations

from common.prompts import (LATENCY_DEMO_MAX_RUNNING, LATENCY_DEMO_MAX_TOKENS, LATENCY_DEMO_MAX_TOKENS_GPU,
                            STATIC_RESERVATION_TOKENS, interleaved_latency_prompts)
from measure.demos import Option, RunConfig, demo
from measure.harness import run_prompts
from measure.report import Report, shorten
from phases.p3_1_block_allocator.allocator import DEFAULT_BLOCK_SIZE, BlockAllocator, blocks_for
from phases.p3_1_block_allocator.budget import DEFAULT_MEMORY_FRACTION, MiB, kv_budget_bytes

CPU_BUDGET_MB = 1024
QUICK_PROMPTS = 4          # tests: two short and two long prompts ...
QUICK_MAX_NEW_TOKENS = 8   # ... with a few tokens each
PROMPT_WIDTH = 34          # characters of prompt shown in the table


def workload_options() -> list[Option]:
    """The latency workload's knobs: the cap on new tokens and how many sequences run at once."""
    return [
        Option("max_new_tokens", int, cpu=LATENCY_DEMO_MAX_TOKENS, gpu=LATENCY_DEMO_MAX_TOKENS_GPU,
               help="cap on generated tokens per sequence"),
        Option("max_running", int, cpu=LATENCY_DEMO_MAX_RUNNING, help="sequences running at once"),
    ]


def latency_workload_lengths(lm, max_new_tokens: int = LATENCY_DEMO_MAX_TOKENS,
                             max_running: int = LATENCY_DEMO_MAX_RUNNING,
                             prompts: list[str] | None = None) -> list[dict]:
    """Run the latency workload (short and long prompts, interleaved) through phase 2.3's continuous
    batching once; return, in prompt order, one dict per sequence:
    `{"prompt": str, "prompt_tokens": int, "generated_tokens": int}`.

    The sequence's K/V footprint is prompt_tokens + generated_tokens tokens.
    """
    # Imported here: phase 3.1 depends on phase 2.3 only for these numbers.
    from phases.p2_3_continuous_batching.scheduler import ContinuousScheduler

    prompts = interleaved_latency_prompts() if prompts is None else list(prompts)
    if not prompts:
        raise ValueError("no prompts: the workload needs at least one")
    _, finished = run_prompts(ContinuousScheduler(lm, max_running=max_running), prompts, max_new_tokens,
                              "generating the latency workload")
    return [{"prompt": p, "prompt_tokens": len(s.prompt_ids), "generated_tokens": len(s.output_ids)}
            for p, s in zip(prompts, finished)]


def workload(cfg: RunConfig, lm) -> list[dict]:
    """Real lengths of the latency workload (a small slice of it under cfg.quick)."""
    prompts = interleaved_latency_prompts()
    max_new = cfg.max_new_tokens
    if cfg.quick:
        prompts, max_new = prompts[:QUICK_PROMPTS], min(max_new, QUICK_MAX_NEW_TOKENS)
    return latency_workload_lengths(lm, max_new, cfg.max_running, prompts)


def plot_alloc(report: Report, png_path) -> None:
    from measure.plots import bars
    seqs = report.data["sequences"]
    bars(png_path, [f"{i} {shorten(s['prompt'], 18)}" for i, s in enumerate(seqs)],
         {"tokens stored": [s["tokens"] for s in seqs],
          "paged: slots in its blocks": [s["paged_blocks"] * report.data["block_size"] for s in seqs],
          f"static: {report.data['static_tokens']}-slot reservation": [s["static_slots"] for s in seqs]},
         ylabel="KV slots (tokens), log scale", logy=True,
         title=f"KV slots per sequence: paged (block size {report.data['block_size']}) vs static reservation")


@demo("alloc_demo", phase="p3_1", plot=plot_alloc,
      help="pool capacity, then blocks each latency-workload sequence uses vs a static reservation",
      options=workload_options() + [
          Option("block_size", int, cpu=DEFAULT_BLOCK_SIZE, help="tokens per block"),
          Option("static_tokens", int, cpu=STATIC_RESERVATION_TOKENS,
                 help="slots a static (worst-case) cache reserves per sequence"),
          Option("cpu_budget_mb", int, cpu=CPU_BUDGET_MB, help="KV pool budget on CPU, in MiB"),
          Option("memory_fraction", float, cpu=DEFAULT_MEMORY_FRACTION,
                 help="on CUDA: share of the memory free after model load given to the pool"),
      ])
def alloc_demo(cfg: RunConfig) -> Report:
    lm = cfg.load()
    bs = cfg.block_size
    budget, why = kv_budget_bytes(lm.device, cfg.memory_fraction, cfg.cpu_budget_mb * MiB)
    pool = BlockAllocator.for_model(lm, block_size=bs, memory_fraction=cfg.memory_fraction,
                                    cpu_budget_bytes=cfg.cpu_budget_mb * MiB)
    report = cfg.new_report("alloc_demo")
    t = report.table("KV pool, allocated once after model load",
                     ["blocks", "block size", "bytes/block", "tokens it holds", "pool MiB", "sized from"])
    t.add_row(pool.n_blocks, bs, pool.bytes_per_block, pool.n_blocks * bs,
              pool.n_blocks * pool.bytes_per_block / MiB, why)
    t.notes.append(f"bytes/block = n_layers*2*n_kv_heads*block_size*head_dim*itemsize = {lm.n_layers}*2*"
                   f"{lm.n_kv_heads}*{bs}*{lm.head_dim}*{lm.dtype.itemsize}; blocks = budget // bytes/block")

    lengths = workload(cfg, lm)
    static_blocks = blocks_for(cfg.static_tokens, bs)
    seq_table = report.table(
        f"Per sequence (block size {bs}; static reserves {cfg.static_tokens} slots = {static_blocks} blocks)",
        ["seq", "prompt", "prompt tok", "generated", "tokens", "paged blocks", "tail waste (tok)",
         "static blocks", "static waste %"])
    rows, held = [], []
    for i, w in enumerate(lengths):
        tokens = w["prompt_tokens"] + w["generated_tokens"]
        blocks = [pool.alloc() for _ in range(blocks_for(tokens, bs))]  # all of a sequence's blocks, held together
        held += blocks
        # A sequence longer than the reservation would not fit a static cache at all; count it as full.
        static_slots = max(static_blocks * bs, tokens)
        row = dict(prompt=w["prompt"], prompt_tokens=w["prompt_tokens"], generated=w["generated_tokens"],
                   tokens=tokens, paged_blocks=len(blocks), tail_waste=len(blocks) * bs - tokens,
                   static_slots=static_slots)
        rows.append(row)
        seq_table.add_row(i, shorten(w["prompt"], PROMPT_WIDTH), w["prompt_tokens"], w["generated_tokens"], tokens,
                          len(blocks), row["tail_waste"], static_slots // bs,
                          100 * (static_slots - tokens) / static_slots)
    peak_used = pool.n_used
    for b in held:
        pool.free(b)
    assert pool.n_free == pool.n_blocks, "blocks leaked"

    tokens = sum(r["tokens"] for r in rows)
    paged_slots = sum(r["paged_blocks"] for r in rows) * bs
    static_slots = sum(r["static_slots"] for r in rows)
    per_token = pool.bytes_per_block // bs
    totals = report.table(f"All {len(rows)} sequences resident at once",
                          ["scheme", "blocks", "KV MiB", "tokens stored", "wasted slots", "wasted %"])
    for name, slots in (("static reservation", static_slots), ("paged", paged_slots)):
        totals.add_row(name, slots // bs, slots * per_token / MiB, tokens, slots - tokens,
                       100 * (slots - tokens) / slots)
    worst_tail = max(r["tail_waste"] for r in rows)
    totals.notes += [
        f"paged waste is only each sequence's unfilled last block: at most {worst_tail} tokens here, "
        f"always < block size {bs}",
        f"the pool lent {peak_used} of its {pool.n_blocks} blocks and got every one back "
        f"({pool.n_free} free after release)",
        f"static reservation would fit {pool.n_blocks // static_blocks} sequences in this pool; "
        f"paged, at this workload's mean of {paged_slots // bs / len(rows):.1f} blocks/seq, "
        f"about {int(pool.n_blocks / (paged_slots / bs / len(rows)))}"]
    report.data = dict(block_size=bs, static_tokens=cfg.static_tokens, pool_blocks=pool.n_blocks,
                       bytes_per_block=pool.bytes_per_block, budget_bytes=budget, sequences=rows)
    return report
