"""`Evictor`: which cached block nobody uses gives its memory back first.

A cached block whose refcount drops to 0 keeps valid K/V: it waits here, "cached-free", until the pool runs
out of truly free blocks. The order (vLLM's, and RadixAttention's for full attention): least recently used
first; on a tie, the END of the longest prefix first. A finished sequence releases all its blocks in one step,
and evicting the deepest keeps the shared beginnings and never strands a child. A heap keyed
(last_use, -tokens_before, arrival order); a revived block's stale entry is skipped at the top.
"""

from __future__ import annotations

import heapq
import itertools

STALE_FACTOR = 2  # rebuild the heap when stale entries outnumber live ones by this factor


class Evictor:
    def __init__(self):
        self._heap: list[tuple[int, int, int, int]] = []  # (last_use, -tokens_before, order, block_id)
        self._key: dict[int, tuple[int, int, int, int]] = {}  # block_id -> its live heap entry
        self._order = itertools.count()  # final tie-break: first parked, first evicted

    def __len__(self) -> int:
        return len(self._key)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._key

    def add(self, block_id: int, last_use: int, tokens_before: int) -> None:
        """Park a block whose last owner just let go of it at time `last_use`."""
        if block_id in self._key:
            raise ValueError(f"block {block_id} is already evictable")
        entry = (last_use, -tokens_before, next(self._order), block_id)
        self._key[block_id] = entry
        heapq.heappush(self._heap, entry)

    def remove(self, block_id: int) -> None:
        """A cached-free block was revived by a prefix hit: it is no longer a candidate."""
        del self._key[block_id]  # the heap entry goes stale; pop() skips it
        if len(self._heap) > STALE_FACTOR * len(self._key) + STALE_FACTOR:
            self._heap = list(self._key.values())
            heapq.heapify(self._heap)

    def pop(self) -> int:
        """The block to evict now (see the module docstring for the order)."""
        while self._heap:
            entry = heapq.heappop(self._heap)
            block_id = entry[-1]
            if self._key.get(block_id) == entry:
                del self._key[block_id]
                return block_id
        raise IndexError("no evictable block")

    def eviction_order(self) -> list[int]:
        """Every candidate, first to be evicted first (for tests, demos and the notebook)."""
        return [entry[-1] for entry in sorted(self._key.values())]
