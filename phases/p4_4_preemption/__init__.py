"""Phase 4.4 adds preemption to phase 4.1's engine with phase 4.3's prefix cache: requests are admitted optimistically, first come first served; when the pool runs dry the latest request is preempted (all of its sequences) and later recomputed or swapped back in, so no request is lost.

Files:
- swap.py    `SwapSpace`: a CPU block pool of the same block shape, and one indexed copy per direction;
             `NoSwapSpace`, the part recompute mode picks instead (no pool)
- engine.py  `OptimisticAdmission`, the admission part (a group's prefill fits now, with a watermark), and
             `PreemptingEngine(PrefixCachingEngine)`, the engine line so far
             (samples, prefix caching, preemption): FCFS admission of whole groups,
             preemption of the latest group (a group part-way through its prefill too), recovery by
             `preemption_mode="recompute"` (prompt + outputs re-prefilled in chunks, still-cached blocks
             mapped back in) or `"swap"`
- reservation.py  `ReservingEngine` and its admission part: Orca's reservations (oracle, pow2, max) on this
             engine, each request holding its whole reservation from admission to finish, the baselines
             paged allocation is measured against (`rate_sweep`); `UnsharedReservingEngine` for samples and beams
- checks.py  `Audited` (FCFS, latest-first, whole groups, checked as the engine runs) and `check_finished`
             (no request lost, no block leaked)
- demo.py    `preempt_demo` (recompute vs swap, block sizes 8..128, and the recovery micro-benchmark of
             the paper's Fig. 19a) and `stress_demo` (a seeded bursty trace, every invariant checked): this
             phase's engines handed to the harness in measure/ (preempt_bench.py, recovery_bench.py,
             stress_bench.py; traces from workload.py, driven by harness.py's `drive`) and `rate_sweep` (paged
             allocation against the three reservations under Poisson arrivals, the paper's Fig. 12 and 13;
             measure/rate_bench.py, driven by harness.py's `drive_timed`), `block_sweep` (Fig. 18b, 19b) and
             `share_sweep` (Fig. 14)
- README.md  the idea, its files, how to run it; its tables: docs/measurements/p4_4_preemption.md
"""

from phases.p4_4_preemption.engine import PREEMPTED, PREEMPTION_MODES, PreemptingEngine, PreemptionStats
from phases.p4_4_preemption.swap import SwapSpace, SwapTraffic

__all__ = ["PREEMPTED", "PREEMPTION_MODES", "PreemptingEngine", "PreemptionStats", "SwapSpace", "SwapTraffic"]
