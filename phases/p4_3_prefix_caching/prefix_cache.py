"""`PrefixCachingAllocator`: phase 3.1's allocator plus a table `hash -> CachedBlock` and a third block state:

    free         refcount 0, on the free list, holds nothing worth keeping
    owned        refcount k > 0 (it may also be cached)
    cached-free  refcount 0, parked in the `Evictor`: unused, but its K/V are valid and findable by hash

`n_free` counts free + cached-free; `alloc()` takes a free block first, else evicts one and forgets its hash;
a cached block's last `free()` parks it in the evictor; `acquire()` revives it (`incref()` only counts owned
blocks). A hash only names a candidate (`match_prefix`): a collision is a miss, never a wrong answer.
"""

from __future__ import annotations

from dataclasses import dataclass

from phases.p3_1_block_allocator.allocator import AllocatorError, BlockAllocator, OutOfBlocks
from phases.p4_3_prefix_caching.block_hash import block_tokens
from phases.p4_3_prefix_caching.evictor import Evictor


@dataclass(eq=False)
class CachedBlock:
    """One cached block's contents (eq=False: `entry.parent is previous` checks the whole prefix)."""
    block_id: int
    block_hash: int
    tokens: tuple[int, ...]          # the block's own tokens, kept to verify a hash hit
    parent: "CachedBlock | None"     # the entry of the block before it (None: first block)
    tokens_before: int               # prefix length: the eviction tie-break

    def extends(self, parent: "CachedBlock | None", tokens: tuple[int, ...]) -> bool:
        """Is this entry exactly `tokens` placed after `parent`'s prefix?"""
        return self.parent is parent and self.tokens == tokens


@dataclass
class PrefixMatch:
    """The result of looking a prompt up in the table."""
    entries: list[CachedBlock]   # cached blocks for logical blocks 0..len-1, in order
    collided: bool = False       # the walk stopped at a hash hit whose contents differed


class PrefixCachingAllocator(BlockAllocator):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._table: dict[int, CachedBlock] = {}                    # block hash -> its entry
        self._entry: list[CachedBlock | None] = [None] * self.n_blocks  # block id -> its entry
        self.evictor = Evictor()
        self.clock = 0               # logical time; the engine ticks it once per pass
        self.n_evictions = 0         # cached blocks whose memory was taken back
        self.n_register_conflicts = 0  # a full block not cached: its hash held different contents

    @property
    def n_free(self) -> int:
        """Blocks `alloc()` can hand out now: truly free + cached-free (evictable)."""
        return len(self._free_list) + len(self.evictor)

    @property
    def n_uncached_free(self) -> int:
        """Blocks free with nothing cached in them: handing one out evicts nothing."""
        return len(self._free_list)

    @property
    def n_evictable(self) -> int:
        return len(self.evictor)

    @property
    def n_cached(self) -> int:
        """Blocks whose contents the table knows, in use or not."""
        return len(self._table)

    def tick(self) -> int:
        """Advance logical time (one engine step); blocks released now share this `last_use`."""
        self.clock += 1
        return self.clock

    def alloc(self) -> int:
        """A truly free block if there is one, else the evictor's choice (its hash forgotten)."""
        if not self._free_list and len(self.evictor):
            victim = self.evictor.pop()
            self._forget(victim)
            self.n_evictions += 1
            self._free_list.appendleft(victim)  # now truly free: the base alloc takes it
        if not self._free_list:
            raise OutOfBlocks(f"KV pool exhausted: all {self.n_blocks} blocks of {self.block_size} tokens "
                              f"are in use and none is evictable")
        return super().alloc()

    def free(self, block_id: int) -> None:
        """Drop one owner; a cached block's last owner parks it in the evictor instead of the free list."""
        self._check_owned(block_id, "free")
        entry = self._entry[block_id]
        if entry is None or self._refcount[block_id] > 1:
            super().free(block_id)
            return
        self._refcount[block_id] = 0
        self.evictor.add(block_id, last_use=self.clock, tokens_before=entry.tokens_before)

    def acquire(self, entry: CachedBlock) -> int:
        """Take one more reference to a cached block (a prefix hit); revive it if it was cached-free."""
        block_id = entry.block_id
        if self._entry[block_id] is not entry:
            raise AllocatorError(f"block {block_id} no longer holds this cached entry (it was evicted)")
        if self._refcount[block_id] == 0:
            self.evictor.remove(block_id)
        self._refcount[block_id] += 1
        return block_id

    def match_prefix(self, token_ids: list[int], hashes: list[int], max_blocks: int) -> PrefixMatch:
        """The longest run (<= `max_blocks`) of cached blocks `token_ids` starts with; pure, `acquire()` to use.
        Each entry's tokens AND parent must match, so by induction a hit has the same tokens before it too."""
        entries: list[CachedBlock] = []
        parent = None
        for i, h in enumerate(hashes[:max_blocks]):
            entry = self._table.get(h)
            if entry is None:
                break
            if not entry.extends(parent, block_tokens(token_ids, self.block_size, i)):
                return PrefixMatch(entries, collided=True)
            entries.append(entry)
            parent = entry
        return PrefixMatch(entries)

    def register(self, block_id: int, block_hash: int, tokens: tuple[int, ...],
                 parent: CachedBlock | None) -> CachedBlock | None:
        """Publish an owned full block. Returns the entry naming its contents (its own, or an equal block's: this
        one stays private), or None on a collision (private, and nothing chains after it)."""
        self._check_owned(block_id, "register")
        if len(tokens) != self.block_size:
            raise AllocatorError(f"only full blocks are cached: got {len(tokens)} of {self.block_size} tokens")
        if self._entry[block_id] is not None:
            return self._entry[block_id]
        existing = self._table.get(block_hash)
        if existing is not None:
            if existing.extends(parent, tokens):
                return existing
            self.n_register_conflicts += 1
            return None
        tokens_before = 0 if parent is None else parent.tokens_before + self.block_size
        entry = CachedBlock(block_id, block_hash, tokens, parent, tokens_before)
        self._table[block_hash] = entry
        self._entry[block_id] = entry
        return entry

    def cached_entry(self, block_id: int) -> CachedBlock | None:
        self._check_id(block_id)
        return self._entry[block_id]

    def _forget(self, block_id: int) -> None:
        entry = self._entry[block_id]
        del self._table[entry.block_hash]
        self._entry[block_id] = None

    def check_invariants(self) -> None:
        """Every block is exactly one of free / owned / cached-free, and the table agrees with the blocks."""
        free = set(self._free_list)
        assert len(free) == len(self._free_list), "a block is on the free list twice"
        for b, count in enumerate(self._refcount):
            states = [b in free, count > 0, b in self.evictor]
            assert count >= 0 and sum(states) == 1, (f"block {b}: free={states[0]} refcount={count} "
                                                    f"evictable={states[2]}")
            assert not (b in free and self._entry[b] is not None), f"free block {b} still has a hash"
            assert not (b in self.evictor and self._entry[b] is None), f"evictable block {b} has no hash"
        for h, entry in self._table.items():
            assert entry.block_hash == h and self._entry[entry.block_id] is entry, f"table entry {h} is stale"
        assert sum(e is not None for e in self._entry) == len(self._table), "a block's entry is not in the table"

    def __repr__(self) -> str:
        return (f"PrefixCachingAllocator({self.n_blocks} blocks x {self.block_size} tokens: "
                f"{self.n_blocks - self.n_free} owned, {self.n_evictable} cached-free, "
                f"{self.n_uncached_free} free; {self.n_cached} cached in all)")
