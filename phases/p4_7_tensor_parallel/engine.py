"""The driver's side: its model call broadcasts the pass, and its pool's block moves are sent too.

On the driver `lm.model` is a `DriverModel`: it sends the pass to the workers (message.py), then runs
rank 0's shard, and the shards meet in their all-reduces (shard.py). So every earlier runner (3.6's, 3.8's
mixed pass, 3.10's static step, 4.5's verifier) runs under tensor parallelism unchanged.

The scheduler, allocator, block tables, prefix cache and sampler exist once, on the driver. A worker hears
which slots to write and blocks to read (every PASS), and which whole blocks to move: copy-on-write's copies
(`BroadcastCopyQueue`) and preemption's swaps (`BroadcastSwapSpace`), each sent before the driver makes it.
`TensorParallelEngine(lm, group)` picks these parts; with no group it is phase 4.5's engine. Refused: CUDA
graphs (a replay would skip the broadcast) and a self-draft (the target's cut layers on the driver alone).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from phases.p4_1_copy_on_write.block_ops import CopyQueue
from phases.p4_4_preemption.swap import SwapSpace
from phases.p4_5_speculative_decoding.engine import SpeculativeEngine
from phases.p4_5_speculative_decoding.proposers import DraftProposer
from phases.p4_7_tensor_parallel.message import COPY, SWAP_IN, SWAP_OUT, encode_pass


class DriverModel(nn.Module):
    """Rank 0's shard behind the model's own call: each call first sends the pass to the workers."""

    def __init__(self, shard: nn.Module, group):
        super().__init__()
        self.shard = shard
        self.group = group    # a WorkerGroup (workers.py)
        self.n_passes = 0

    # What the runners and transformers read of a model, from the shard (one config: switching the attention
    # implementation on the driver's model switches it on the shard).
    @property
    def config(self):
        return self.shard.config

    @property
    def generation_config(self):
        return self.shard.generation_config

    def set_attn_implementation(self, name: str) -> None:
        self.shard.set_attn_implementation(name)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, paged, use_cache: bool = False,
                logits_to_keep=1):
        self.group.send(*encode_pass(input_ids, position_ids, paged, logits_to_keep,
                                     self.config._attn_implementation))
        try:
            out = self.shard(input_ids=input_ids, position_ids=position_ids, paged=paged, use_cache=use_cache,
                             logits_to_keep=logits_to_keep)
        except Exception as error:   # the workers wait in collectives the driver will not join: the group is lost
            raise self.group.failed(error) from error
        self.n_passes += 1
        return out


@dataclass
class BroadcastCopyQueue(CopyQueue):
    """Phase 4.1's copies, sent to every worker before the driver makes them on its own pool."""
    group: Any = field(default=None, repr=False)

    def flush(self, kv_store: torch.Tensor) -> int:
        if self.src:
            self.group.send_ids(COPY, self.src, self.dst)
        return super().flush(kv_store)


class BroadcastSwapSpace(SwapSpace):
    """Phase 4.4's CPU pool; every batch of blocks moved is sent first, and each worker moves its heads' share
    between its own two pools."""

    def __init__(self, gpu, n_blocks: int, group):
        super().__init__(gpu, n_blocks, batched=True)   # one indexed copy per move: one message per move
        self.group = group

    def _copy(self, src_store, dst_store, src_ids, dst_ids) -> None:
        if src_ids:
            self.group.send_ids(SWAP_OUT if src_store is self.gpu.kv_store else SWAP_IN, src_ids, dst_ids)
        super()._copy(src_store, dst_store, src_ids, dst_ids)


class TensorParallelEngine(SpeculativeEngine):
    """Phase 4.5's engine over a tensor-parallel group: the model cut across its workers, everything else on the
    driver (`group=None`: one device, phase 4.5's engine)."""

    def __init__(self, lm, group=None, speculative=None, **engine_kwargs):
        if group is not None:
            check_tensor_parallel(lm, group, speculative, engine_kwargs.get("cuda_graphs"))
            engine_kwargs["cuda_graphs"] = False
        self.tensor_parallel = group    # read by make_kv and make_swap_space, during the constructors
        super().__init__(lm, speculative=speculative, **engine_kwargs)
        if group is not None:           # every worker builds its pools for the engine's blocks
            cpu = self.swap_space.cpu       # None: no CPU pool ("recompute")
            group.setup(self.allocator.n_blocks, self.block_size, 0 if cpu is None else cpu.n_blocks)

    def make_kv(self):
        """The engine's KV part; its copy-on-write copies are sent to every worker first."""
        kv = super().make_kv()
        if self.tensor_parallel is not None:
            kv.copies = BroadcastCopyQueue(group=self.tensor_parallel)
        return kv

    def make_swap_space(self, cpu_blocks: int):
        """Phase 4.4's CPU pool, each move sent to every worker first; or no pool ("recompute")."""
        if self.tensor_parallel is None or self.preemption_mode != "swap":
            return super().make_swap_space(cpu_blocks)
        return BroadcastSwapSpace(self.allocator, cpu_blocks, self.tensor_parallel)


def check_tensor_parallel(lm, group, speculative, cuda_graphs) -> None:
    """Refuse, by name, what cannot run under tensor parallelism."""
    if not isinstance(lm.model, DriverModel) or lm.model.group is not group:
        raise ValueError("the engine must be built on the lm that launch() returned with this group")
    if cuda_graphs:
        raise ValueError("tensor parallelism needs cuda_graphs=False: a CUDA graph replays the driver's kernels "
                         "without the broadcast that starts the workers' pass")
    if speculative == "draft" or isinstance(speculative, DraftProposer):
        raise ValueError("speculative='draft' is not supported under tensor parallelism (the self-draft would run "
                         "the target's cut layers on the driver alone); use 'ngram', or tensor_parallel_size=1")
