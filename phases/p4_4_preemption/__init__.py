"""Phase 4.4: optimistic FCFS admission; the latest request is preempted whole, then recomputed or swapped back."""

from phases.p4_4_preemption.engine import PREEMPTED, PREEMPTION_MODES, PreemptingEngine, PreemptionStats
from phases.p4_4_preemption.swap import SwapSpace, SwapTraffic

__all__ = ["PREEMPTED", "PREEMPTION_MODES", "PreemptingEngine", "PreemptionStats", "SwapSpace", "SwapTraffic"]
