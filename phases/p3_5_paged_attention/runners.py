"""Every engine of the project, plus Hugging Face's, behind phase 3.3's `EngineRunner` interface.

`run(lm, requests, max_running) -> EngineRun(outputs, timings, kv_peak_bytes, note, settings)`:
the same requests go through each, so their numbers sit in one table.

  static       p2_1  padded batches of `max_running`, each run to its longest row
  dyn          p2_3  continuous batching, one DynamicCache and one forward pass per sequence
  paged        p3_3  the same with PagedCache over the pool (Python gather)
  batched      p3_5  continuous batching, ONE forward pass for all running sequences
  hf_static          transformers `generate` on one padded batch of everything (eager, DynamicCache)
  hf_compiled        the same with `cache_implementation="static"`: on CUDA, a compiled decode step
                     (torch.compile, CUDA graphs), the fastest path transformers alone offers
  hf_cb              transformers' continuous batching (`generate_batch`'s manager)

`hf_static` and `hf_compiled` ignore `max_running`: they are one padded batch of every request.
"""

from __future__ import annotations

from common.bench import SeqTiming
from common.workload import Request
from phases.p2_1_naive_batching.generate import generate_batch
from phases.p3_1_block_allocator.allocator import DEFAULT_BLOCK_SIZE
from phases.p3_3_paged_cache.tput import TPUT_ENGINES, EngineRun, EngineRunner, workload_pool_blocks
from phases.p3_4_gather_kernel.dispatch import use_kernels
from phases.p3_5_paged_attention.baselines import (BaselineRun, hf_compiled_generate, hf_generate_batch,
                                                   hf_static_generate)
from phases.p3_5_paged_attention.engine import BatchedPagedEngine

HF_CB_PAGE_SIZE = 16
HF_CB_MAX_BATCH_TOKENS = 512


def _first_tokens(t: SeqTiming, n: int) -> SeqTiming:
    """The timing of only the first n tokens: a row carried past what its request asked for
    finished, for that request, when its n-th token came out."""
    out = SeqTiming(arrival=t.arrival)
    for when in t.token_times[:n]:
        out.token(when)
    return out


def run_static(lm, requests: list[Request], max_running: int) -> EngineRun:
    """Phase 2.1: static batches of `max_running` requests, one after another."""
    outputs, timings, kv_peak = [], [], 0
    for i in range(0, len(requests), max_running):
        chunk = requests[i:i + max_running]
        longest = max(r.max_new_tokens for r in chunk)
        res = generate_batch(lm, [r.ids(lm) for r in chunk], longest, ignore_eos=all(r.ignore_eos for r in chunk))
        for r, out, t in zip(chunk, res.output_ids, res.timings):
            outputs.append(out[: r.max_new_tokens])
            timings.append(_first_tokens(t, r.max_new_tokens))
        kv_peak = max(kv_peak, res.kv_bytes)
    return EngineRun(outputs, timings, kv_peak, note="every row of a batch runs to the batch's longest",
                     settings=dict(max_running=max_running, kv="one left-padded DynamicCache per batch"))


def run_batched(lm, requests: list[Request], max_running: int, block_size: int = DEFAULT_BLOCK_SIZE) -> EngineRun:
    """Phase 3.5: one batched forward pass per step over the paged pool."""
    n_blocks = workload_pool_blocks(lm, requests, block_size)
    engine = BatchedPagedEngine(lm, max_running=max_running, block_size=block_size, n_blocks=n_blocks)
    seqs = [engine.add(r.ids(lm), r.max_new_tokens, sampling=r.sampling, ignore_eos=r.ignore_eos) for r in requests]
    engine.run()
    kv_peak = engine.peak_blocks_used * engine.allocator.bytes_per_block
    assert engine.allocator.n_free == n_blocks, "blocks leaked"
    settings = dict(max_running=max_running, block_size=block_size, pool_blocks=n_blocks,
                    max_prefill_tokens=engine.max_prefill_tokens,
                    attention="Triton kernels" if use_kernels(lm.device) else "PyTorch reference (no GPU)")
    return EngineRun([s.output_ids for s in seqs], [s.timing for s in seqs], kv_peak,
                     note=f"{engine.n_forward_passes} forward passes in {engine.n_steps} steps", settings=settings)


def _from_baseline(res: BaselineRun) -> EngineRun:
    return EngineRun(res.outputs, res.timings, res.kv_bytes, res.note, res.settings)


def run_hf_static(lm, requests: list[Request], max_running: int) -> EngineRun:
    return _from_baseline(hf_static_generate(lm, requests))


def run_hf_compiled(lm, requests: list[Request], max_running: int, compile: bool = True) -> EngineRun:
    return _from_baseline(hf_compiled_generate(lm, requests, compile=compile))


def run_hf_cb(lm, requests: list[Request], max_running: int, page_size: int = HF_CB_PAGE_SIZE,
              max_batch_tokens: int = HF_CB_MAX_BATCH_TOKENS) -> EngineRun:
    return _from_baseline(hf_generate_batch(lm, requests, page_size=page_size, max_batch_tokens=max_batch_tokens,
                                            max_requests_per_batch=max_running))


STATIC = EngineRunner("static", "generate_batch (p2_1): static padded batches of max_running", run_static)
BATCHED = EngineRunner("batched", "BatchedPagedEngine (p3_5): one forward pass per step for all sequences",
                       run_batched)
HF_STATIC = EngineRunner("hf_static", "transformers generate: one left-padded batch of every request", run_hf_static)
HF_COMPILED = EngineRunner("hf_compiled", "transformers generate(cache_implementation='static'): one left-padded "
                           "batch of every request, decode step compiled on CUDA (torch.compile, CUDA graphs)",
                           run_hf_compiled)
HF_CB = EngineRunner("hf_cb", f"transformers generate_batch (continuous batching, page_size {HF_CB_PAGE_SIZE})",
                     run_hf_cb)

ALL_ENGINES: list[EngineRunner] = [STATIC, *TPUT_ENGINES, BATCHED, HF_CB]
# Run by default only on CUDA: compiling is what a GPU user of transformers gets, not a CPU user
# (transformers does not compile on a CPU). Elsewhere they run when named (`--engines hf_compiled`).
CUDA_ENGINES: list[EngineRunner] = [HF_COMPILED]
ON_REQUEST: list[EngineRunner] = [HF_STATIC, HF_COMPILED]   # namable in `tput`, not in its default list


def default_engines(on_gpu: bool) -> list[EngineRunner]:
    """What `tput` runs when no engine is named: every engine, plus the CUDA-only peers on a GPU."""
    return ALL_ENGINES + (CUDA_ENGINES if on_gpu else [])
