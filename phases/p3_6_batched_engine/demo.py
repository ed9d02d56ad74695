"""Phase 3.6's demos, where the batched engine runs beside every engine before it and transformers' own.

tput            takes over phase 3.3's demo of that name (`extends="p3_3"`): the same batch-size
                sweep (measure/tput.py) with static batching (p2_1), per-sequence continuous batching
                (p2_3), per-sequence paged (p3_3), this phase's batched engine and transformers'
                `generate_batch`; on CUDA also transformers' compiled static-cache `generate`.
workload_bench  the same engines on vLLM-style equal and mixed work, ratios against this phase's
                targets, the compute roofline and a profile of one batched decode step
                (measure/workload_bench.py).
"""

from __future__ import annotations

from measure.demos import RunConfig, demo
from measure.harness import EngineRun, EngineRunner, pool_problems, submit, workload_pool_blocks
from measure.hf_peers import HF_CB, HF_COMPILED, HF_STATIC
from measure.report import Report
from measure.tput import plot_tput, run_tput, tput_options
from measure.workload import Request
from measure.workload_bench import run_workload_bench, workload_options
from phases.p2_1_naive_batching.demo import STATIC
from phases.p3_1_block_allocator.allocator import DEFAULT_BLOCK_SIZE
from phases.p3_3_paged_cache.demo import KV_ACCOUNTING, TPUT_ENGINES
from phases.p3_4_gather_kernel.dispatch import use_kernels
from phases.p3_6_batched_engine.engine import BatchedPagedEngine

WORKLOAD_ENGINES = ["hf_static", "hf_cb", "paged", "batched"]
WORKLOAD_ENGINES_GPU = ["hf_static", "hf_compiled", "hf_cb", "paged", "batched"]
TARGETS = {  # (workload, faster engine, slower engine) -> the ratio this phase aims for
    ("equal", "batched", "hf_cb"): 3.0,
    ("equal", "batched", "hf_static"): 1.0,
    ("mixed", "batched", "hf_static"): 1.5,
    ("mixed", "batched", "paged"): 3.0,
}


# --- the batched engine, as the harness runs it --------------------------------------------------
def run_batched(lm, requests: list[Request], max_running: int, block_size: int = DEFAULT_BLOCK_SIZE) -> EngineRun:
    """One batched forward pass per step over the paged pool, for every running sequence."""
    n_blocks = workload_pool_blocks(lm, requests, block_size)
    engine = BatchedPagedEngine(lm, max_running=max_running, block_size=block_size, n_blocks=n_blocks)
    submit(engine, lm, requests)
    finished = engine.run()
    assert not pool_problems(engine.allocator), "blocks leaked"
    settings = dict(max_running=max_running, block_size=block_size, pool_blocks=n_blocks,
                    max_prefill_tokens=engine.prefill.max_prefill_tokens,
                    attention="Triton kernels" if use_kernels(lm.device) else "PyTorch reference (no GPU)")
    return EngineRun.from_sequences(finished, engine.peak_blocks_used * engine.allocator.bytes_per_block,
                                    note=f"{engine.n_forward_passes} forward passes in {engine.n_steps} steps",
                                    settings=settings)


BATCHED = EngineRunner("batched", "BatchedPagedEngine (p3_6): one forward pass per step for all sequences",
                       run_batched)
ALL_ENGINES: list[EngineRunner] = [STATIC, *TPUT_ENGINES, BATCHED, HF_CB]
# Run by default only on CUDA: compiling is what a GPU user of transformers gets, not a CPU user
# (transformers does not compile on a CPU). Elsewhere they run when named (`--engines hf_compiled`).
CUDA_ENGINES: list[EngineRunner] = [HF_COMPILED]
ON_REQUEST: list[EngineRunner] = [HF_STATIC, HF_COMPILED]   # namable in `tput`, not in its default list


def default_engines(on_gpu: bool) -> list[EngineRunner]:
    """What `tput` runs when no engine is named: every engine, plus the CUDA-only peers on a GPU."""
    return ALL_ENGINES + (CUDA_ENGINES if on_gpu else [])


def prefilled_engine(lm, requests: list[Request]) -> BatchedPagedEngine:
    """Every request admitted and prefilled, so the next step is one decode step of the whole batch."""
    engine = BatchedPagedEngine(lm, max_running=len(requests), block_size=DEFAULT_BLOCK_SIZE,
                                n_blocks=workload_pool_blocks(lm, requests, DEFAULT_BLOCK_SIZE))
    for r in requests:
        engine.add(r.prompt_ids, r.max_new_tokens, ignore_eos=True)
    while engine.waiting:
        engine.step()
    return engine


# --- tput and workload_bench: every engine side by side -----------------------------------------
@demo("tput", phase="p3_6", extends="p3_3", options=tput_options(), plot=plot_tput,
      help="KV memory and tok/s per batch size for every engine, ours and transformers'")
def tput(cfg: RunConfig) -> Report:
    return run_tput(cfg, default_engines(cfg.on_gpu), on_request=ON_REQUEST, kv_note=KV_ACCOUNTING)


@demo("workload_bench", phase="p3_6",
      help="engines on equal and mixed work (vLLM-style trace), ratios vs targets, roofline, step profile",
      options=workload_options(WORKLOAD_ENGINES, WORKLOAD_ENGINES_GPU, [e.name for e in ALL_ENGINES + ON_REQUEST]))
def workload_bench(cfg: RunConfig) -> Report:
    return run_workload_bench(cfg, ALL_ENGINES + ON_REQUEST, focus="batched", targets=TARGETS,
                              profile_engine=prefilled_engine)
