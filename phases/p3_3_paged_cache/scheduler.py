"""`PagedScheduler`: phase 2.3's continuous batching with every sequence's K/V in one shared block pool.

Only the KV override points of `ContinuousScheduler` change: a sequence's KV is a `PagedCache` on the
shared `BlockAllocator`. Each running sequence still gets its own forward pass per step.

Admission needs a free slot and room in the pool. A sequence the pool cannot take waits at the head of
the queue until blocks come back. So that a running sequence never meets an empty pool mid-decode
(nothing here takes blocks back), admission counts each sequence's worst case:

    worst_case_tokens(seq)  prompt + max_new_tokens - 1 (the last token is never fed back)
    blocks_promised()       blocks everybody running may still claim: worst case minus blocks held
    blocks_to_admit(seq)    blocks `seq` must find free to be admitted: its worst case
    can_admit(seq)          a free slot and blocks_to_admit(seq) <= free - blocks_promised()

Blocks are still claimed one at a time as tokens arrive; only admission looks at the worst case.
"""

from __future__ import annotations

from phases.p2_2_scheduler.sequence import Sequence
from phases.p2_3_continuous_batching.scheduler import ContinuousScheduler
from phases.p3_1_block_allocator.allocator import DEFAULT_BLOCK_SIZE, BlockAllocator, blocks_for
from phases.p3_2_block_table.block_table import BlockTable
from phases.p3_3_paged_cache.paged_cache import PagedCache

def worst_case_tokens(request) -> int:
    """Most K/V positions a request (anything with `prompt_ids`, `max_new_tokens`) can store: every
    token but the last, which is sampled and never fed back."""
    return len(request.prompt_ids) + request.max_new_tokens - 1


def check_fits_pool(seq: Sequence, allocator: BlockAllocator) -> None:
    """ValueError, before queueing, for a request the whole pool can never hold (it would wait forever)."""
    need = blocks_for(worst_case_tokens(seq), allocator.block_size)
    if need > allocator.n_blocks:
        raise ValueError(f"sequence {seq.seq_id}: {len(seq.prompt_ids)} prompt + {seq.max_new_tokens} new tokens "
                         f"need up to {need} blocks of {allocator.block_size}, but the whole pool has "
                         f"{allocator.n_blocks}")


class PagedScheduler(ContinuousScheduler):
    """Continuous batching over a paged KV pool: one `PagedCache` per running sequence, one allocator for all."""

    def __init__(self, lm, max_running: int = 4, block_size: int = DEFAULT_BLOCK_SIZE,
                 n_blocks: int | None = None, allocator: BlockAllocator | None = None):
        super().__init__(lm, max_running)
        # n_blocks=None sizes the pool from the memory left after model load (phase 3.1's budget).
        self.allocator = allocator or BlockAllocator.for_model(lm, block_size=block_size, n_blocks=n_blocks)
        self.block_size = self.allocator.block_size
        self.waited_for_blocks: set[int] = set()  # seq_ids that found a free slot but not enough blocks

    def _new_sequence(self, prompt, max_new_tokens, sampling, ignore_eos, arrival) -> Sequence:
        seq = super()._new_sequence(prompt, max_new_tokens, sampling, ignore_eos, arrival)
        check_fits_pool(seq, self.allocator)
        return seq

    def new_kv(self, seq: Sequence) -> PagedCache:
        """A `PagedCache` on the shared pool, with no blocks yet: the prefill claims them."""
        return PagedCache(self.allocator)

    def block_table(self, seq: Sequence) -> BlockTable:
        """The block table behind `seq`'s KV state: the one its `PagedCache` writes through."""
        return seq.kv.table

    def free_kv(self, seq: Sequence) -> None:
        """The finished sequence's blocks go back, for whoever is admitted next in this same step."""
        table = self.block_table(seq)
        super().free_kv(seq)           # books kv_bytes_at_finish (blocks still held), drops seq.kv
        table.release(self.allocator)  # every block it held back on the free list

    def kv_bytes(self, seq: Sequence) -> int:
        """Whole blocks held, the unused tail of the last one included."""
        return self.block_table(seq).n_blocks * self.allocator.bytes_per_block if seq.kv is not None else 0

    def blocks_to_admit(self, seq: Sequence) -> int:
        """Free blocks `seq` must find to be admitted: its worst case, so its decode never runs dry."""
        return blocks_for(worst_case_tokens(seq), self.block_size)

    def blocks_promised(self) -> int:
        """Blocks the running sequences may still claim before they finish (worst case minus blocks held)."""
        return sum(blocks_for(worst_case_tokens(s), self.block_size) - self.block_table(s).n_blocks
                   for s in self.running)

    def can_admit(self, seq: Sequence) -> bool:
        """A free slot (phase 2.3), and room in the pool for seq's worst case beside what the running may claim."""
        if not super().can_admit(seq):
            return False
        if self.blocks_to_admit(seq) <= self.allocator.n_free - self.blocks_promised():
            return True
        self.waited_for_blocks.add(seq.seq_id)   # a slot was free, the pool was not
        return False

    def _fill_free_slots(self) -> None:
        super()._fill_free_slots()
        if self.waiting and not self.running:
            # Cannot happen (add() refuses what the empty pool cannot hold); guard against a silent hang.
            raise RuntimeError(f"sequence {self.waiting[0].seq_id} cannot be admitted into an idle pool "
                               f"({self.allocator.n_free} of {self.allocator.n_blocks} blocks free)")
