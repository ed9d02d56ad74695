"""Count what a tensor-parallel group sends: the shards' collectives, and the driver's control messages.

Phase 4.6's `Comm` only calls torch.distributed, and phase 4.7's group only broadcasts. `count_collectives(comm)`
and `count_messages(group)` wrap that one object's methods and return the counts they keep from then on:
tp_demo's figures, and the tests' all-reduces per pass and swaps sent.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


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


@dataclass
class MessageStats:
    """Control messages sent, by op (message.py's PASS, COPY, ...): how many, and their bytes (header and payload)."""
    n: dict[int, int] = field(default_factory=dict)
    bytes: dict[int, int] = field(default_factory=dict)


def count_messages(group) -> MessageStats:
    """Count a phase 4.7 `WorkerGroup`'s messages (each a header, then at most one payload) from now on."""
    stats = MessageStats()
    send = group.send

    def counted_send(head, *payload):
        send(head, *payload)
        op = int(head[0])
        stats.n[op] = stats.n.get(op, 0) + 1
        stats.bytes[op] = stats.bytes.get(op, 0) + 8 * (head.numel() + sum(p.numel() for p in payload))

    group.send = counted_send
    return stats
