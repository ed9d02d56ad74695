"""`BlockTable`: one sequence's map from logical token positions to physical pool blocks.

The sequence sees a contiguous address space, token 0, 1, 2, ...; its K/V
really lives in whatever pool blocks the allocator handed out, in any order:

    logical block  = token_pos // block_size
    offset         = token_pos %  block_size
    physical block = block_ids[logical block]
    slot           = physical block * block_size + offset

A *slot* numbers every token position of the pool, `n_blocks * block_size`
of them, in one integer: `(slot // block_size, slot % block_size)` gives back
`kv_store[block, :, :, :, offset]`. A list of slots (the "slot mapping") is
the table's answer for a batch of new tokens: for each, where its K and V go.

The table only ever grows at the end and never moves a block, so a token's
slot is fixed from the moment it is written until the table is released.
A table writes into the blocks it lists; were two tables to list one block, a
write through one would change what the other reads, so here no two share one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from phases.p3_1_block_allocator.allocator import BlockAllocator, OutOfBlocks, blocks_for


# eq=False: a table is an owner with an identity; two tables listing the same
# blocks are still two owners (and a table can be a dict key or set member).
@dataclass(eq=False)
class BlockTable:
    block_size: int
    block_ids: list[int] = field(default_factory=list)  # logical block i -> physical block id
    n_filled: int = 0                                    # tokens written so far

    def __post_init__(self):
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if not 0 <= self.n_filled <= self.capacity:
            raise ValueError(f"n_filled={self.n_filled} does not fit in {self.n_blocks} blocks "
                             f"of {self.block_size} tokens")

    # --- sizes -----------------------------------------------------------------
    @property
    def n_blocks(self) -> int:
        return len(self.block_ids)

    @property
    def capacity(self) -> int:
        """Tokens the blocks already held can store."""
        return self.n_blocks * self.block_size

    @property
    def tail_waste(self) -> int:
        """Slots allocated but unused: the empty end of the last block (< block_size)."""
        return self.capacity - self.n_filled

    def blocks_needed(self, n_new_tokens: int) -> int:
        """How many more blocks `n_new_tokens` more tokens need (0 when they fit)."""
        return max(0, blocks_for(self.n_filled + n_new_tokens, self.block_size) - self.n_blocks)

    # --- growing -----------------------------------------------------------------
    def maybe_extend(self, allocator: BlockAllocator) -> None:
        """Before writing one more token: take a fresh block if the last one is full."""
        self.ensure_capacity(allocator, 1)

    def ensure_capacity(self, allocator: BlockAllocator, n_new_tokens: int) -> list[int]:
        """Make room for `n_new_tokens` more tokens (a whole prefill at once); return the new block ids.

        All or nothing: if the pool runs dry half-way, the blocks taken in this
        call go back and `OutOfBlocks` propagates, so the caller can wait
        with the table exactly as it was.
        """
        if n_new_tokens < 0:
            raise ValueError(f"n_new_tokens must be >= 0, got {n_new_tokens}")
        if self.n_filled + n_new_tokens <= len(self.block_ids) * self.block_size:
            return []      # it fits: the common case (a decode step's one token, block_size - 1 times in block_size)
        taken: list[int] = []
        try:
            for _ in range(self.blocks_needed(n_new_tokens)):
                taken.append(allocator.alloc())
        except OutOfBlocks:
            for block_id in taken:
                allocator.free(block_id)
            raise
        self.block_ids.extend(taken)
        return taken

    def append_slots(self, allocator: BlockAllocator, n: int) -> list[int]:
        """Claim the next `n` token positions; return their slots (where their K/V go)."""
        pos, bs = self.n_filled, self.block_size
        if n == 1 and pos < len(self.block_ids) * bs:
            # A decode step's one token into the last block (block_size - 1 times in block_size): its slot
            # straight away, as `slot_mapping` computes it, without the general path's checks.
            self.n_filled = pos + 1
            return [self.block_ids[pos // bs] * bs + pos % bs]
        self.ensure_capacity(allocator, n)
        start = self.n_filled
        self.n_filled += n
        return self.slot_mapping(start, self.n_filled)

    # --- looking up --------------------------------------------------------------
    def physical_pos(self, token_pos: int) -> tuple[int, int]:
        """(physical block id, offset inside it) of an already-written token."""
        if not 0 <= token_pos < self.n_filled:
            raise IndexError(f"token position {token_pos} is not in this table: it holds "
                             f"{self.n_filled} tokens (positions 0..{self.n_filled - 1})")
        return self.block_ids[token_pos // self.block_size], token_pos % self.block_size

    def slot(self, token_pos: int) -> int:
        block_id, offset = self.physical_pos(token_pos)
        return block_id * self.block_size + offset

    def slot_mapping(self, start: int = 0, end: int | None = None) -> list[int]:
        """Slots of token positions start..end-1 (default: every written token)."""
        end = self.n_filled if end is None else end
        if not 0 <= start <= end <= self.n_filled:
            raise IndexError(f"token range {start}..{end} is outside this table's {self.n_filled} tokens")
        bs = self.block_size     # `slot` for each position, without re-checking each one (the range was checked)
        return [self.block_ids[pos // bs] * bs + pos % bs for pos in range(start, end)]

    # --- giving back -------------------------------------------------------------
    def release(self, allocator: BlockAllocator) -> None:
        """Drop this table's claim on every block (shared blocks stay with their other owners)."""
        for block_id in self.block_ids:
            allocator.free(block_id)
        self.block_ids.clear()
        self.n_filled = 0
