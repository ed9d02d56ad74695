"""Phase 3.5's demos: `attn_bench` (the kernel), `tput` and `workload_bench` (the batched engine among all others).

attn_bench      decode attention for a batch at mixed lengths, three ways, one layer:
                1. SDPA over K/V already contiguous and padded to the longest sequence,
                   with a length mask: what a non-paged engine runs (the copy that builds
                   that layout is not timed);
                2. the references: gather from the pool then attend in fp32
                   (`paged_decode_attention_reference`); gather + SDPA; gather per KV head +
                   batched matmuls (`paged_decode_attention_gather_bmm`, the CPU path);
                3. the kernel, `paged_decode_attention_triton`, reading K/V in place through
                   the block tables (and its split-KV variant); timed on a GPU only.
                Head counts come from the loaded model (SmolLM2-135M: 9 query heads over 3 KV
                heads, head_dim 64), so `--model dummy:qwen3-0.6b` benchmarks Qwen3's shapes.
                The sweep over batch sizes and context lengths is measure/kernel_bench.py.
tput            takes over phase 3.3's demo of that name (`extends="p3_3"`): the same batch-size
                sweep (measure/tput.py) with static batching (p2_1), per-sequence continuous batching
                (p2_3), per-sequence paged (p3_3), this phase's batched engine and transformers'
                `generate_batch`; on CUDA also transformers' compiled static-cache `generate`.
workload_bench  the same engines on vLLM-style equal and mixed work, ratios against this phase's
                targets, the compute roofline and a profile of one batched decode step
                (measure/workload_bench.py).
"""

from __future__ import annotations

import torch

from measure.demos import Option, RunConfig, demo
from measure.harness import EngineRun, EngineRunner, pool_problems, submit, workload_pool_blocks
from measure.hf_peers import HF_CB, HF_COMPILED, HF_STATIC
from measure.kernel_bench import (LAYER, NOT_TIMED_CPU, POOL_LAYERS, KernelCase, kernel_options, kernel_sweep,
                                 timing_cell)
from measure.report import Report
from measure.tput import plot_tput, run_tput, tput_options
from measure.workload import Request
from measure.workload_bench import run_workload_bench, workload_options
from phases.p2_1_naive_batching.demo import STATIC
from phases.p3_1_block_allocator.allocator import DEFAULT_BLOCK_SIZE
from phases.p3_3_paged_cache.demo import KV_ACCOUNTING, TPUT_ENGINES
from phases.p3_4_gather_kernel.batch import random_paged_batch
from phases.p3_4_gather_kernel.dispatch import use_kernels
from phases.p3_4_gather_kernel.reference import gather_reference
from phases.p3_5_paged_attention.engine import BatchedPagedEngine
from phases.p3_5_paged_attention.reference import (paged_decode_attention_gather_bmm,
                                                   paged_decode_attention_gather_sdpa,
                                                   paged_decode_attention_reference, sdpa_decode_contiguous)

QUERY_SEED = 0
WORKLOAD_ENGINES = ["hf_static", "hf_cb", "paged", "batched"]
WORKLOAD_ENGINES_GPU = ["hf_static", "hf_compiled", "hf_cb", "paged", "batched"]
TARGETS = {  # (workload, faster engine, slower engine) -> the ratio this phase aims for
    ("equal", "batched", "hf_cb"): 3.0,
    ("equal", "batched", "hf_static"): 1.0,
    ("mixed", "batched", "hf_static"): 1.5,
    ("mixed", "batched", "paged"): 3.0,
}


# --- attn_bench: the kernel --------------------------------------------------------------------
def max_abs_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def measure_attention(case: KernelCase, gen: torch.Generator, split_blocks: int) -> tuple[list, dict]:
    """One cell: time every way of attending over one random batch; each one's error against SDPA."""
    lm, context, device = case.lm, case.context, case.device
    batch = random_paged_batch(case.lens, case.block_size, lm.n_kv_heads, lm.head_dim, n_layers=POOL_LAYERS,
                               dtype=lm.dtype, device=device, seed=case.seed)
    q = torch.randn(case.batch_size, lm.n_heads, lm.head_dim, generator=gen).to(device=device, dtype=lm.dtype)
    scale = lm.head_dim ** -0.5
    paged = (q, batch.kv_store, LAYER, batch.block_tables, batch.seq_lens, scale)
    k, v = gather_reference(batch.kv_store, LAYER, batch.block_tables, batch.seq_lens, max_len=context)

    sdpa_out = sdpa_decode_contiguous(q, k, v, batch.seq_lens, scale)
    ref_out = paged_decode_attention_reference(*paged, max_len=context)
    sdpa_ms = case.time(lambda: sdpa_decode_contiguous(q, k, v, batch.seq_lens, scale))
    ref_ms = case.time(lambda: paged_decode_attention_reference(*paged, max_len=context))
    gs_ms = case.time(lambda: paged_decode_attention_gather_sdpa(*paged, max_len=context))
    cpu_ms = case.time(lambda: paged_decode_attention_gather_bmm(*paged, max_len=context))
    kernel_ms, split_ms, kernel_gpu, split_gpu, kernel_err = NOT_TIMED_CPU, NOT_TIMED_CPU, None, None, "-"
    if case.check_kernel:
        from phases.p3_5_paged_attention.kernels import paged_decode_attention_split, paged_decode_attention_triton

        def split():
            return paged_decode_attention_split(*paged, blocks_per_split=split_blocks)

        kernel_err = max(max_abs_err(paged_decode_attention_triton(*paged), sdpa_out), max_abs_err(split(), sdpa_out))
        kernel_ms = case.time_kernel(lambda: paged_decode_attention_triton(*paged))
        split_ms = case.time_kernel(split)
        kernel_gpu = case.time_kernel_gpu(lambda: paged_decode_attention_triton(*paged))
        split_gpu = case.time_kernel_gpu(split)
    ratio = kernel_ms / sdpa_ms if isinstance(kernel_ms, float) else "-"
    ref_err = max_abs_err(ref_out, sdpa_out)
    cells = [case.batch_size, context, sdpa_ms, ref_ms, gs_ms, cpu_ms, kernel_ms, split_ms, timing_cell(kernel_gpu),
             timing_cell(split_gpu), ratio, f"{ref_err:.1e}",
             kernel_err if isinstance(kernel_err, str) else f"{kernel_err:.1e}"]
    return cells, dict(batch=case.batch_size, context=context, tokens=sum(case.lens), sdpa_ms=sdpa_ms,
                       reference_ms=ref_ms, gather_sdpa_ms=gs_ms, cpu_path_ms=cpu_ms,
                       kernel_ms=kernel_ms if case.on_gpu else None, split_ms=split_ms if case.on_gpu else None,
                       kernel_gpu_ms=kernel_gpu and kernel_gpu.ms, split_gpu_ms=split_gpu and split_gpu.ms,
                       gpu_timing=kernel_gpu and dict(kernel=kernel_gpu.how, split=split_gpu.how),
                       ref_err=ref_err, kernel_err=None if isinstance(kernel_err, str) else kernel_err)


def plot_attn(report: Report, png_path) -> None:
    from measure import plots
    m = report.meta
    plots.per_batch_timings(png_path, report.data["rows"],
                            {"sdpa_ms": "SDPA, contiguous K/V", "reference_ms": "reference (gather + fp32 attend)",
                             "gather_sdpa_ms": "gather + SDPA", "cpu_path_ms": "gather + bmm (CPU path)",
                             "kernel_ms": "paged kernel", "split_ms": "paged kernel, split-KV",
                             "kernel_gpu_ms": "paged kernel, GPU time (graph replay)"},
                            ylabel="ms per decode attention (one layer)",
                            title=f"attn_bench: {m.get('model')} on {m.get('device_name')}, {m.get('dtype')}")


@demo("attn_bench", phase="p3_5", plot=plot_attn,
      help="paged decode attention: Triton kernel vs SDPA on contiguous K/V vs the PyTorch reference",
      options=kernel_options(Option("split_blocks", int, cpu=16, gpu=16,
                                    help="KV blocks per program in the split-KV variant")))
def attn_bench(cfg: RunConfig) -> Report:
    lm = cfg.load()
    gen = torch.Generator().manual_seed(QUERY_SEED)   # one stream of queries over the whole sweep
    report, table = kernel_sweep(
        cfg, "attn_bench",
        f"decode attention, one layer ({lm.n_heads} query heads over {lm.n_kv_heads} KV heads, head_dim "
        f"{lm.head_dim}, block_size {cfg.block_size}, {str(lm.dtype).removeprefix('torch.')})",
        ["batch", "context", "SDPA ms", "ref ms", "gather+SDPA ms", "CPU path ms", "kernel ms", "split-KV ms",
         "kernel GPU ms", "split-KV GPU ms", "kernel/SDPA", "ref err", "kernel err"],
        lambda case: measure_attention(case, gen, cfg.split_blocks))
    table.notes.append("Median ms per call, launch included (what this phase's eager engine pays; kernel/SDPA is "
                       "of these); kernel and split-KV GPU ms: each kernel's GPU time alone, from CUDA-graph "
                       "replays (measure/kernel_bench.gpu_time). SDPA reads K/V already contiguous (a non-paged "
                       "engine's layout); ref gathers from the pool then attends in fp32; gather+SDPA gathers then "
                       "runs SDPA; CPU path (what the engine runs on a CPU) gathers per KV head with index_select, "
                       "then two batched matmuls; the kernel reads the pool in place. Errors: max |x - SDPA|.")
    if not cfg.on_gpu:
        table.notes.append("CPU: the kernel only runs in Triton's interpreter (each program in Python), so it is not "
                           "timed; its error is checked on the first row. GPU timings: modal run modal_run.py::attn_bench")
    return report


# --- the batched engine, as the harness runs it --------------------------------------------------
def run_batched(lm, requests: list[Request], max_running: int, block_size: int = DEFAULT_BLOCK_SIZE) -> EngineRun:
    """One batched forward pass per step over the paged pool, for every running sequence."""
    n_blocks = workload_pool_blocks(lm, requests, block_size)
    engine = BatchedPagedEngine(lm, max_running=max_running, block_size=block_size, n_blocks=n_blocks)
    submit(engine, lm, requests)
    finished = engine.run()
    assert not pool_problems(engine.allocator), "blocks leaked"
    settings = dict(max_running=max_running, block_size=block_size, pool_blocks=n_blocks,
                    max_prefill_tokens=engine.max_prefill_tokens,
                    attention="Triton kernels" if use_kernels(lm.device) else "PyTorch reference (no GPU)")
    return EngineRun.from_sequences(finished, engine.peak_blocks_used * engine.allocator.bytes_per_block,
                                    note=f"{engine.n_forward_passes} forward passes in {engine.n_steps} steps",
                                    settings=settings)


BATCHED = EngineRunner("batched", "BatchedPagedEngine (p3_5): one forward pass per step for all sequences",
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
@demo("tput", phase="p3_5", extends="p3_3", options=tput_options(), plot=plot_tput,
      help="KV memory and tok/s per batch size for every engine, ours and transformers'")
def tput(cfg: RunConfig) -> Report:
    return run_tput(cfg, default_engines(cfg.on_gpu), on_request=ON_REQUEST, kv_note=KV_ACCOUNTING)


@demo("workload_bench", phase="p3_5",
      help="engines on equal and mixed work (vLLM-style trace), ratios vs targets, roofline, step profile",
      options=workload_options(WORKLOAD_ENGINES, WORKLOAD_ENGINES_GPU, [e.name for e in ALL_ENGINES + ON_REQUEST]))
def workload_bench(cfg: RunConfig) -> Report:
    return run_workload_bench(cfg, ALL_ENGINES + ON_REQUEST, focus="batched", targets=TARGETS,
                              profile_engine=prefilled_engine)
