"""Count what a tensor-parallel group's collectives cost on one worker: all-reduces and gathered logits.

Phase 4.6's `Comm` only calls torch.distributed. `count_collectives(comm)` wraps that one object's two
methods (every layer of the shard calls them through it) and returns the counts it keeps from then on:
tp_demo's figures, and the tests' all-reduces per pass.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class CommStats:
    """All-reduces and gathers since `count_collectives`: how many, their bytes, their seconds."""
    n_all_reduce: int = 0
    all_reduce_bytes: int = 0       # bytes of each tensor reduced (what one worker contributes)
    all_reduce_seconds: float = 0.0
    n_gather: int = 0
    gather_bytes: int = 0           # bytes of every shard gathered
    gather_seconds: float = 0.0


def count_collectives(comm) -> CommStats:
    """Count `comm`'s all_reduce and gather_to_driver calls from now on (a phase 4.6 `Comm`)."""
    stats = CommStats()
    all_reduce, gather_to_driver = comm.all_reduce, comm.gather_to_driver

    def counted_all_reduce(x):
        start = time.perf_counter()
        out = all_reduce(x)
        stats.n_all_reduce += 1
        stats.all_reduce_bytes += x.numel() * x.element_size()
        stats.all_reduce_seconds += time.perf_counter() - start
        return out

    def counted_gather_to_driver(x):
        start = time.perf_counter()
        out = gather_to_driver(x)
        stats.n_gather += 1
        stats.gather_bytes += x.numel() * x.element_size() * comm.world_size
        stats.gather_seconds += time.perf_counter() - start
        return out

    comm.all_reduce, comm.gather_to_driver = counted_all_reduce, counted_gather_to_driver
    return stats

