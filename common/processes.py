"""Child processes that start, say they are ready, and never outlive their parent.

A parent spawns its workers, each loads what it needs and puts ("ready", rank, detail)
or ("error", rank, traceback) on a queue; `wait_ready` waits for all of them, failing
with the first error or death. `die_with_parent` makes the kernel kill a worker when its
parent dies, however the parent died (SIGKILL included): no orphan keeps a GPU or a port.
"""

from __future__ import annotations

import ctypes
import queue
import signal
import socket
import sys
import time

READY_TIMEOUT_S = 300          # a worker loads its model in this long, or the launch fails
POLL_S = 0.1                   # how often the parent looks at a worker it is waiting on
PR_SET_PDEATHSIG = 1           # prctl option (linux/prctl.h)


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
