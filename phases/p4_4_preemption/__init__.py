"""Phase 4.4: requests are admitted optimistically, first come first served; when the pool runs dry the latest request is preempted (all of its sequences) and later recomputed or swapped back in, so no request is lost.

- swap.py       `SwapSpace`: a CPU block pool of the same block shape, and one indexed copy per direction
- engine.py     `PreemptingEngine(PrefixCachingEngine)`, the last engine of the line (samples, beams, prefix
                caching, preemption): FCFS admission of whole groups with a watermark, preemption of the latest
                group, recovery by `preemption_mode="recompute"` (prompt + outputs re-prefilled in one pass,
                still-cached blocks mapped back in) or `"swap"`
- microbench.py what one recovery costs per block size: swap (batched, per block) vs recomputation
- checks.py     `Audited` (FCFS, latest-first, whole groups, checked as it runs) and `check_finished` (no loss, no leak)
- trace.py      bursty and seeded stress workloads, `drive(engine, trace)`
- demo.py       `preempt_demo` (recompute vs swap, block sizes 8..128) and `stress_demo`
"""

from phases.p4_4_preemption.engine import PREEMPTION_MODES, PreemptingEngine, PreemptionStats
from phases.p4_4_preemption.swap import SwapSpace, SwapTraffic

__all__ = ["PREEMPTION_MODES", "PreemptingEngine", "PreemptionStats", "SwapSpace", "SwapTraffic"]
