"""The workers: one process per rank, on torch.distributed; rank 0 is the driver (this process).

    driver (rank 0)                        worker (rank r = 1 .. N-1)
    ---------------                        --------------------------
    load the model, check the world        load the same model, cut its shard
    start the workers, wait for "ready"    say "ready" (or the error) on a queue
    init_process_group  <----- rendezvous on a free port ----->  init_process_group
    each step: schedule, send PASS    -->  receive, build the batch over its pool
               run its own shard      <->  run its shard (the all-reduces meet here)
               gather the logits      <--  send its columns of the logits
               sample, update
    close: send STOP                  -->  leave the loop, exit

The backend follows the device: gloo on CPUs (so all of this runs on a laptop), NCCL on GPUs, one GPU per
rank. How a worker starts, stops and dies is any worker's (common/processes.py): no worker outlives the
driver, and once one dies every later call raises `WorkerDied`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import traceback
import warnings
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from common.model import load_model, pick_device, pick_dtype
from common.processes import WorkerDied  # noqa: F401  (this phase's error: its callers import it from here)
from common.processes import Workers, die_with_parent, free_port, init_rank, rank_device, wait_ready
from phases.p3_1_block_allocator.allocator import BlockAllocator
from phases.p3_6_batched_engine.attention import use_paged_attention
from phases.p4_1_copy_on_write.block_ops import CopyQueue
from phases.p4_4_preemption.swap import SwapSpace
from phases.p4_6_tensor_parallel.engine import DriverModel
from phases.p4_6_tensor_parallel.message import (COPY, HEADER_LEN, PASS, SETUP, STOP, SWAP_IN, SWAP_OUT,
                                                 MessageStats, decode_pass, header, payload_len)
from phases.p4_6_tensor_parallel.shard import Comm, ShardInfo, check_world_size, shard_model


@dataclass
class Spec:
    """What a worker needs to start: the same model as the driver's, and where to meet."""
    model: str
    device: str
    dtype: torch.dtype
    world_size: int
    port: int
    threads: int


def check_launch(world_size, n_kv_heads: int, device: str) -> None:
    """Refuse a world the model or the machine cannot hold, before any worker starts."""
    check_world_size(world_size, n_kv_heads)
    if torch.device(device).type == "cuda":
        if world_size > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size={world_size} needs one GPU per worker; "
                             f"torch sees {torch.cuda.device_count()}")
    elif world_size > (os.cpu_count() or 1):
        warnings.warn(f"tensor_parallel_size={world_size} on {os.cpu_count()} CPU cores: the workers share cores, "
                      "so this shows the mechanism, not a speed-up", stacklevel=3)


class WorkerGroup(Workers):
    """The driver's end: the worker processes, the control messages, and what the driver's shard sent."""

    def __init__(self, spec: Spec, processes: list, comm: Comm, info: ShardInfo, held: dict[int, dict],
                 threads_before: int):
        super().__init__("tensor-parallel group", processes, rank_device(spec.device, 0), stop=header(STOP))
        self.spec = spec
        self.comm = comm                        # the driver's collectives (the all-reduces of its shard)
        self.info = info                        # what the driver's shard holds
        self.held = held                        # rank -> its weight bytes, heads and MLP features
        self.messages = MessageStats()
        self._threads_before = threads_before

    @property
    def world_size(self) -> int:
        return self.spec.world_size

    def health(self) -> dict:
        """The group's size, which ranks are alive, and the error that broke it."""
        alive = self.alive()
        return {"world_size": self.world_size, "alive": alive,
                "error": None if self.error is None and all(alive) else str(self.error or "a worker exited")}

    def send(self, head: torch.Tensor, payload: torch.Tensor | None = None) -> None:
        """Broadcast one message (header, then its payload) to every worker, and count it."""
        super().send(head, *([] if payload is None else [payload]))
        self.messages.add(int(head[0]), 8 * (HEADER_LEN + (0 if payload is None else payload.numel())))

    def send_ids(self, op: int, src: list[int], dst: list[int]) -> None:
        """A COPY, SWAP_OUT or SWAP_IN of blocks src[i] -> dst[i]."""
        self.send(header(op, len(src)), torch.tensor(src + dst, dtype=torch.int64))

    def setup(self, n_blocks: int, block_size: int, cpu_blocks: int) -> None:
        """Every worker (re)builds its pool: the driver's block count and size, its own KV heads."""
        self.send(header(SETUP, n_blocks, block_size, cpu_blocks))

    def close(self) -> None:
        super().close()
        torch.set_num_threads(self._threads_before)


def launch(model: str, world_size: int, device: str | None = None, dtype=None):
    """Start a tensor-parallel group of `world_size` ranks for `model`. Returns (group, lm): lm is the driver's,
    its model cut to rank 0's shard (n_heads, n_kv_heads the shard's, so a pool built for it holds its heads)."""
    if dist.is_initialized():
        raise RuntimeError("this process already runs a torch.distributed group (one tensor-parallel group per "
                           "process): close it first")
    device = pick_device(device)
    torch_dtype = pick_dtype(dtype, device)
    lm = load_model(model, device=rank_device(device, 0), dtype=torch_dtype)
    check_launch(world_size, lm.n_kv_heads, device)
    threads_before = torch.get_num_threads()
    threads = max(1, threads_before // world_size) if torch.device(device).type == "cpu" else threads_before
    spec = Spec(model, device, torch_dtype, world_size, free_port(), threads)
    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    processes = [ctx.Process(target=worker_main, args=(rank, spec, ready), daemon=True,
                             name=f"tp-worker-{rank}") for rank in range(1, world_size)]
    for p in processes:
        p.start()
    try:
        held = wait_ready(processes, ready)
        torch.set_num_threads(threads)
        init_rank(spec.device, spec.port, 0, world_size)
    except BaseException:
        for p in processes:
            p.kill()
        raise
    comm = Comm(0, world_size)
    info = shard_model(lm.model, 0, world_size, comm)
    group = WorkerGroup(spec, processes, comm, info, {0: holding(lm.model, info)} | held, threads_before)
    lm = replace(lm, model=DriverModel(lm.model, group), n_heads=info.n_heads, n_kv_heads=info.n_kv_heads)
    return group, lm


def param_bytes(model) -> int:
    """Bytes of a model's weights, a tied weight counted once."""
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())


def holding(model, info: ShardInfo) -> dict:
    """What one rank holds, as the demo reports it."""
    return dict(param_bytes=param_bytes(model), n_heads=info.n_heads, n_kv_heads=info.n_kv_heads,
                intermediate=info.intermediate)


def worker_main(rank: int, spec: Spec, ready) -> None:
    """A worker's whole life: load, cut, say ready, meet the others, serve messages until STOP."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # Ctrl-C is the driver's to handle: it stops the workers
    torch.set_num_threads(spec.threads)
    try:
        lm = load_model(spec.model, device=rank_device(spec.device, rank), dtype=spec.dtype)
        info = shard_model(lm.model, rank, spec.world_size, Comm(rank, spec.world_size))
    except BaseException:
        ready.put(("error", rank, traceback.format_exc()))
        return
    ready.put(("ready", rank, holding(lm.model, info)))
    init_rank(spec.device, spec.port, rank, spec.world_size)
    try:
        Worker(lm, info).serve()
    finally:
        dist.destroy_process_group()


class Worker:
    """A rank other than the driver: its shard, its pool, and the loop that obeys the driver's messages."""

    def __init__(self, lm, info: ShardInfo):
        self.lm, self.info = lm, info
        self.device = lm.device                # where the messages land: its GPU under NCCL, the CPU under gloo
        self.pool: torch.Tensor | None = None  # from SETUP
        self.swap: SwapSpace | None = None     # its CPU pool, from SETUP when the driver swaps

    def receive(self) -> tuple[list[int], torch.Tensor]:
        head = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
        dist.broadcast(head, src=0)
        h = head.tolist()
        payload = torch.empty(payload_len(h), dtype=torch.int64, device=self.device)
        if payload.numel():
            dist.broadcast(payload, src=0)
        return h, payload

    def serve(self) -> None:
        while (message := self.receive())[0][0] != STOP:
            h, payload = message
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
