"""`attn_bench`: decode attention for a batch at mixed lengths, three ways.

1. SDPA (contiguous): PyTorch's scaled_dot_product_attention over K/V already
   laid out contiguously and padded to the longest sequence, with a length mask:
   what a non-paged engine runs (the copy that builds that layout is not timed).
2. reference: `paged_decode_attention_reference`, gather from the pool, then attend
   in fp32; gather + SDPA; and gather per KV head + batched matmuls
   (`paged_decode_attention_gather_bmm`), the CPU path `ops.paged_decode_attention` takes.
3. kernel: `paged_decode_attention_triton`, reads K/V in place through the
   block tables (and its split-KV variant); timed on a GPU only.

Head counts come from the loaded model (SmolLM2-135M by default: 9 query heads
over 3 KV heads, head_dim 64), so `--model dummy:qwen3-0.6b` benchmarks Qwen3's shapes.
"""

from __future__ import annotations

import os

import torch
from rich.progress import Progress

from common.demos import Option, RunConfig, demo
from common.report import Report
from phases.p3_4_gather_kernel.batch import random_paged_batch
from phases.p3_4_gather_kernel.reference import gather_reference
from phases.p3_4_gather_kernel.timing import lengths_for, median_ms
from phases.p3_5_paged_attention.reference import (paged_decode_attention_gather_bmm,
                                                   paged_decode_attention_gather_sdpa,
                                                   paged_decode_attention_reference, sdpa_decode_contiguous)

POOL_LAYERS = 2
LAYER = 1
NOT_TIMED_CPU = "not timed (CPU)"
QUICK = dict(batch_sizes=[1, 2], context_lens=[5, 19], warmup=1, iters=2)


def _max_abs_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


@demo("attn_bench", phase="p3_5",
      help="paged decode attention: Triton kernel vs SDPA on contiguous K/V vs the PyTorch reference",
      options=[
          Option("batch_sizes", int, cpu=[1, 8, 32], gpu=[1, 8, 32, 64], many=True, help="sequences per batch"),
          Option("context_lens", int, cpu=[128, 512, 2048], gpu=[512, 2048, 8192], many=True,
                 help="longest sequence in a batch (others drawn from [L/2, L])"),
          Option("block_size", int, cpu=16, gpu=16, help="tokens per KV block"),
          Option("split_blocks", int, cpu=16, gpu=16, help="KV blocks per program in the split-KV variant"),
          Option("warmup", int, cpu=2, gpu=5, help="untimed calls before timing"),
          Option("iters", int, cpu=10, gpu=50, help="timed calls (median reported)"),
      ], plot=lambda report, png: plot_attn(report, png))
def attn_bench(cfg: RunConfig) -> Report:
    return _run(cfg)


def _run(cfg: RunConfig) -> Report:
    lm = cfg.load()
    opts = {k: getattr(cfg, k) for k in ("batch_sizes", "context_lens", "warmup", "iters")}
    if cfg.quick:
        opts.update(QUICK)
    device, on_gpu = lm.device, lm.device.startswith("cuda")
    report = cfg.new_report("attn_bench")
    if not on_gpu:  # other work on a shared CPU skews timings: record how busy it was
        report.meta["load_avg_1m"] = round(os.getloadavg()[0], 2)
    dtype_name = str(lm.dtype).removeprefix("torch.")
    table = report.table(f"decode attention, one layer ({lm.n_heads} query heads over {lm.n_kv_heads} KV heads, "
                         f"head_dim {lm.head_dim}, block_size {cfg.block_size}, {dtype_name})",
                         ["batch", "context", "SDPA ms", "ref ms", "gather+SDPA ms", "CPU path ms", "kernel ms",
                          "split-KV ms", "kernel/SDPA", "ref err", "kernel err"])
    rows = []
    configs = [(b, c) for b in opts["batch_sizes"] for c in opts["context_lens"]]
    gen = torch.Generator().manual_seed(0)
    with Progress(transient=True) as progress:
        task = progress.add_task("attn_bench", total=len(configs))
        for i, (batch_size, context) in enumerate(configs):
            lens = lengths_for(context, batch_size)
            batch = random_paged_batch(lens, cfg.block_size, lm.n_kv_heads, lm.head_dim, n_layers=POOL_LAYERS,
                                       dtype=lm.dtype, device=device, seed=context + batch_size)
            q = torch.randn(batch_size, lm.n_heads, lm.head_dim, generator=gen).to(device=device, dtype=lm.dtype)
            scale = lm.head_dim ** -0.5
            paged = (q, batch.kv_store, LAYER, batch.block_tables, batch.seq_lens, scale)
            k, v = gather_reference(batch.kv_store, LAYER, batch.block_tables, batch.seq_lens, max_len=context)

            sdpa_out = sdpa_decode_contiguous(q, k, v, batch.seq_lens, scale)
            ref_out = paged_decode_attention_reference(*paged, max_len=context)
            sdpa_ms = median_ms(lambda: sdpa_decode_contiguous(q, k, v, batch.seq_lens, scale),
                                device, opts["warmup"], opts["iters"])
            ref_ms = median_ms(lambda: paged_decode_attention_reference(*paged, max_len=context),
                               device, opts["warmup"], opts["iters"])
            gs_ms = median_ms(lambda: paged_decode_attention_gather_sdpa(*paged, max_len=context),
                              device, opts["warmup"], opts["iters"])
            cpu_ms = median_ms(lambda: paged_decode_attention_gather_bmm(*paged, max_len=context),
                               device, opts["warmup"], opts["iters"])
            kernel_ms, split_ms, kernel_err = _kernel(paged, sdpa_out, device, on_gpu, check=on_gpu or i == 0,
                                                      split_blocks=cfg.split_blocks, opts=opts)
            ratio = kernel_ms / sdpa_ms if isinstance(kernel_ms, float) else "-"
            ref_err = _max_abs_err(ref_out, sdpa_out)
            table.add_row(batch_size, context, sdpa_ms, ref_ms, gs_ms, cpu_ms, kernel_ms, split_ms, ratio,
                          f"{ref_err:.1e}", kernel_err if isinstance(kernel_err, str) else f"{kernel_err:.1e}")
            rows.append(dict(batch=batch_size, context=context, tokens=sum(lens), sdpa_ms=sdpa_ms,
                             reference_ms=ref_ms, gather_sdpa_ms=gs_ms, cpu_path_ms=cpu_ms,
                             kernel_ms=kernel_ms if on_gpu else None,
                             split_ms=split_ms if on_gpu else None, ref_err=ref_err,
                             kernel_err=None if isinstance(kernel_err, str) else kernel_err))
            progress.advance(task)
    report.data["rows"] = rows
    table.notes.append("Median ms per call. SDPA reads K/V already contiguous (a non-paged engine's layout); ref "
                       "gathers from the pool then attends in fp32; gather+SDPA gathers then runs SDPA; CPU path (what "
                       "the engine runs on a CPU) gathers per KV head with index_select, then two batched matmuls; "
                       "the kernel reads the pool in place. Errors: max |x - SDPA|.")
    if not on_gpu:
        table.notes.append("CPU: the kernel only runs in Triton's interpreter (each program in Python), so it is not "
                           "timed; its error is checked on the first row. GPU timings: modal run modal_run.py::attn_bench")
    return report


def _kernel(paged, sdpa_out, device, on_gpu, check, split_blocks, opts):
    """(kernel ms, split-KV ms, kernel error vs SDPA): numbers on a GPU, notes on a CPU."""
    if not check:
        return NOT_TIMED_CPU, NOT_TIMED_CPU, "-"
    from phases.p3_5_paged_attention.kernels import paged_decode_attention_split, paged_decode_attention_triton
    err = _max_abs_err(paged_decode_attention_triton(*paged), sdpa_out)
    err = max(err, _max_abs_err(paged_decode_attention_split(*paged, blocks_per_split=split_blocks), sdpa_out))
    if not on_gpu:
        return NOT_TIMED_CPU, NOT_TIMED_CPU, err
    kernel_ms = median_ms(lambda: paged_decode_attention_triton(*paged), device, opts["warmup"], opts["iters"])
    split_ms = median_ms(lambda: paged_decode_attention_split(*paged, blocks_per_split=split_blocks),
                         device, opts["warmup"], opts["iters"])
    return kernel_ms, split_ms, err


def plot_attn(report: Report, png_path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    rows = report.data["rows"]
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(4.2 * len(batches), 3.6), squeeze=False, sharey=True)
    for ax, b in zip(axes[0], batches):
        sel = sorted((r for r in rows if r["batch"] == b), key=lambda r: r["context"])
        ctx = [r["context"] for r in sel]
        for key, label in (("sdpa_ms", "SDPA, contiguous K/V"), ("reference_ms", "reference (gather + fp32 attend)"),
                           ("gather_sdpa_ms", "gather + SDPA"), ("cpu_path_ms", "gather + bmm (CPU path)"),
                           ("kernel_ms", "paged kernel"), ("split_ms", "paged kernel, split-KV")):
            ys = [r[key] for r in sel]
            if all(y is not None for y in ys):
                ax.plot(ctx, ys, marker="o", label=label)
        ax.set(title=f"batch {b}", xlabel="context (tokens)", yscale="log")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ctx, [str(c) for c in ctx])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("ms per decode attention (one layer)")
    axes[0][0].legend(fontsize=8)
    m = report.meta
    fig.suptitle(f"attn_bench: {m.get('model')} on {m.get('device_name')}, {m.get('dtype')}")
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
