"""`gather_bench`: gather a batch's K/V from the pool three ways and time each.

1. python:    phase 3.3's `gather_python`, a Python loop over each sequence's blocks,
              once per sequence (what the per-sequence PagedCache engine does per layer)
2. reference: `gather_reference`, the whole batch in one torch indexing op
3. kernel:    `gather_triton`, the whole batch in one Triton launch (timed on a GPU only)

Shapes come from the loaded model (n_kv_heads, head_dim, dtype); each batch
mixes lengths in [context / 2, context] over scattered physical blocks.
"""

from __future__ import annotations

import os

import torch
from rich.progress import Progress

from common.demos import Option, RunConfig, demo
from common.report import Report
from phases.p3_3_paged_cache.gather import gather_python
from phases.p3_4_gather_kernel.batch import random_paged_batch
from phases.p3_4_gather_kernel.reference import gather_reference
from phases.p3_4_gather_kernel.timing import lengths_for, median_ms

POOL_LAYERS = 2      # the pool interleaves layers inside each block; two are enough to gather "a layer"
LAYER = 1
NOT_TIMED_CPU = "not timed (CPU)"
QUICK = dict(batch_sizes=[1, 2], context_lens=[5, 19], warmup=1, iters=2)


def _row_batch(lm, batch_size, context, block_size, device):
    lens = lengths_for(context, batch_size)
    return random_paged_batch(lens, block_size, lm.n_kv_heads, lm.head_dim, n_layers=POOL_LAYERS,
                              dtype=lm.dtype, device=device, seed=context + batch_size)


@demo("gather_bench", phase="p3_4", help="time the Python per-block gather vs the batched torch gather vs the Triton kernel",
      options=[
          Option("batch_sizes", int, cpu=[1, 8, 32], gpu=[1, 8, 32, 64], many=True, help="sequences per batch"),
          Option("context_lens", int, cpu=[128, 512, 2048], gpu=[512, 2048, 8192], many=True,
                 help="longest sequence in a batch (others drawn from [L/2, L])"),
          Option("block_size", int, cpu=16, gpu=16, help="tokens per KV block"),
          Option("warmup", int, cpu=2, gpu=5, help="untimed calls before timing"),
          Option("iters", int, cpu=10, gpu=50, help="timed calls (median reported)"),
      ], plot=lambda report, png: plot_gather(report, png))
def gather_bench(cfg: RunConfig) -> Report:
    return _run(cfg)


def _run(cfg: RunConfig) -> Report:
    lm = cfg.load()
    opts = {k: getattr(cfg, k) for k in ("batch_sizes", "context_lens", "warmup", "iters")}
    if cfg.quick:
        opts.update(QUICK)
    device, on_gpu = lm.device, lm.device.startswith("cuda")
    report = cfg.new_report("gather_bench")
    if not on_gpu:  # other work on a shared CPU skews timings: record how busy it was
        report.meta["load_avg_1m"] = round(os.getloadavg()[0], 2)
    table = report.table(f"gather one layer's K/V for a batch (block_size {cfg.block_size}, "
                         f"{lm.n_kv_heads} KV heads x head_dim {lm.head_dim}, {str(lm.dtype).removeprefix('torch.')})",
                         ["batch", "context", "tokens", "python ms", "ref ms", "kernel ms",
                          "python/ref", "python/kernel", "kernel == ref"])
    rows = []
    configs = [(b, c) for b in opts["batch_sizes"] for c in opts["context_lens"]]
    with Progress(transient=True) as progress:
        task = progress.add_task("gather_bench", total=len(configs))
        for i, (batch_size, context) in enumerate(configs):
            batch = _row_batch(lm, batch_size, context, cfg.block_size, device)
            args = (batch.kv_store, LAYER, batch.block_tables, batch.seq_lens)
            max_len = context  # known on the host: no device sync inside the timed call
            lens = batch.seq_lens.tolist()

            def python_gather():
                return [gather_python(batch.kv_store, ids, n, LAYER) for ids, n in zip(batch.block_ids, lens)]

            py_ms = median_ms(python_gather, device, opts["warmup"], opts["iters"])
            ref_ms = median_ms(lambda: gather_reference(*args, max_len=max_len), device, opts["warmup"], opts["iters"])
            kernel_ms, match = _kernel(args, max_len, device, on_gpu, check=on_gpu or i == 0, opts=opts)
            speedup = py_ms / kernel_ms if isinstance(kernel_ms, float) else "-"
            table.add_row(batch_size, context, sum(lens), py_ms, ref_ms, kernel_ms, py_ms / ref_ms, speedup, match)
            rows.append(dict(batch=batch_size, context=context, tokens=sum(lens), python_ms=py_ms,
                             reference_ms=ref_ms, kernel_ms=kernel_ms if on_gpu else None))
            progress.advance(task)
    report.data["rows"] = rows
    report.data["block_size"] = cfg.block_size
    table.notes.append("python: phase 3.3's per-block loop, run once per sequence; reference: one torch "
                       "indexing op for the batch; kernel: one Triton launch for the batch. Median ms.")
    if not on_gpu:
        table.notes.append("CPU: the kernel runs only in Triton's interpreter, which executes each program in "
                           "Python, so its time means nothing; it is checked against the reference on the first "
                           "row only. Kernel timings need a GPU: modal run modal_run.py::gather_bench")
    return report


def _kernel(args, max_len, device, on_gpu, check, opts):
    """(median ms or a 'not timed' note, kernel == reference or '-')."""
    if not check:
        return NOT_TIMED_CPU, "-"
    from phases.p3_4_gather_kernel.kernel import gather_triton  # CPU: sets up the interpreter
    k, v = gather_triton(*args, max_len=max_len)
    k_ref, v_ref = gather_reference(*args, max_len=max_len)
    match = bool(torch.equal(k, k_ref) and torch.equal(v, v_ref))
    if not on_gpu:
        return NOT_TIMED_CPU, match
    return median_ms(lambda: gather_triton(*args, max_len=max_len), device, opts["warmup"], opts["iters"]), match


def plot_gather(report: Report, png_path) -> None:
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
        for key, label in (("python_ms", "python per-block"), ("reference_ms", "torch reference"),
                           ("kernel_ms", "Triton kernel")):
            ys = [r[key] for r in sel]
            if all(y is not None for y in ys):
                ax.plot(ctx, ys, marker="o", label=label)
        ax.set(title=f"batch {b}", xlabel="context (tokens)", yscale="log")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ctx, [str(c) for c in ctx])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("ms per gather (one layer)")
    axes[0][0].legend()
    m = report.meta
    fig.suptitle(f"gather_bench: {m.get('model')} on {m.get('device_name')}, {m.get('dtype')}")
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
