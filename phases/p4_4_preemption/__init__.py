"""Phase 4.4: requests are admitted optimistically, first come first served; when the pool runs dry the latest request is preempted (all of its sequences) and later recomputed or swapped back in, so no request is lost.

- swap.py     `SwapSpace`: a CPU block pool of the same block shape, and one indexed copy per direction
- recompute.py `RecomputePrefill`: a preempted sequence re-prefills prompt + outputs in one pass
- engine.py   `PreemptingEngine(RecomputePrefill, SharingEngine)`: FCFS admission with a watermark, all-or-nothing
              preemption of the latest group, recovery by `preemption_mode="recompute"` or `"swap"`
- compose.py  `PreemptingBeamEngine` (+ p4_2 beam search), `PrefixCachingPreemptingEngine` (+ p4_3 prefix caching)
- checks.py   `Audited` (FCFS, latest-first, whole groups, checked as it runs) and `check_finished` (no loss, no leak)
- trace.py    bursty and seeded stress workloads, `drive(engine, trace)`
- demo.py     `preempt_demo` (recompute vs swap, block sizes 8..128) and `stress_demo`
"""

from phases.p4_4_preemption.engine import PREEMPTION_MODES, PreemptingEngine, PreemptionStats
from phases.p4_4_preemption.swap import SwapSpace, SwapTraffic

__all__ = ["PREEMPTION_MODES", "PreemptingEngine", "PreemptionStats", "SwapSpace", "SwapTraffic"]
