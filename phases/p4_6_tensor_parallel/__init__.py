"""Phase 4.6 runs the model across several workers (tensor parallelism, the vLLM paper's §4.6): each worker holds its heads' weights and KV, and the driver alone keeps the scheduler, the blocks and the sampler.

shard.py      the cut: column-parallel q/k/v and gate/up, row-parallel o/down with one all-reduce each, heads
              split by KV-head group, a vocab-parallel embedding and LM head
message.py    the control message: a pass (ids, positions, slots, block tables) or a block move, as int64 tensors
workers.py    the processes on torch.distributed (gloo on CPUs, NCCL on GPUs): `launch`, the driver's
              `WorkerGroup`, and the `Worker` loop that obeys the messages
engine.py     the driver's side: `DriverModel` (its model call broadcasts the pass), the broadcasting copy queue
              and swap space, and `TensorParallelEngine`, which picks them when given a group
demo.py       `tp_demo`: TP=1 against TP=2, outputs, bytes per worker, blocks at equal memory, all-reduces
"""

from phases.p4_6_tensor_parallel.engine import DriverModel, TensorParallelEngine
from phases.p4_6_tensor_parallel.shard import UnsupportedTensorParallel, shard_model, split
from phases.p4_6_tensor_parallel.workers import WorkerDied, WorkerGroup, launch

__all__ = ["DriverModel", "TensorParallelEngine", "UnsupportedTensorParallel", "shard_model",
           "split", "WorkerDied", "WorkerGroup", "launch"]
