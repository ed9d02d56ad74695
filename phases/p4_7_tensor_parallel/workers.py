"""The workers of phase 4.6, now obeying an engine: each holds a pool for its heads (SETUP), rebuilds each
PASS's batch over it and runs its shard, and moves the same blocks as the driver (COPY, SWAP_OUT, SWAP_IN).

Starting, meeting and stopping are phase 4.6's (`start`, `ShardGroup`, `ShardWorker`); this file changes
what the messages say (message.py) and what a worker keeps between them.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from common.processes import WorkerDied  # noqa: F401  (this phase's error: its callers import it from here)
from phases.p3_1_block_allocator.allocator import BlockAllocator
from phases.p3_6_batched_engine.attention import use_paged_attention
from phases.p4_1_copy_on_write.block_ops import CopyQueue
from phases.p4_4_preemption.swap import SwapSpace
from phases.p4_6_model_sharding.lockstep import ShardGroup, ShardWorker, Started, start
from phases.p4_7_tensor_parallel.engine import DriverModel
from phases.p4_7_tensor_parallel.message import (COPY, HEADER_LEN, PASS, SETUP, STOP, SWAP_IN, SWAP_OUT,
                                                 decode_pass, header, payload_len)


class WorkerGroup(ShardGroup):
    """Phase 4.6's group, sending an engine's passes and block moves."""

    def __init__(self, started: Started):
        super().__init__(started, stop=header(STOP))

    def health(self) -> dict:
        """The group's size, which ranks are alive, and the error that broke it (a server's /health)."""
        alive = self.alive()
        return {"world_size": self.world_size, "alive": alive,
                "error": None if self.error is None and all(alive) else str(self.error or "a worker exited")}

    def send_ids(self, op: int, src: list[int], dst: list[int]) -> None:
        """A COPY, SWAP_OUT or SWAP_IN of blocks src[i] -> dst[i]."""
        self.send(header(op, len(src)), torch.tensor(src + dst, dtype=torch.int64))

    def setup(self, n_blocks: int, block_size: int, cpu_blocks: int) -> None:
        """Every worker (re)builds its pool: the driver's block count and size, its own KV heads."""
        self.send(header(SETUP, n_blocks, block_size, cpu_blocks))


def launch(model: str, world_size: int, device: str | None = None, dtype=None):
    """Start a tensor-parallel group of `world_size` ranks for `model`. Returns (group, lm): lm is the driver's,
    its model cut to rank 0's shard behind a `DriverModel` (n_heads, n_kv_heads the shard's)."""
    started = start(model, world_size, device, dtype, Worker)
    group = WorkerGroup(started)
    return group, replace(started.lm, model=DriverModel(started.lm.model, group))


class Worker(ShardWorker):
    """A rank other than the driver: its shard, its pool, and the loop that obeys the driver's messages."""
    header_len, stop_op = HEADER_LEN, STOP

    def __init__(self, lm, info):
        super().__init__(lm, info)
        self.pool: torch.Tensor | None = None  # from SETUP
        self.swap: SwapSpace | None = None     # its CPU pool, from SETUP when the driver swaps

    def payload_len(self, head: list[int]) -> int:
        return payload_len(head)

    def obey(self, h: list[int], payload: torch.Tensor) -> None:
        if h[0] == SETUP:
            self.setup(*h[1:4])
        elif h[0] == PASS:
            self.run_pass(h, payload)
        else:
            self.move(h[0], *payload.view(2, -1).tolist())

    def setup(self, n_blocks: int, block_size: int, cpu_blocks: int) -> None:
        lm = self.lm
        pool = BlockAllocator(n_blocks, lm.n_layers, self.info.n_kv_heads, lm.head_dim, block_size, lm.device,
                              lm.dtype)
        self.swap = SwapSpace(pool, cpu_blocks) if cpu_blocks else None
        self.pool = pool.kv_store       # [n_blocks, n_layers, 2, its n_kv_heads, block_size, head_dim]

    @torch.inference_mode()
    def run_pass(self, h: list[int], payload: torch.Tensor) -> None:
        p = decode_pass(h, payload, self.pool)
        with use_paged_attention(self.lm.model, p.attention):
            self.lm.model(input_ids=p.input_ids, position_ids=p.position_ids, paged=p.batch, use_cache=False,
                          logits_to_keep=p.logits_to_keep)

    def move(self, op: int, src: list[int], dst: list[int]) -> None:
        """The driver's block copies, on this worker's pool: inside the pool, or to and from its CPU pool."""
        if op == COPY:
            CopyQueue(list(src), list(dst)).flush(self.pool)
        elif op == SWAP_OUT:
            self.swap._copy(self.pool, self.swap.cpu.kv_store, src, dst)
        elif op == SWAP_IN:
            self.swap._copy(self.swap.cpu.kv_store, self.pool, src, dst)
