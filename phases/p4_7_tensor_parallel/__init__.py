"""Phase 4.7: phase 4.5's engine over phase 4.6's workers; the driver alone keeps the scheduler, the blocks
and the sampler, and broadcasts each pass and each block move to the workers' pools.

Files: message.py (the control message), engine.py (the driver's side), workers.py (the workers' side),
demo.py (`tp_demo`).
"""

from phases.p4_7_tensor_parallel.engine import DriverModel, TensorParallelEngine
from phases.p4_7_tensor_parallel.workers import WorkerDied, WorkerGroup, launch

__all__ = ["DriverModel", "TensorParallelEngine", "WorkerDied", "WorkerGroup", "launch"]
