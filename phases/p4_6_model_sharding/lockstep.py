"""Workers that each hold one shard and run the driver's forward pass in lockstep; rank 0 is the driver.

    driver (rank 0)                        worker (rank r = 1 .. N-1)
    ---------------                        --------------------------
    load the model, check the world        load the same model, cut its shard
    start the workers, wait for "ready"    say "ready" (or the error) on a queue
    init_process_group  <----- rendezvous on a free port ----->  init_process_group
    each call: send the ids           -->  receive them
               run its own shard      <->  run its shard (the all-reduces meet here)
               gather the logits      <--  send its columns of the logits
    close: send STOP                  -->  leave the loop, exit

On the driver `lm.model` is a `ShardedModel`, so phase 0's loop runs on the cut model unchanged. Gloo on
CPUs, NCCL on GPUs (one GPU per rank). Starting, stopping and dying are any worker's (common/processes.py).
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
from torch import nn

from common.model import LoadedModel, load_model, pick_device, pick_dtype
from common.processes import Workers, die_with_parent, free_port, init_rank, rank_device, wait_ready
from phases.p4_6_model_sharding.shard import Comm, ShardInfo, check_world_size, shard_model

FORWARD, STOP = range(2)
HEADER_LEN = 4        # a message: int64 [op, B, T, logits_to_keep], then a FORWARD's ids, int64 [B * T]
STOP_MESSAGE = torch.tensor([STOP, 0, 0, 0])


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


@dataclass
class Started:
    """Every rank started and met, rank 0's shard cut: what the driver's group is built from."""
    lm: LoadedModel          # the driver's, its model cut to rank 0's shard
    spec: Spec
    processes: list          # ranks 1 .. N-1
    comm: Comm               # rank 0's collectives
    info: ShardInfo          # what rank 0 holds
    held: dict[int, dict]    # rank -> its weight bytes, heads and MLP features (`holding`)
    threads_before: int      # the driver's threads before the group split the cores


def start(model: str, world_size: int, device: str | None, dtype, worker_class) -> Started:
    """Load `model`, refuse a world it cannot be cut into, spawn ranks 1 .. N-1 (each runs `worker_class`'s
    loop on its shard), meet them, and cut rank 0's shard."""
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
    processes = [ctx.Process(target=worker_main, args=(rank, spec, ready, worker_class), daemon=True,
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
    lm = replace(lm, n_heads=info.n_heads, n_kv_heads=info.n_kv_heads)   # a pool built for it holds its heads
    return Started(lm, spec, processes, comm, info, {0: holding(lm.model, info)} | held, threads_before)


class ShardGroup(Workers):
    """The driver's end: the worker processes, and what the driver's shard holds and sent."""

    def __init__(self, started: Started, stop: torch.Tensor):
        super().__init__("tensor-parallel group", started.processes, rank_device(started.spec.device, 0), stop)
        self.spec = started.spec
        self.comm = started.comm                # the driver's collectives (the all-reduces of its shard)
        self.info = started.info                # what the driver's shard holds
        self.held = started.held                # rank -> what it holds
        self._threads_before = started.threads_before

    @property
    def world_size(self) -> int:
        return self.spec.world_size

    def close(self) -> None:
        super().close()
        torch.set_num_threads(self._threads_before)


class ShardedModel(nn.Module):
    """Rank 0's shard behind the model's own call: each call first sends the workers its ids."""

    def __init__(self, shard: nn.Module, group: ShardGroup):
        super().__init__()
        self.shard, self.group = shard, group

    def forward(self, input_ids: torch.Tensor, use_cache: bool = False, logits_to_keep: int = 0):
        """input_ids [B, T] -> the whole model's logits [B, kept positions, V]; no cache is kept, on any rank."""
        self.group.send(torch.tensor([FORWARD, *input_ids.shape, logits_to_keep]), input_ids.to(torch.int64))
        try:
            return self.shard(input_ids=input_ids, use_cache=False, logits_to_keep=logits_to_keep)
        except Exception as error:   # the workers wait in collectives the driver will not join: the group is lost
            raise self.group.failed(error) from error


def launch(model: str, world_size: int, device: str | None = None, dtype=None) -> tuple[ShardGroup, LoadedModel]:
    """Start a group of `world_size` ranks for `model`. Returns (group, lm): lm is the driver's, its model
    rank 0's shard behind a `ShardedModel` (n_heads, n_kv_heads the shard's)."""
    started = start(model, world_size, device, dtype, ShardWorker)
    group = ShardGroup(started, STOP_MESSAGE)
    return group, replace(started.lm, model=ShardedModel(started.lm.model, group))


def param_bytes(model) -> int:
    """Bytes of a model's weights, a tied weight counted once."""
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())


def holding(model, info: ShardInfo) -> dict:
    """What one rank holds, as a demo reports it."""
    return dict(param_bytes=param_bytes(model), n_heads=info.n_heads, n_kv_heads=info.n_kv_heads,
                intermediate=info.intermediate)


def worker_main(rank: int, spec: Spec, ready, worker_class) -> None:
    """A worker's whole life: load, cut, say ready, meet the others, obey messages until STOP."""
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
        worker_class(lm, info).serve()
    finally:
        dist.destroy_process_group()


class ShardWorker:
    """A rank other than the driver: its shard, and the loop that runs each pass the driver sends."""
    header_len, stop_op = HEADER_LEN, STOP

    def __init__(self, lm: LoadedModel, info: ShardInfo):
        self.lm, self.info = lm, info
        self.device = lm.device                # where the messages land: its GPU under NCCL, the CPU under gloo

    def payload_len(self, head: list[int]) -> int:
        return head[1] * head[2]               # a FORWARD's ids, B * T

    def receive(self) -> tuple[list[int], torch.Tensor]:
        head = torch.empty(self.header_len, dtype=torch.int64, device=self.device)
        dist.broadcast(head, src=0)
        h = head.tolist()
        payload = torch.empty(self.payload_len(h), dtype=torch.int64, device=self.device)
        if payload.numel():
            dist.broadcast(payload, src=0)
        return h, payload

    def serve(self) -> None:
        while (message := self.receive())[0][0] != self.stop_op:
            self.obey(*message)

    @torch.inference_mode()
    def obey(self, h: list[int], payload: torch.Tensor) -> None:
        """A FORWARD: the driver's call on this shard; its logits' columns go to the driver's gather."""
        self.lm.model(input_ids=payload.view(h[1], h[2]), use_cache=False, logits_to_keep=h[3])
