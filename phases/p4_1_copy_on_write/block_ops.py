"""Block sharing between tables: fork, copy-on-write before a write, and many block copies in one launch.

Two block tables may list the same physical block: the allocator's reference
count says how many tables hold it. Sharing is only safe while nobody writes,
so the rule is the one an OS uses for a forked process's pages:

- `fork(table)` makes a child table that lists *the same* blocks (one incref
  each, no K/V copied): the child starts as an exact alias of its parent.
- Before a table writes into a block it shares (refcount > 1), it takes a fresh
  block, copies the shared block's K/V into it, drops its claim on the old one
  and points its table at the copy (`copy_on_write`). The other owners keep the
  old block untouched; the last owner finds refcount 1 and writes in place.

Only the block holding position `n_filled` is ever written (earlier blocks are
full, later ones do not exist yet), so a write needs at most ONE copy per
table: in practice, the last block of a prompt that several samples fork from.
The copies are queued in a `CopyQueue` and run together, in one launch, just
before the pass that writes. `fork` and `append_slots_cow` are all or nothing:
a failure never leaks a block or leaves a table half-changed.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from phases.p3_1_block_allocator.allocator import BlockAllocator, OutOfBlocks
from phases.p3_2_block_table.block_table import BlockTable


def fork(table: BlockTable, allocator: BlockAllocator) -> BlockTable:
    """A new table sharing every block of `table` (one more owner each); nothing is copied. If a reference cannot
    be taken (a block that is not owned), those taken so far are dropped."""
    taken: list[int] = []
    try:
        for block_id in table.block_ids:
            allocator.incref(block_id)
            taken.append(block_id)
    except Exception:
        for block_id in taken:
            allocator.free(block_id)
        raise
    return BlockTable(table.block_size, list(table.block_ids), table.n_filled)


@dataclass
class CopyQueue:
    """Block copies decided this step, run together before the next write: `kv_store[dst] = kv_store[src]`, one
    indexed copy (one launch on a GPU) however many blocks, every layer's K and V at once."""
    src: list[int] = field(default_factory=list)
    dst: list[int] = field(default_factory=list)
    n_copied: int = 0  # total blocks copied so far (for demos and tests)

    def add(self, src: int, dst: int) -> None:
        self.src.append(src)
        self.dst.append(dst)

    def __len__(self) -> int:
        return len(self.src)

    def discard(self) -> None:
        """Forget the queued copies: the pass they were for failed, and their destination blocks go back."""
        self.src.clear()
        self.dst.clear()

    def flush(self, kv_store: torch.Tensor) -> int:
        """Copy every queued block, all layers and both K and V, in one indexed copy; return how many."""
        n = len(self.src)
        if n:
            device = kv_store.device
            src = torch.tensor(self.src, dtype=torch.int64, device=device)   # [n]
            dst = torch.tensor(self.dst, dtype=torch.int64, device=device)   # [n]
            # kv_store [n_blocks, n_layers, 2, n_kv_heads, block_size, head_dim]: the first axis moves whole
            # blocks. src and dst never overlap (dst blocks were free until this step; src blocks are owned).
            kv_store[dst] = kv_store[src]
            self.src.clear()
            self.dst.clear()
            self.n_copied += n
        return n


def needs_copy(table: BlockTable, allocator: BlockAllocator) -> bool:
    """Would writing this table's next token land in a block another table also holds?"""
    logical = table.n_filled // table.block_size
    return logical < table.n_blocks and allocator.refcount(table.block_ids[logical]) > 1


def copy_on_write(table: BlockTable, allocator: BlockAllocator, copies: CopyQueue) -> int | None:
    """Give `table` its own copy of the block its next token goes into, if that block is shared. Returns the new
    block id (the copy queued in `copies`), or None when the next write is already private."""
    if not needs_copy(table, allocator):
        return None
    logical = table.n_filled // table.block_size
    old = table.block_ids[logical]
    new = allocator.alloc()
    allocator.free(old)           # one owner fewer; the others keep it (refcount stays >= 1)
    table.block_ids[logical] = new
    copies.add(old, new)
    return new


def append_slots_cow(table: BlockTable, allocator: BlockAllocator, n: int, copies: CopyQueue) -> list[int]:
    """Claim slots for `n` more tokens like `BlockTable.append_slots`, copying a shared block first. All or
    nothing: the pool is checked for the copy *and* the new blocks before anything changes."""
    if n <= 0:
        return table.append_slots(allocator, n)
    need = table.blocks_needed(n) + int(needs_copy(table, allocator))
    if not allocator.can_alloc(need):
        raise OutOfBlocks(f"need {need} blocks for {n} tokens (copy-on-write included), "
                          f"{allocator.n_free} free of {allocator.n_blocks}")
    logical = table.n_filled // table.block_size
    new = copy_on_write(table, allocator, copies)
    try:
        return table.append_slots(allocator, n)
    except Exception:
        if new is not None:  # undo the copy: the table lists the shared block again, the copy goes back
            old = copies.src.pop()
            copies.dst.pop()
            allocator.incref(old)
            table.block_ids[logical] = old
            allocator.free(new)
        raise


# --- accounting and invariants ------------------------------------------------------
def blocks_held(tables: list[BlockTable]) -> tuple[int, int]:
    """(distinct blocks the tables hold, blocks they would hold with no sharing: sum of their lengths)."""
    distinct = len({b for t in tables for b in t.block_ids})
    return distinct, sum(t.n_blocks for t in tables)


def check_refcounts(allocator: BlockAllocator, tables: list[BlockTable]) -> None:
    """Assert each block's refcount equals the number of tables listing it (tables are the only owners)."""
    holders = Counter(b for t in tables for b in t.block_ids)
    for block_id in range(allocator.n_blocks):
        assert allocator.refcount(block_id) == holders[block_id], (
            f"block {block_id}: refcount {allocator.refcount(block_id)} but {holders[block_id]} tables hold it")
    allocator.check_invariants()
