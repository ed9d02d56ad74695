"""What one recovery from preemption costs, per block size: the vLLM paper's Fig. 19(a) micro-benchmark.

    rows = recovery_microbench(lm, engine, swap_space, block_sizes, n_seqs, seq_len, reps)

`engine(lm, block_size=, n_blocks=, watermark_blocks=, prefix_caching=)` is a preempting engine
and `swap_space(gpu_allocator, n_blocks, batched=)` its CPU pool (`swap_out(tables)` /
`swap_in(tables)`, `out` / `into` counters with `seconds`); measure/ imports no phase, so
`preempt_demo` (measure/preempt_bench.py) hands phase 4.4's in.
"""

from __future__ import annotations

from typing import Callable

from common.clock import now
from measure.bench import ceil_div
from measure.report import Report
from measure.workload import burst

MICRO_SEED = 1


def recovery_microbench(lm, engine: Callable, swap_space: Callable, block_sizes: list[int], n_seqs: int,
                        seq_len: int, reps: int) -> list[dict]:
    """The same K/V (`n_seqs` sequences of `seq_len` tokens) brought back each way, at each block size:
    - swap, batched: `swap_out` then `swap_in` of their blocks, one indexed copy per direction (what the
      engine does);
    - swap, per block: the same with one copy per block (`batched=False`), the way vLLM v0 issued one
      `cudaMemcpyAsync` per block: many small transfers, each paying a fixed cost, which is what made
      the paper's swapping slow at small block sizes;
    - recompute: one prefill pass over all those tokens (what a re-prefill after preemption costs),
      independent of the block size but for the attention's reads from the pool.
    Each number is the fastest of `reps` repetitions (the others wait on the neighbours of a shared machine).
    """
    prompts = [r.prompt_ids for r in burst(lm.vocab_size, n_seqs, (seq_len, seq_len), (1, 1), seed=MICRO_SEED)]
    rows = []
    for bs in block_sizes:
        n_blocks = n_seqs * ceil_div(seq_len + 1, bs)
        recompute = []
        for _ in range(reps):
            # prefix caching off: the pass computes every token, as a recomputation without cached blocks does
            e = engine(lm, block_size=bs, n_blocks=n_blocks, watermark_blocks=0, prefix_caching=False)
            for p in prompts:
                e.add(p, 2, ignore_eos=True)
            start = now(lm.device)
            e.step()  # the prefill pass: all n_seqs x seq_len tokens' K/V computed and written
            recompute.append(now(lm.device) - start)
        tables = [s.kv for s in e.running]
        row = dict(block_size=bs, n_blocks=len({b for t in tables for b in t.block_ids}), tokens=n_seqs * seq_len,
                   recompute_ms=min(recompute) * 1e3)
        for name, batched in (("swap_ms", True), ("swap_per_block_ms", False)):
            space = swap_space(e.allocator, n_blocks, batched=batched)
            times = []
            for _ in range(reps):
                start = space.out.seconds + space.into.seconds
                space.swap_out(tables)
                space.swap_in(tables)
                times.append(space.out.seconds + space.into.seconds - start)
            row[name] = min(times) * 1e3
        rows.append(row)
    return rows


def recovery_table(report: Report, micro: list[dict], n_seqs: int, seq_len: int, reps: int) -> None:
    """The micro-benchmark's rows as one table of `report`."""
    t = report.table(f"Micro-benchmark: bringing back {n_seqs} x {seq_len} tokens of K/V "
                     f"({micro[0]['tokens']} tokens), fastest of {reps}",
                     ["block size", "blocks", "swap out + in (ms)", "same, one copy per block (ms)",
                      "recompute (ms)", "recompute / swap"])
    for m in micro:
        t.add_row(m["block_size"], m["n_blocks"], m["swap_ms"], m["swap_per_block_ms"], m["recompute_ms"],
                  f"{m['recompute_ms'] / m['swap_ms']:.0f}x")
    t.notes += [
        "swap: SwapSpace.swap_out then swap_in (one indexed copy per direction); one copy per block is the "
        "vLLM v0 way (a cudaMemcpyAsync per block), whose fixed cost per copy grows with the number of blocks",
        "recompute: one prefill pass over the same tokens (what a re-prefill after preemption costs)",
    ]
