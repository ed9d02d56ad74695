"""`FusedOverlappedEngine`: phase 3.11's fused decode step with phase 3.10's overlapped steps (both extras' ideas).

The host builds step N+1 while the GPU runs step N (extras/p3_10_cuda_graphs/overlap.py); that matters more
once the fused kernels have shrunk the GPU's share of a step.
"""

from __future__ import annotations

from extras.p3_10_cuda_graphs.overlap import OverlappedDecodeEngine
from phases.p3_11_fused_ops.engine import FusedDecodeEngine


class FusedOverlappedEngine(FusedDecodeEngine, OverlappedDecodeEngine):
    """`FusedDecodeEngine` whose decode-only streaks overlap the host's work with the GPU's."""
