"""Phase 4.6: the model cut across workers (tensor parallelism, the vLLM paper's §4.6); the driver alone keeps
the scheduler, the blocks and the sampler, and broadcasts each pass.

Files: shard.py (the cut), message.py (the control message), workers.py (the processes), engine.py (the
driver's side), demo.py (`tp_demo`).
"""

from phases.p4_6_tensor_parallel.engine import DriverModel, TensorParallelEngine, use_tensor_parallel
from phases.p4_6_tensor_parallel.shard import UnsupportedTensorParallel, shard_model, split
from phases.p4_6_tensor_parallel.workers import WorkerDied, WorkerGroup, launch

__all__ = ["DriverModel", "TensorParallelEngine", "use_tensor_parallel", "UnsupportedTensorParallel", "shard_model",
           "split", "WorkerDied", "WorkerGroup", "launch"]
