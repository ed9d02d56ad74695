"""`FusedDecodeEngine`: phase 3.10's static decode step with RMSNorm, rotary and SwiGLU each one kernel.

The fused ops are on inside the step only, so the graph captures them. On by default only where
`use_kernels` says kernels run (CUDA); elsewhere `fused_ops=True` is refused.
"""

from __future__ import annotations

import torch

from phases.p3_4_gather_kernel.dispatch import FORCE_KERNELS_ENV, use_kernels
from phases.p3_10_cuda_graphs.attention import StaticDecodeBatch
from phases.p3_10_cuda_graphs.engine import StaticDecodeEngine
from phases.p3_10_cuda_graphs.runner import StaticRunner
from phases.p3_11_fused_ops.layers import fused_ops_on, install_fused_ops


class FusedRunner(StaticRunner):
    """Phase 3.10's runner; its static pass runs with the fused norm, rotary and SwiGLU kernels on."""

    def static_forward(self, batch: StaticDecodeBatch) -> torch.Tensor:
        with fused_ops_on():
            return super().static_forward(batch)


class FusedDecodeEngine(StaticDecodeEngine):
    """Phase 3.10's engine; its static decode step launches the fused norm, rotary and SwiGLU kernels."""

    def __init__(self, lm, *args, fused_ops: bool | None = None, **kwargs):
        kernels_run_here = use_kernels(lm.device)
        if fused_ops and not kernels_run_here:
            raise ValueError(f"fused_ops=True needs the model on a CUDA device; it is on {lm.device} (the fused "
                             f"kernels would run in Triton's interpreter; tests set {FORCE_KERNELS_ENV}=1 for that)")
        self.fused_ops = kernels_run_here if fused_ops is None else bool(fused_ops)   # read by make_runner
        super().__init__(lm, *args, **kwargs)
        self.fused_modules = install_fused_ops(lm.model) if self.fused_ops else None

    def make_runner(self) -> StaticRunner:
        """`FusedRunner` when the fused kernels are on (its modules are installed right after); else 3.10's."""
        runner = FusedRunner if self.fused_ops else StaticRunner
        return runner(self.lm, self.allocator, self.max_running, self.cuda_graphs, self.buckets, self.cpu_step)

