"""`PrefixCachingEngine`: phase 4.2's engine, with prompts that start with cached blocks skipping their prefill.

Prefix caching is on by default; `PrefixCachingEngine(lm, prefix_caching=False)`
is phase 4.2's `BeamSearchEngine`, step for step. With it on, everything is
done in the engine's hooks:

- `blocks_to_admit(seq)`: the admission budget counts only blocks the
  request really takes from the allocatable pool: its worst case minus the
  cached blocks it maps in that others are using (those cost nothing). A
  cached-free block it revives still counts: it leaves the evictable pool.
- `new_kv(seq)`: look the prompt up, block by block, and map the hits into
  the new BlockTable (`acquire` = one more reference each), with `n_filled`
  set past them. Phase 3.6's chunks then feed only the remaining prompt
  tokens at their true positions (`_prefill_from`), and attention reads the
  prefix from the pool, in place. At most (len(prompt) - 1) // block_size blocks are
  matched: the last prompt token is always computed, because its logits give
  the first new token.
- `_emit(seqs, logits)`: the forward pass that wrote the sequences' new K/V
  has run, so every block of theirs that is now full (prefill or decode) is
  published in the table under its chained hash, before any token is sampled
  or any sample forks. A pass that fails never gets here and publishes
  nothing: a block whose K/V were never written is never found.
- `_chunk_written(seq)`: a prefill chunk that does not end its prompt
  publishes the blocks it filled the same way, so a long prompt's first
  chunks can be hit before its last one has run.
- `_fork_kv(seqs, parents)`: a forked sample, or a beam re-forked from
  another beam (phase 4.1, 4.2), takes over its parent's chain of hashes
  along with its parent's blocks.
- `free_kv(seq)`: the table gives its blocks back as usual; the allocator
  keeps the cached ones (cached-free) until their memory is needed.

The allocator's logical clock ticks once per step, so all blocks a sequence
releases share one `last_use` and the evictor drops the deepest first. A
mapped prefix block is full and never written again, so copy-on-write never
has to copy it. The allocator must be (a subclass of) `PrefixCachingAllocator`.

Known limit: requests admitted in the same step all look the table up before
any of them has computed anything, so N requests arriving together with one
new system prompt all compute it; requests admitted in later steps hit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from phases.p2_2_scheduler.sequence import Sequence, StepOutput
from phases.p3_1_block_allocator.allocator import DEFAULT_BLOCK_SIZE, BlockAllocator
from phases.p3_2_block_table.block_table import BlockTable
from phases.p4_2_beam_search.engine import BeamSearchEngine
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

    def as_dict(self) -> dict:
        return dict(self.__dict__, hit_rate=self.hit_rate)


@dataclass
class _Chain:
    """One sequence's place in the cache: the hashes and table entries of its full blocks so far."""
    hashes: list[int] = field(default_factory=list)                 # hash of full block i
    entries: list[CachedBlock] = field(default_factory=list)  # entry naming block i's contents (maybe another block's)
    broken: bool = False  # a block could not be cached (collision): nothing after it can be chained

    def last_hash(self) -> int:
        return self.hashes[-1] if self.hashes else ROOT_HASH

    def last_entry(self) -> CachedBlock | None:
        return self.entries[-1] if self.entries else None

    def copy(self) -> "_Chain":
        return _Chain(list(self.hashes), list(self.entries), self.broken)


class PrefixCachingEngine(BeamSearchEngine):
    """Phase 4.2's engine (samples, beams, copy-on-write) with automatic prefix caching."""

    def __init__(self, lm, *, prefix_caching: bool = True, block_size: int = DEFAULT_BLOCK_SIZE,
                 n_blocks: int | None = None, allocator: BlockAllocator | None = None, **engine_kwargs):
        if prefix_caching:
            if allocator is None:
                allocator = PrefixCachingAllocator.for_model(lm, block_size=block_size, n_blocks=n_blocks)
            if not isinstance(allocator, PrefixCachingAllocator):
                raise TypeError(f"prefix caching needs a PrefixCachingAllocator, got {type(allocator).__name__}")
        super().__init__(lm, block_size=block_size, n_blocks=n_blocks, allocator=allocator, **engine_kwargs)
        self.prefix_caching = prefix_caching
        self.cache_stats = CacheStats()
        self._chains: dict[int, _Chain] = {}      # seq_id -> its chain, from admission to release
        self._prompt_hashes: dict[int, list[int]] = {}  # seq_id -> its prompt's block hashes (computed once)

    # --- what a prompt can reuse --------------------------------------------------------
    def _cacheable_ids(self, seq: Sequence) -> list[int]:
        """The tokens `seq`'s prefill chunks will feed: its prompt."""
        return seq.prompt_ids

    def _lookup(self, seq: Sequence) -> tuple[list[int], PrefixMatch]:
        ids = self._cacheable_ids(seq)
        hashes = self._prompt_hashes.get(seq.seq_id)
        if hashes is None or len(hashes) != len(ids) // self.block_size:
            hashes = self._prompt_hashes[seq.seq_id] = chain_hashes(ids, self.block_size)
        max_blocks = (len(ids) - 1) // self.block_size  # leave >= 1 token to compute: its logits are needed
        return hashes, self.allocator.match_prefix(ids, hashes, max_blocks)

    def _shared_hits(self, seq: Sequence, start_block: int = 0) -> int:
        """Cached blocks `seq` would map in (logical block `start_block` on) that someone already holds:
        they cost the pool nothing. (A cached-free hit does: reviving it takes it from the evictable pool.)"""
        if not self.prefix_caching:
            return 0
        _, match = self._lookup(seq)
        return sum(1 for e in match.entries[start_block:] if self.allocator.refcount(e.block_id) > 0)

    # --- the engine's hooks ----------------------------------------------------------------
    def step(self):
        if self.prefix_caching:
            self.allocator.tick()
        return super().step()

    def blocks_to_admit(self, seq: Sequence) -> int:
        return super().blocks_to_admit(seq) - self._shared_hits(seq)

    def new_kv(self, seq: Sequence) -> BlockTable:
        """An empty table, then the cached prefix of the prompt mapped into it."""
        table = super().new_kv(seq)
        if not self.prefix_caching:
            return table
        hashes, match = self._lookup(seq)
        del self._prompt_hashes[seq.seq_id]
        for entry in match.entries:
            table.block_ids.append(self.allocator.acquire(entry))
        table.n_filled = len(match.entries) * self.block_size
        self._chains[seq.seq_id] = _Chain(hashes=hashes[:len(match.entries)], entries=list(match.entries))
        s = self.cache_stats
        s.n_requests += 1
        s.prompt_tokens += len(self._cacheable_ids(seq))
        s.blocks_queried += (len(self._cacheable_ids(seq)) - 1) // self.block_size
        s.blocks_hit += len(match.entries)
        s.tokens_skipped += table.n_filled
        s.collisions += match.collided
        return table

    def _emit(self, seqs: list[Sequence], logits: torch.Tensor) -> list[StepOutput]:
        # The pass that wrote these sequences' new K/V has run: publish their newly full blocks.
        if self.prefix_caching:
            for seq in seqs:
                self._register_full_blocks(seq)
        return super()._emit(seqs, logits)

    def _chunk_written(self, seq: Sequence) -> None:
        if self.prefix_caching:
            self._register_full_blocks(seq)

    def _fork_kv(self, seqs: list[Sequence], parents: list[Sequence]) -> None:
        if not self.prefix_caching:
            return super()._fork_kv(seqs, parents)
        # seqs[i] continues parents[i]'s history, so it continues its chain too (copied before any is replaced)
        chains = [self._chains.get(p.seq_id, _Chain()).copy() for p in parents]
        super()._fork_kv(seqs, parents)
        for seq, chain in zip(seqs, chains):
            self._chains[seq.seq_id] = chain

    def free_kv(self, seq: Sequence) -> None:
        super().free_kv(seq)
        self._chains.pop(seq.seq_id, None)
        self._prompt_hashes.pop(seq.seq_id, None)

    def abort(self, seq: Sequence) -> None:
        super().abort(seq)
        self._prompt_hashes.pop(seq.seq_id, None)  # a request aborted while waiting was looked up, never released

    # --- publishing new full blocks ------------------------------------------------------------
    def _register_full_blocks(self, seq: Sequence) -> None:
        """Hash and register every block of `seq` that became full since the last call."""
        chain = self._chains.setdefault(seq.seq_id, _Chain())
        table = seq.kv
        n_full = table.n_filled // self.block_size
        if chain.broken or n_full == len(chain.hashes):
            return
        # After the pass (and before its tokens are appended), the table's tokens are exactly all_ids[:n_filled]
        # (the token fed at position p is prompt or output token p).
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
