"""`PrefixKV`: phase 4.1's `CowKV` on a `PrefixCachingAllocator`, added to in the methods the scheduler calls.

`new_table` maps the cached blocks a prompt starts with into its table, `n_filled` past them, so prefill reads
them in place (at most (len - 1) // block_size: the last token's logits are needed). `written` publishes the
blocks a pass filled (a failed pass never gets here) and ticks the clock, so blocks released together share one
`last_use`. `blocks_to_admit`: a hit another table holds costs the pool nothing. `fork`: the child continues
its parent's chain of hashes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from weakref import WeakKeyDictionary

from phases.p2_2_scheduler.sequence import Sequence
from phases.p3_2_block_table.block_table import BlockTable
from phases.p4_1_copy_on_write.kv import CowKV
from phases.p4_3_prefix_caching.block_hash import ROOT_HASH, block_tokens, chain_hashes
from phases.p4_3_prefix_caching.prefix_cache import CachedBlock, PrefixCachingAllocator, PrefixMatch


@dataclass
class CacheStats:
    """Counters over every admitted request."""
    n_requests: int = 0
    prompt_tokens: int = 0
    blocks_queried: int = 0   # full prompt blocks that could have hit ((len - 1) // block_size each)
    blocks_hit: int = 0
    tokens_skipped: int = 0   # prompt tokens whose prefill a hit saved
    collisions: int = 0       # lookups stopped by a hash hit with other contents

    @property
    def hit_rate(self) -> float:
        return self.blocks_hit / self.blocks_queried if self.blocks_queried else float("nan")


@dataclass
class Chain:
    """One table's place in the cache: the hashes and cache entries of its full blocks so far."""
    hashes: list[int] = field(default_factory=list)           # hash of full block i
    entries: list[CachedBlock] = field(default_factory=list)  # entry naming block i's contents (maybe another block's)
    broken: bool = False  # a block could not be cached (collision): nothing after it can be chained

    def last_hash(self) -> int:
        return self.hashes[-1] if self.hashes else ROOT_HASH

    def last_entry(self) -> CachedBlock | None:
        return self.entries[-1] if self.entries else None

    def copy(self) -> "Chain":
        return Chain(list(self.hashes), list(self.entries), self.broken)


class PrefixKV(CowKV):
    """Phase 4.1's tables, with full blocks published in a prefix cache and mapped into new tables."""

    def __init__(self, allocator: PrefixCachingAllocator, stats: CacheStats | None = None):
        if not isinstance(allocator, PrefixCachingAllocator):
            raise TypeError(f"prefix caching needs a PrefixCachingAllocator, got {type(allocator).__name__}")
        super().__init__(allocator)
        self.stats = stats if stats is not None else CacheStats()
        self.chains: WeakKeyDictionary[BlockTable, Chain] = WeakKeyDictionary()  # dropped with its table
        self._looked_up: tuple[Sequence, int, list[int]] | None = None   # (seq, tokens hashed, hashes): the last lookup

    def lookup(self, seq: Sequence) -> tuple[list[int], PrefixMatch]:
        """`seq`'s block hashes (kept: admission looks the queue's head up every step) and the prefix they match."""
        ids = seq.all_ids
        last = self._looked_up
        if last is not None and last[0] is seq and last[1] == len(ids):
            hashes = last[2]
        else:
            hashes = chain_hashes(ids, self.block_size)
            self._looked_up = (seq, len(ids), hashes)
        max_blocks = (len(ids) - 1) // self.block_size  # leave >= 1 token to compute: its logits are needed
        return hashes, self.allocator.match_prefix(ids, hashes, max_blocks)

    def blocks_in_use(self, seq: Sequence, start_block: int = 0) -> int:
        """Cached blocks `seq` would map in (logical block `start_block` on) that some table already holds."""
        _, match = self.lookup(seq)
        return sum(1 for e in match.entries[start_block:] if self.allocator.refcount(e.block_id) > 0)

    def blocks_to_admit(self, seq: Sequence, n: int) -> int:
        return super().blocks_to_admit(seq, n) - self.blocks_in_use(seq)

    def new_table(self, seq: Sequence) -> None:
        """An empty table, then the cached prefix of `seq`'s tokens mapped into it."""
        super().new_table(seq)
        table = seq.kv
        hashes, match = self.lookup(seq)
        self._looked_up = None
        for entry in match.entries:
            table.block_ids.append(self.allocator.acquire(entry))
        table.n_filled = len(match.entries) * self.block_size
        self.chains[table] = Chain(hashes=hashes[:len(match.entries)], entries=list(match.entries))
        n_ids = len(seq.all_ids)
        s = self.stats
        s.n_requests += 1
        s.prompt_tokens += n_ids
        s.blocks_queried += (n_ids - 1) // self.block_size
        s.blocks_hit += len(match.entries)
        s.tokens_skipped += table.n_filled
        s.collisions += match.collided

    def written(self, seqs: list[Sequence]) -> None:
        super().written(seqs)
        self.allocator.tick()
        for seq in seqs:
            self.publish(seq)

    def fork(self, parent: Sequence) -> BlockTable:
        """Phase 4.1's fork; the new table continues the parent's chain."""
        table = super().fork(parent)
        parent_chain = self.chains.get(parent.kv)
        self.chains[table] = parent_chain.copy() if parent_chain is not None else Chain()
        return table

    def publish(self, seq: Sequence) -> None:
        """Register the blocks of `seq` filled since the last call (before the pass's tokens are appended)."""
        table = seq.kv
        chain = self.chains.setdefault(table, Chain())
        n_full = table.n_filled // self.block_size
        if chain.broken or n_full == len(chain.hashes):
            return
        ids = seq.all_ids[:n_full * self.block_size]
        new_hashes = chain_hashes(ids, self.block_size, parent_hash=chain.last_hash(), start_block=len(chain.hashes))
        for i, h in enumerate(new_hashes, start=len(chain.hashes)):
            entry = self.allocator.register(table.block_ids[i], h, block_tokens(ids, self.block_size, i),
                                            parent=chain.last_entry())
            if entry is None:
                chain.broken = True
                return
            chain.hashes.append(h)
            chain.entries.append(entry)
