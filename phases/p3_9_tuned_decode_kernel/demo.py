"""`decode_bench`: this phase's kernel on the clock, beside SDPA and phase 3.5's kernel, and (GPU) its launch sweep.

The two sections are measure/decode_bench.py's: `kernel` (one layer's decode attention at the model's shape; timed on a GPU,
checked against the reference in Triton's interpreter on a CPU) and `tune` (GPU: the launch-config sweep).
"""

from __future__ import annotations

from measure.demos import Option, RunConfig, demo, run_sections
from measure.report import Report
from measure.decode_bench import KERNEL_OPTIONS, KERNEL_QUICK, kernel_section, tune_section


@demo("decode_bench", phase="p3_9",
      help="the tuned decode kernel vs phase 3.5's and SDPA (ms, GB/s, share of HBM); the launch-config sweep",
      options=[Option("sections", str, cpu=["kernel"], gpu=["kernel"], many=True,
                      help="kernel and/or tune (GPU)", choices=("kernel", "tune")), *KERNEL_OPTIONS])
def decode_bench(cfg: RunConfig) -> Report:
    cfg.use_quick(**KERNEL_QUICK)
    lm = cfg.load()
    report = cfg.new_report("decode_bench")
    return run_sections(cfg, lm, report, {"kernel": kernel_section, "tune": tune_section})
