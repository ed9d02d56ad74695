"""The KV manager: every sequence's K/V is a bare `BlockTable` on one shared `BlockAllocator`.

Phase 3.3 kept a `PagedCache` object per sequence, because each sequence ran
its own forward pass through transformers' cache interface. One batched pass
reads the pool by block table instead (attention.py), so the table is all a
sequence needs. This part answers the scheduler's three questions about
memory and does the claiming:

- how many blocks is the pool short of, if `seq` runs to its worst case?
  (`blocks_for_worst_case`, `blocks_still_needed`: admission counts these);
- where do the next `n` tokens of `seq` go? (`append_slots`: claims blocks as
  they fill, returns pool slots for the forward pass to write);
- `seq` is done: `free` gives every block back at once.

`written` hears that a pass has run, and reads the peak of blocks held.
"""

from __future__ import annotations

from phases.p2_2_scheduler.sequence import Sequence
from phases.p3_1_block_allocator.allocator import BlockAllocator, blocks_for
from phases.p3_2_block_table.block_table import BlockTable
from phases.p3_3_paged_cache.scheduler import worst_case_tokens


class BlockKV:
    """Block tables over one pool: claim slots as tokens arrive, release a table's blocks at the end."""

    def __init__(self, allocator: BlockAllocator):
        self.allocator = allocator
        self.block_size = allocator.block_size
        self.peak_blocks_used = 0   # most blocks held at once (read after each pass)

    def new_table(self, seq: Sequence) -> None:
        """`seq` is admitted: it gets an empty table, and its prefill claims the blocks."""
        seq.kv = BlockTable(self.block_size)

    def append_slots(self, seq: Sequence, n: int) -> list[int]:
        """Claim pool slots for `seq`'s next `n` tokens (new blocks as the last one fills)."""
        return seq.kv.append_slots(self.allocator, n)

    def written(self, seqs: list[Sequence]) -> None:
        """A forward pass has written the K/V of every slot these sequences claimed: the moment the most
        blocks are held (no one has released any yet), so the peak is read here."""
        self.peak_blocks_used = max(self.peak_blocks_used, self.allocator.n_used)

    def free(self, seq: Sequence) -> None:
        """Every block of `seq` back to the pool; `seq.kv` is None afterwards."""
        seq.kv.release(self.allocator)
        seq.kv = None

    # --- what admission counts ------------------------------------------------------------------
    def blocks_for_worst_case(self, seq: Sequence) -> int:
        """Blocks `seq` holds if it runs to max_new_tokens."""
        return blocks_for(worst_case_tokens(seq), self.block_size)

    def blocks_still_needed(self, seq: Sequence) -> int:
        """Blocks a running `seq` may still claim before it finishes: its worst case minus what it holds."""
        return self.blocks_for_worst_case(seq) - seq.kv.n_blocks
