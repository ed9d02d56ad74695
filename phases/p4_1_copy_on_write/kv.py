"""The KV manager of phase 4.1: block tables that share blocks, and copy a shared block before writing it.

`CowKV` claims slots as phase 3.6's `BlockKV` does, except that a write into a
block another table also holds first gives this table its own copy
(copy-on-write, block_ops.py). The copies a step decides are queued and run
together (`before_pass`), before the step's forward pass writes anything.
`fork` makes a table that lists a parent's blocks, one more owner each.

Admission counts a request of n sequences forked from one prompt with its
full prompt blocks once (`worst_case_blocks`).
"""

from __future__ import annotations

from phases.p2_2_scheduler.sequence import Sequence
from phases.p3_1_block_allocator.allocator import BlockAllocator, blocks_for
from phases.p3_2_block_table.block_table import BlockTable
from phases.p3_3_paged_cache.scheduler import worst_case_tokens
from phases.p3_6_batched_engine.kv import BlockKV
from phases.p4_1_copy_on_write.block_ops import CopyQueue, append_slots_cow, fork


def worst_case_blocks(request, n: int, block_size: int) -> int:
    """Most blocks n sequences forked from `request`'s prompt can hold at once: full prompt blocks counted once.

    `request`: anything with `prompt_ids` and `max_new_tokens` (a Sequence, a SequenceGroup, a workload Request).
    """
    shared = len(request.prompt_ids) // block_size  # full prompt blocks: never written again, shared by all n
    return shared + n * (blocks_for(worst_case_tokens(request), block_size) - shared)


class CowKV(BlockKV):
    """Block tables with shared blocks: fork by reference, copy a shared block on write."""

    def __init__(self, allocator: BlockAllocator):
        super().__init__(allocator)
        self.copies = CopyQueue()     # copies decided this step, run together before the pass writes

    def append_slots(self, seq: Sequence, n: int) -> list[int]:
        """Claim slots; a shared block about to be written is copied first (the copy is queued)."""
        return append_slots_cow(seq.kv, self.allocator, n, self.copies)

    def fork(self, parent: Sequence) -> BlockTable:
        """A new table listing every block of `parent`'s (one more owner each); nothing is copied."""
        return fork(parent.kv, self.allocator)

    def before_pass(self) -> int:
        """Once per step, after the claims and before the pass writes: run every queued copy in one indexed
        copy. Returns how many blocks were copied."""
        return self.copies.flush(self.allocator.kv_store)

    # --- what admission counts ------------------------------------------------------------------
    def blocks_to_admit(self, seq: Sequence, n: int) -> int:
        """Free blocks a request of `n` sequences forked from `seq` must find: their worst case, with the full
        prompt blocks they share counted once."""
        return worst_case_blocks(seq, n, self.block_size)

    def blocks_in_use(self, seq: Sequence, start_block: int = 0) -> int:
        """Blocks `seq`'s table will list from the start (logical block `start_block` on) that other tables
        already hold, so they cost the pool nothing: none, since a new table starts empty."""
        return 0
