"""Worker processes on torch.distributed that start, say they are ready, and never outlive their parent.

A parent spawns its workers, each loads what it needs and puts ("ready", rank, detail)
or ("error", rank, traceback) on a queue; `wait_ready` waits for all of them, failing
with the first error or death. `die_with_parent` makes the kernel kill a worker when its
parent dies, however the parent died (SIGKILL included): no orphan keeps a GPU or a port.
`Workers` is the parent's end once they run: broadcast to them, see one die, stop them all.
"""

from __future__ import annotations

import atexit
import ctypes
import queue
import signal
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

READY_TIMEOUT_S = 300          # a worker loads its model in this long, or the launch fails
POLL_S = 0.1                   # how often the parent looks at a worker it is waiting on
PR_SET_PDEATHSIG = 1           # prctl option (linux/prctl.h)
# A worker idles inside a broadcast between requests, so collectives wait long; a dead peer's sockets close.
COLLECTIVE_TIMEOUT = timedelta(days=1)
JOIN_TIMEOUT_S = 10            # after the stop message, a worker exits in this long or is killed
DEATH_GRACE_S = 2.0            # after a collective fails, how long a worker that caused it has to be seen dead


class WorkerDied(RuntimeError):
    """A worker process exited or broke a collective: its group can run nothing more."""


def free_port() -> int:
    """A TCP port nobody listens on now (the OS picks it), for a rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent() -> None:
    """Linux: the kernel sends this process SIGKILL when its parent dies."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def wait_ready(processes: list, ready) -> dict[int, object]:
    """Wait until every worker (ranks 1 .. len(processes)) is ready, or raise WorkerDied with the first worker's
    error or death. Returns each worker's detail, by rank."""
    waiting = set(range(1, len(processes) + 1))
    held = {}
    deadline = time.monotonic() + READY_TIMEOUT_S
    while waiting:
        try:
            status, rank, detail = ready.get(timeout=POLL_S)
        except queue.Empty:
            dead = [p for p in processes if not p.is_alive()]
            if dead:
                raise WorkerDied(f"{dead[0].name} exited with code {dead[0].exitcode} while starting")
            if time.monotonic() > deadline:
                raise WorkerDied(f"workers {sorted(waiting)} not ready after {READY_TIMEOUT_S} s")
            continue
        if status == "error":
            raise WorkerDied(f"worker rank {rank} failed to start:\n{detail}")
        waiting.discard(rank)
        held[rank] = detail
    return held


def backend_for(device: str) -> str:
    """gloo on CPUs (so a laptop runs it), NCCL on GPUs."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def rank_device(device: str, rank: int) -> str:
    """One GPU per rank on CUDA; every rank on the CPU otherwise."""
    return f"cuda:{rank}" if torch.device(device).type == "cuda" else "cpu"


def init_rank(device: str, port: int, rank: int, world_size: int) -> None:
    """Join the group: every rank calls this, and it returns once all have."""
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend_for(device), init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=COLLECTIVE_TIMEOUT)


class Workers:
    """The parent's (rank 0's) end of running workers: broadcast to them, notice a death, stop them all.

    A dead worker is seen before the next broadcast (`is_alive`) or by the collective it breaks; from then on
    every call raises `WorkerDied`, naming it."""

    def __init__(self, name: str, processes: list, device: str, stop: torch.Tensor):
        self.name = name                        # what the errors call this group
        self.processes = processes              # ranks 1 .. N-1
        self.device = device                    # where rank 0's broadcasts start
        self.stop = stop                        # the message that ends a worker's loop
        self.error: BaseException | None = None
        self.closed = False
        atexit.register(self.close)

    def alive(self) -> list[bool]:
        """Whether each rank is alive: the parent, then the workers."""
        return [not self.closed] + [p.is_alive() for p in self.processes]

    def check(self) -> None:
        """Raise WorkerDied if this group can run nothing more."""
        if self.error is not None:
            raise WorkerDied(f"{self.name} is broken: {self.error}") from self.error
        if self.closed:
            raise WorkerDied(f"{self.name} is closed")
        dead = [(r + 1, p) for r, p in enumerate(self.processes) if not p.is_alive()]
        if dead:
            self.error = WorkerDied(", ".join(f"worker rank {r} (pid {p.pid}) exited with code {p.exitcode}"
                                              for r, p in dead))
            raise self.error

    def failed(self, error: BaseException) -> WorkerDied:
        """The WorkerDied a failed broadcast or pass means, naming the dead worker if one died: its socket can
        close before its process is seen to exit, so it has DEATH_GRACE_S to be seen."""
        deadline = time.monotonic() + DEATH_GRACE_S
        while self.error is None and all(p.is_alive() for p in self.processes) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        try:
            self.check()
        except WorkerDied as died:
            return died
        self.error = WorkerDied(f"the workers are out of step after: {type(error).__name__}: {error}")
        return self.error

    def send(self, *tensors: torch.Tensor) -> None:
        """Broadcast each tensor from rank 0 to every worker, in order (an empty one is skipped)."""
        self.check()
        try:
            for t in tensors:
                if t.numel():
                    dist.broadcast(t.to(self.device), src=0)
        except RuntimeError as error:
            raise self.failed(error) from error

    def close(self) -> None:
        """Stop every worker, then make sure each has exited (killed if it must be). Safe to call twice."""
        if self.closed:
            return
        if self.error is None and all(p.is_alive() for p in self.processes):
            try:
                self.send(self.stop)
            except WorkerDied:
                pass
        self.closed = True
        for p in self.processes:
            p.join(JOIN_TIMEOUT_S if self.error is None else POLL_S)   # a broken group's workers get killed
            if p.is_alive():
                p.kill()
                p.join(JOIN_TIMEOUT_S)
        if dist.is_initialized():
            dist.destroy_process_group()
        atexit.unregister(self.close)
