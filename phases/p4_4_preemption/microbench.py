"""What one recovery costs, per block size: swap out + in (batched, and block by block) vs recomputation.

The vLLM paper's Fig. 19(a) micro-benchmark: the same amount of K/V (here
`n_seqs` sequences of `seq_len` tokens) brought back by each mechanism, at
each block size.

- swap, batched: `SwapSpace.swap_out` then `swap_in` of their blocks, one
  indexed copy per direction (what the engine does);
- swap, per block: the same with one copy per block (`batched=False`), the
  way vLLM v0 issued one `cudaMemcpyAsync` per block: many small transfers,
  each paying a fixed cost, which is what made the paper's swapping slow at
  small block sizes;
- recompute: one prefill pass over all those tokens (what a re-prefill after
  preemption costs), independent of the block size but for the attention's
  reads from the pool.

Each number is the fastest of `reps` repetitions (the others wait on the
neighbours of a shared machine).
"""

from __future__ import annotations

from common.bench import now
from phases.p3_1_block_allocator.allocator import blocks_for
from phases.p4_4_preemption.engine import PreemptingEngine
from phases.p4_4_preemption.swap import SwapSpace
from phases.p4_4_preemption.trace import burst


def recovery_microbench(lm, block_sizes: list[int], n_seqs: int, seq_len: int, reps: int) -> list[dict]:
    """One row per block size: milliseconds to recover n_seqs x seq_len tokens of K/V each way."""
    prompts = [r.prompt_ids for r in burst(lm.vocab_size, n_seqs, (seq_len, seq_len), (1, 1), seed=1)]
    rows = []
    for bs in block_sizes:
        n_blocks = n_seqs * blocks_for(seq_len + 1, bs)
        recompute = []
        for _ in range(reps):
            # prefix caching off: the pass computes every token, as a recomputation without cached blocks does
            engine = PreemptingEngine(lm, block_size=bs, n_blocks=n_blocks, watermark_blocks=0, prefix_caching=False)
            for p in prompts:
                engine.add(p, 2, ignore_eos=True)
            start = now(lm.device)
            engine.step()  # the prefill pass: all n_seqs x seq_len tokens' K/V computed and written
            recompute.append(now(lm.device) - start)
        tables = [s.kv for s in engine.running]
        row = dict(block_size=bs, n_blocks=len({b for t in tables for b in t.block_ids}), tokens=n_seqs * seq_len,
                   recompute_ms=min(recompute) * 1e3)
        for name, batched in (("swap_ms", True), ("swap_per_block_ms", False)):
            space = SwapSpace(engine.allocator, n_blocks, batched=batched)
            times = []
            for _ in range(reps):
                start = space.out.seconds + space.into.seconds
                space.swap_out(tables)
                space.swap_in(tables)
                times.append(space.out.seconds + space.into.seconds - start)
            row[name] = min(times) * 1e3
        rows.append(row)
    return rows
