"""`gather_bench`: gather a batch's K/V from the pool three ways and time each.

1. python:    phase 3.3's `gather_python`, a Python loop over each sequence's blocks,
              once per sequence (what the per-sequence PagedCache engine does per layer)
2. reference: `gather_reference`, the whole batch in one torch indexing op
3. kernel:    `gather_triton`, the whole batch in one Triton launch (timed on a GPU only)

Shapes come from the loaded model (n_kv_heads, head_dim, dtype); each batch
mixes lengths in [context / 2, context] over scattered physical blocks. The
sweep over batch sizes and context lengths is measure/kernel_bench.py.
"""

from __future__ import annotations

import torch

from measure.demos import Option, RunConfig, demo
from measure.kernel_bench import (LAYER, NOT_TIMED_CPU, POOL_LAYERS, KernelCase, kernel_options, kernel_sweep,
                                 timing_cell)
from measure.report import Report
from phases.p3_3_paged_cache.gather import gather_python
from measure.paged_inputs import random_paged_batch
from phases.p3_4_gather_kernel.reference import gather_reference


def measure_gather(case: KernelCase) -> tuple[list, dict]:
    """One cell: time the three gathers of one random batch; check the kernel against the reference."""
    lm, lens = case.lm, case.lens
    batch = random_paged_batch(lens, case.block_size, lm.n_kv_heads, lm.head_dim, n_layers=POOL_LAYERS,
                               dtype=lm.dtype, device=case.device, seed=case.seed)
    args = (batch.kv_store, LAYER, batch.block_tables, batch.seq_lens)
    max_len = case.context  # known on the host: no device sync inside the timed call

    def python_gather():
        return [gather_python(batch.kv_store, ids, n, LAYER) for ids, n in zip(batch.block_ids, lens)]

    py_ms = case.time(python_gather)
    ref_ms = case.time(lambda: gather_reference(*args, max_len=max_len))
    kernel_ms, kernel_gpu, match = NOT_TIMED_CPU, None, "-"
    if case.check_kernel:
        from phases.p3_4_gather_kernel.kernel import gather_triton  # CPU: sets up the interpreter
        k, v = gather_triton(*args, max_len=max_len)
        k_ref, v_ref = gather_reference(*args, max_len=max_len)
        match = bool(torch.equal(k, k_ref) and torch.equal(v, v_ref))
        kernel_ms = case.time_kernel(lambda: gather_triton(*args, max_len=max_len))
        kernel_gpu = case.time_kernel_gpu(lambda: gather_triton(*args, max_len=max_len))
    speedup = py_ms / kernel_ms if isinstance(kernel_ms, float) else "-"
    cells = [case.batch_size, case.context, sum(lens), py_ms, ref_ms, kernel_ms, timing_cell(kernel_gpu),
             py_ms / ref_ms, speedup, match]
    return cells, dict(batch=case.batch_size, context=case.context, tokens=sum(lens), python_ms=py_ms,
                       reference_ms=ref_ms, kernel_ms=kernel_ms if case.on_gpu else None,
                       kernel_gpu_ms=kernel_gpu and kernel_gpu.ms, kernel_gpu_timing=kernel_gpu and kernel_gpu.how)


def plot_gather(report: Report, png_path) -> None:
    from measure import plots
    m = report.meta
    plots.per_batch_timings(png_path, report.data["rows"],
                            {"python_ms": "python per-block", "reference_ms": "torch reference",
                             "kernel_ms": "Triton kernel", "kernel_gpu_ms": "Triton kernel, GPU time (graph replay)"},
                            ylabel="ms per gather (one layer)",
                            title=f"gather_bench: {m.get('model')} on {m.get('device_name')}, {m.get('dtype')}")


@demo("gather_bench", phase="p3_4", options=kernel_options(), plot=plot_gather,
      help="time the Python per-block gather vs the batched torch gather vs the Triton kernel")
def gather_bench(cfg: RunConfig) -> Report:
    lm = cfg.load()
    report, table = kernel_sweep(
        cfg, "gather_bench",
        f"gather one layer's K/V for a batch (block_size {cfg.block_size}, {lm.n_kv_heads} KV heads x head_dim "
        f"{lm.head_dim}, {str(lm.dtype).removeprefix('torch.')})",
        ["batch", "context", "tokens", "python ms", "ref ms", "kernel ms", "kernel GPU ms", "python/ref",
         "python/kernel", "kernel == ref"], measure_gather)
    report.data["block_size"] = cfg.block_size
    table.notes.append("python: phase 3.3's per-block loop, run once per sequence; reference: one torch "
                       "indexing op for the batch; kernel: one Triton launch for the batch. Median ms per call, "
                       "launch included (what an eager engine pays); kernel GPU ms: the kernel's GPU time alone, "
                       "from CUDA-graph replays (measure/kernel_bench.gpu_time).")
    if not cfg.on_gpu:
        table.notes.append("CPU: the kernel runs only in Triton's interpreter, which executes each program in "
                           "Python, so its time means nothing; it is checked against the reference on the first "
                           "row only. Kernel timings need a GPU: modal run modal_run.py::gather_bench")
    return report


# --- stack_bench: N calls or one padded stack ------------------------------------------------------------
STACK_BATCH_SIZES_CPU = [1, 2, 4, 8, 16]
STACK_BATCH_SIZES_GPU = [1, 4, 16, 64]


@demo("stack_bench", phase="p3_4",
      help="a decode step: N forward passes of batch 1 (phase 3.3) vs ONE pass over a padded stack of every "
           "sequence's gathered K/V (the blog's question)",
      options=[Option("batch_sizes", int, cpu=STACK_BATCH_SIZES_CPU, gpu=STACK_BATCH_SIZES_GPU, many=True,
                      help="sequences decoding"),
               Option("prompt_min", int, cpu=16, help="shortest prompt (tokens)"),
               Option("prompt_max", int, cpu=256, help="longest prompt (tokens)"),
               Option("steps", int, cpu=5, gpu=20, help="timed decode steps per cell")])
def stack_bench(cfg: RunConfig) -> Report:
    from measure.step_bench import decode_step_ms, random_prompts
    from phases.p3_1_block_allocator.allocator import DEFAULT_BLOCK_SIZE, blocks_for
    from phases.p3_3_paged_cache.scheduler import PagedScheduler
    from extras.p3_4_gather_kernel.pad_stack import PadStackScheduler
    cfg.use_quick(batch_sizes=[2], steps=1, prompt_min=4, prompt_max=12)
    lm = cfg.load()
    report = cfg.new_report("stack_bench")
    lengths = (cfg.prompt_min, cfg.prompt_max)
    t = report.table(f"one decode step, prompts of {cfg.prompt_min}-{cfg.prompt_max} tokens "
                     f"(median of {cfg.steps} steps)",
                     ["batch", "N calls ms", "pad + stack ms", "stack / N calls", "padded slots per token"])
    rows = []
    for batch in cfg.batch_sizes:
        prompts = random_prompts(lm.vocab_size, batch, lengths)
        blocks = sum(blocks_for(len(p) + cfg.steps + 8, DEFAULT_BLOCK_SIZE) for p in prompts)
        timed = {}
        for name, cls in (("n_calls", PagedScheduler), ("pad_stack", PadStackScheduler)):
            r = decode_step_ms(lambda lm_, n: cls(lm_, max_running=n, n_blocks=blocks), lm, batch, lengths,
                               cfg.steps)
            timed[name] = r["ms"]
        longest = max(len(p) for p in prompts)
        padding = (batch * longest - sum(len(p) for p in prompts)) / sum(len(p) for p in prompts)
        t.add_row(batch, timed["n_calls"], timed["pad_stack"], timed["pad_stack"] / timed["n_calls"], padding)
        rows.append(dict(batch=batch, n_calls_ms=timed["n_calls"], pad_stack_ms=timed["pad_stack"],
                         padding_per_token=padding))
    t.notes.append("N calls: phase 3.3's PagedScheduler, one forward pass of batch 1 per sequence, each attending "
                   "its own gathered K/V. pad + stack: every sequence's K/V gathered from the pool, padded to the "
                   "longest, stacked into one DynamicCache with a padding mask, ONE forward pass, the new K/V "
                   "scattered back (extras/p3_4_gather_kernel/pad_stack.py). Padded slots per token: wasted cache positions per real one "
                   "in the stack (at the prompts' lengths).")
    report.data["rows"] = rows
    return report
