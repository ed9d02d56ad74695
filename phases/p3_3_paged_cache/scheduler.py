"""`PagedScheduler`: phase 2.3's continuous batching with every sequence's K/V in one shared block pool.

Only the KV override points of `ContinuousScheduler` change:
- `new_kv(seq)`   a `PagedCache` on the shared `BlockAllocator` (no blocks yet:
                  the prefill claims them);
- `free_kv(seq)`  the finished sequence's blocks go back on the free list, ready
                  for whoever is admitted next in this same step;
- `kv_bytes(seq)` blocks held * bytes per block.
Each running sequence still gets its own forward pass per step (phase 3.5
restores the single batched pass).

A pool can run dry, so admission now has a second condition besides a free
slot: the pool must have room for the newcomer. A sequence the pool cannot
take stays at the head of the waiting queue until finished sequences give
blocks back; it is never dropped. So that a running sequence can never hit an
empty pool in the middle of its decode (this phase has no preemption; phase 4
adds it), admission counts each sequence's worst case, prompt + max_new_tokens,
against the pool: the blocks everybody running may still claim are set aside.
Blocks are still claimed one at a time as tokens arrive; only the admission
check looks at the worst case.
"""

from __future__ import annotations

from common.sampling import GREEDY, SamplingParams
from phases.p2_2_scheduler.sequence import Sequence
from phases.p2_3_continuous_batching.scheduler import ContinuousScheduler
from phases.p3_1_block_allocator.allocator import DEFAULT_BLOCK_SIZE, BlockAllocator
from phases.p3_3_paged_cache.paged_cache import PagedCache


def blocks_for(n_tokens: int, block_size: int) -> int:
    """Blocks that hold n_tokens tokens (ceil)."""
    return -(-n_tokens // block_size)


def worst_case_tokens(seq: Sequence) -> int:
    """Most K/V positions a sequence can ever store: its prompt and every generated token but the last
    (the last token is sampled, never fed back, so its K/V is never computed)."""
    return len(seq.prompt_ids) + seq.max_new_tokens - 1


class PagedScheduler(ContinuousScheduler):
    """Continuous batching over a paged KV pool: one `PagedCache` per running sequence, one allocator for all."""

    def __init__(self, lm, max_running: int = 4, block_size: int = DEFAULT_BLOCK_SIZE,
                 n_blocks: int | None = None, allocator: BlockAllocator | None = None):
        super().__init__(lm, max_running)
        # n_blocks=None sizes the pool from the memory left after model load (phase 3.1's budget).
        self.allocator = allocator or BlockAllocator.for_model(lm, block_size=block_size, n_blocks=n_blocks)
        self.block_size = self.allocator.block_size
        self.waited_for_blocks: set[int] = set()  # seq_ids that found a free slot but not enough blocks

    # --- requests: one the whole pool can never hold is refused up front --------------------
    def add(self, prompt: str | list[int], max_new_tokens: int, sampling: SamplingParams = GREEDY,
            ignore_eos: bool = False, arrival: float | None = None) -> Sequence:
        seq = super().add(prompt, max_new_tokens, sampling, ignore_eos, arrival)
        need = blocks_for(worst_case_tokens(seq), self.block_size)
        if need > self.allocator.n_blocks:
            # Waiting would never end: take it back out of the queue and say why.
            self.waiting.remove(seq)
            self.sequences.remove(seq)
            del self._generators[seq.seq_id]
            raise ValueError(f"sequence {seq.seq_id}: {len(seq.prompt_ids)} prompt + {max_new_tokens} new tokens "
                             f"need up to {need} blocks of {self.block_size}, but the whole pool has "
                             f"{self.allocator.n_blocks}")
        return seq

    # --- the KV override points --------------------------------------------------------------
    def new_kv(self, seq: Sequence) -> PagedCache:
        return PagedCache(self.allocator)

    def free_kv(self, seq: Sequence) -> None:
        cache = seq.kv
        super().free_kv(seq)   # books kv_bytes_at_finish (blocks still held), drops seq.kv
        cache.release()        # every block back on the free list

    def kv_bytes(self, seq: Sequence) -> int:
        return seq.kv.kv_bytes if seq.kv is not None else 0

    # --- admission: a free slot AND room in the pool --------------------------------------------
    def blocks_promised(self) -> int:
        """Blocks the running sequences may still claim before they finish (worst case)."""
        return sum(blocks_for(worst_case_tokens(s), self.block_size) - s.kv.n_blocks
                   for s in self.running if s.kv is not None)

    def can_admit(self, seq: Sequence) -> bool:
        """Does the pool have room for seq's worst case on top of what the running ones may claim?"""
        free = self.allocator.n_free - self.blocks_promised()
        return blocks_for(worst_case_tokens(seq), self.block_size) <= free

    def _fill_free_slots(self) -> None:
        for slot in range(self.max_running):
            if self.slots[slot] is not None or not self.waiting:
                continue
            head = self.waiting[0]
            if not self.can_admit(head):
                # First come, first served: nobody overtakes the head of the queue,
                # so a long request cannot be starved by a stream of short ones.
                self.waited_for_blocks.add(head.seq_id)
                break
            seq = self._admit(slot)
            seq.kv = self.new_kv(seq)
        if self.waiting and not self.running:
            # Cannot happen (add() refuses what the empty pool cannot hold); guard against a silent hang.
            raise RuntimeError(f"sequence {self.waiting[0].seq_id} cannot be admitted into an idle pool "
                               f"({self.allocator.n_free} of {self.allocator.n_blocks} blocks free)")
