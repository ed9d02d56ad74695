"""Phase 4.4: optimistic FCFS admission; when the pool runs dry the latest request is preempted whole, and later
recomputed or swapped back in, so no request is lost.

Files:
- engine.py  `OptimisticAdmission` and `PreemptingEngine`: admission, preemption, recovery by recomputation
- swap.py    `SwapSpace`: a CPU block pool and one indexed copy each way; `NoSwapSpace` for recompute mode
- demo.py    the demos, handed to measure/ (Orca's reservations, the baseline: extras/p4_4_preemption/)
"""

from phases.p4_4_preemption.engine import PREEMPTED, PREEMPTION_MODES, PreemptingEngine, PreemptionStats
from phases.p4_4_preemption.swap import SwapSpace, SwapTraffic

__all__ = ["PREEMPTED", "PREEMPTION_MODES", "PreemptingEngine", "PreemptionStats", "SwapSpace", "SwapTraffic"]
