"""`attn_bench`: this phase's decode-attention kernel beside SDPA and the PyTorch references, one layer.

Decode attention for a batch at mixed lengths, three ways:
1. SDPA over K/V already contiguous and padded to the longest sequence, with a length mask: what a non-paged
   engine runs (the copy that builds that layout is not timed);
2. the references: gather from the pool then attend in fp32 (`paged_decode_attention_reference`); gather +
   SDPA; gather per KV head + batched matmuls (`paged_decode_attention_gather_bmm`, the CPU path);
3. the kernel, `paged_decode_attention_triton`, reading K/V in place through the block tables (and its
   split-KV variant); timed on a GPU only.
Head counts come from the loaded model (SmolLM2-135M: 9 query heads over 3 KV heads, head_dim 64), so
`--model dummy:qwen3-0.6b` benchmarks Qwen3's shapes. The sweep over batch sizes and context lengths is
measure/kernel_bench.py.
"""

from __future__ import annotations

import torch

from measure.demos import Option, RunConfig, demo
from measure.kernel_bench import (LAYER, NOT_TIMED_CPU, POOL_LAYERS, KernelCase, kernel_options, kernel_sweep,
                                 timing_cell)
from measure.report import Report
from measure.paged_inputs import random_paged_batch
from extras.p3_5_paged_attention.contiguous import sdpa_decode_contiguous
from phases.p3_4_gather_kernel.reference import gather_reference
from extras.p3_5_paged_attention.cpu_path import paged_decode_attention_gather_bmm, paged_decode_attention_gather_sdpa
from phases.p3_5_paged_attention.reference import paged_decode_attention_reference

QUERY_SEED = 0


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
        from extras.p3_5_paged_attention.split_kv import paged_decode_attention_split
        from phases.p3_5_paged_attention.kernels import paged_decode_attention_triton

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
