"""Phase 4.6: one model cut across workers (Megatron-style, the vLLM paper's §4.6); each holds its share of
the heads and runs the driver's forward pass in lockstep, and the shards meet in their all-reduces.

Files: shard.py (the cut), lockstep.py (the workers and the driver's model).
"""

from phases.p4_6_model_sharding.lockstep import ShardedModel, ShardGroup, launch
from phases.p4_6_model_sharding.shard import UnsupportedTensorParallel, shard_model, split

__all__ = ["ShardedModel", "ShardGroup", "launch", "UnsupportedTensorParallel", "shard_model", "split"]
