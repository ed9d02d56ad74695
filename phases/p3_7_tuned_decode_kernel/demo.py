"""`decode_bench`: this phase's kernel on the clock, beside SDPA and phase 3.5's kernel, and (GPU) its launch sweep.

The two sections are bench.py's: `kernel` (one layer's decode attention at the model's shape; timed on a GPU,
checked against the reference in Triton's interpreter on a CPU) and `tune` (GPU: the launch-config sweep).
"""

from __future__ import annotations

from measure.demos import Option, RunConfig, demo, run_sections
from measure.report import Report
from phases.p3_1_block_allocator.allocator import DEFAULT_BLOCK_SIZE
from phases.p3_7_tuned_decode_kernel.bench import kernel_section, tune_section


@demo("decode_bench", phase="p3_7",
      help="the tuned decode kernel vs phase 3.5's and SDPA (ms, GB/s, share of HBM); the launch-config sweep",
      options=[Option("sections", str, cpu=["kernel"], gpu=["kernel"], many=True,
                      help="kernel and/or tune (GPU)", choices=("kernel", "tune")),
               Option("kernel_batches", int, cpu=[2, 8], gpu=[32, 64, 128, 256], many=True,
                      help="kernel section batch sizes"),
               Option("kernel_contexts", int, cpu=[64], gpu=[512, 1024, 2048], many=True,
                      help="kernel section context lengths"),
               Option("block_size", int, cpu=DEFAULT_BLOCK_SIZE, help="tokens per KV block")])
def decode_bench(cfg: RunConfig) -> Report:
    cfg.use_quick(kernel_batches=[2], kernel_contexts=[32])
    lm = cfg.load()
    report = cfg.new_report("decode_bench")
    return run_sections(cfg, lm, report, {"kernel": kernel_section, "tune": tune_section})
