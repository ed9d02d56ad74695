"""The KV manager: a bare `BlockTable` per sequence on one shared pool (a batched pass reads it by table)."""

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
        self.peak_blocks_used = 0

    def new_table(self, seq: Sequence) -> None:
        seq.kv = BlockTable(self.block_size)

    def append_slots(self, seq: Sequence, n: int) -> list[int]:
        """Claim pool slots for `seq`'s next `n` tokens (new blocks as the last one fills)."""
        return seq.kv.append_slots(self.allocator, n)

    def written(self, seqs: list[Sequence]) -> None:
        """A pass wrote every slot these sequences claimed: the most blocks held, so the peak is read here."""
        self.peak_blocks_used = max(self.peak_blocks_used, self.allocator.n_used)

    def free(self, seq: Sequence) -> None:
        seq.kv.release(self.allocator)
        seq.kv = None

    def blocks_for_worst_case(self, seq: Sequence) -> int:
        """Blocks `seq` holds if it runs to max_new_tokens."""
        return blocks_for(worst_case_tokens(seq), self.block_size)

    def blocks_still_needed(self, seq: Sequence) -> int:
        """Blocks a running `seq` may still claim: its worst case minus what it holds."""
        return self.blocks_for_worst_case(seq) - seq.kv.n_blocks
