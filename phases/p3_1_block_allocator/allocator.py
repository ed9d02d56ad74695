"""`BlockAllocator`: one KV pool carved into equal blocks, handed out from a free list.

The pool is a single tensor allocated once, at startup:

    kv_store: [n_blocks, n_layers, 2, n_kv_heads, block_size, head_dim]   (2 = K, V)

A block is a slice `kv_store[block_id]` with room for `block_size` tokens'
K and V in every layer. Because every block has the same size there is no
"hole too small to use": a block is either free or owned. The free list is a
deque of block ids: `alloc()` takes from the front, `free()` returns to the
back, both O(1).

Every block also carries a reference count. One sequence owning a block is
count 1; `incref()` counts a second owner, so two sequences can share a block
(two requests with the same prompt can hold its blocks once). A block goes back
on the free list only when its last owner frees it.

Misuse is a bug in the caller, so it fails loudly and names the block:
`AllocatorError` for a double free, a free of a block that is not handed out,
an id out of range, or an incref of a free block; `OutOfBlocks` (a separate
type a scheduler can catch, then wait) when the pool is empty.
"""

from __future__ import annotations

from collections import deque

import torch

from phases.p3_1_block_allocator.budget import (DEFAULT_CPU_KV_BUDGET, DEFAULT_MEMORY_FRACTION,
                                                budget_n_blocks, bytes_per_block)

DEFAULT_BLOCK_SIZE = 16  # tokens per block; vLLM's default


def blocks_for(n_tokens: int, block_size: int) -> int:
    """Blocks that hold `n_tokens` tokens: the full ones, plus one for a partly filled last block.

    The one place tokens are rounded up to blocks, so every count of blocks
    agrees with every other.
    """
    full, rest = divmod(n_tokens, block_size)
    return full + (rest > 0)


class OutOfBlocks(RuntimeError):
    """The pool has no free block left. Not a bug: the caller waits for blocks to come back, or gives up."""


class AllocatorError(ValueError):
    """The allocator was misused (double free, foreign id, ...): a bug in the caller."""


class BlockAllocator:
    def __init__(self, n_blocks: int, n_layers: int, n_kv_heads: int, head_dim: int,
                 block_size: int = DEFAULT_BLOCK_SIZE, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.bfloat16):
        for name, value in (("n_blocks", n_blocks), ("n_layers", n_layers), ("n_kv_heads", n_kv_heads),
                            ("head_dim", head_dim), ("block_size", block_size)):
            if not isinstance(value, int) or value < 1:
                raise AllocatorError(f"{name} must be an integer >= 1, got {value!r}")
        self.block_size = block_size
        self.bytes_per_block = bytes_per_block(n_layers, n_kv_heads, head_dim, block_size, dtype)
        # The whole pool, allocated once and never resized.
        # [n_blocks, n_layers, 2, n_kv_heads, block_size, head_dim]
        self.kv_store = torch.zeros(n_blocks, n_layers, 2, n_kv_heads, block_size, head_dim,
                                    device=device, dtype=dtype)
        self._free_list: deque[int] = deque(range(n_blocks))
        self._refcount: list[int] = [0] * n_blocks  # 0 <=> on the free list
        self._ever_handed_out: list[bool] = [False] * n_blocks  # only for clearer error messages

    @classmethod
    def for_model(cls, lm, block_size: int = DEFAULT_BLOCK_SIZE, n_blocks: int | None = None,
                  memory_fraction: float = DEFAULT_MEMORY_FRACTION,
                  cpu_budget_bytes: int = DEFAULT_CPU_KV_BUDGET) -> "BlockAllocator":
        """A pool shaped for `lm` (a LoadedModel), on its device and dtype.

        With `n_blocks=None` the pool is sized by `budget_n_blocks`: call this
        after the model is loaded, so the weights are already off the budget.
        """
        if n_blocks is None:
            n_blocks = budget_n_blocks(lm.n_layers, lm.n_kv_heads, lm.head_dim, block_size, lm.dtype,
                                       lm.device, memory_fraction, cpu_budget_bytes)
        return cls(n_blocks, lm.n_layers, lm.n_kv_heads, lm.head_dim, block_size, lm.device, lm.dtype)

    # --- sizes ---------------------------------------------------------------
    @property
    def n_blocks(self) -> int:
        return len(self._refcount)

    @property
    def n_free(self) -> int:
        return len(self._free_list)

    @property
    def n_used(self) -> int:
        return self.n_blocks - self.n_free

    def can_alloc(self, n: int = 1) -> bool:
        """Would `n` more `alloc()` calls succeed right now?"""
        return n <= self.n_free

    # --- handing blocks out and taking them back ------------------------------
    def alloc(self) -> int:
        """Take the block at the front of the free list; its one owner is the caller."""
        if not self._free_list:
            raise OutOfBlocks(f"KV pool exhausted: all {self.n_blocks} blocks of {self.block_size} tokens "
                              f"are in use")
        block_id = self._free_list.popleft()
        self._refcount[block_id] = 1
        self._ever_handed_out[block_id] = True
        return block_id

    def free(self, block_id: int) -> None:
        """Drop one owner of `block_id`; the last owner's free puts it at the back of the free list."""
        self._check_owned(block_id, "free")
        self._refcount[block_id] -= 1
        if self._refcount[block_id] == 0:
            self._free_list.append(block_id)

    def incref(self, block_id: int) -> None:
        """Count one more owner of an already-owned block (sharing, never allocating)."""
        self._check_owned(block_id, "incref")
        self._refcount[block_id] += 1

    def refcount(self, block_id: int) -> int:
        """How many owners `block_id` has (0: it is free)."""
        self._check_id(block_id)
        return self._refcount[block_id]

    def owned_ids(self) -> list[int]:
        """Ids of every block that is handed out, in id order."""
        return [b for b, count in enumerate(self._refcount) if count > 0]

    # --- checks ------------------------------------------------------------------
    def _check_id(self, block_id: int) -> None:
        if isinstance(block_id, bool) or not isinstance(block_id, int):
            raise AllocatorError(f"block id must be an int, got {block_id!r}")
        if not 0 <= block_id < self.n_blocks:
            raise AllocatorError(f"block {block_id} does not exist: this pool has ids 0..{self.n_blocks - 1}")

    def _check_owned(self, block_id: int, action: str) -> None:
        self._check_id(block_id)
        if self._refcount[block_id] == 0:
            why = ("double free: it was already returned to the free list" if self._ever_handed_out[block_id]
                   else "it was never handed out by alloc()")
            raise AllocatorError(f"cannot {action} block {block_id}: it is free ({why})")

    def check_invariants(self) -> None:
        """Assert the bookkeeping is consistent: every block is free xor owned, none listed twice."""
        free = set(self._free_list)
        assert len(free) == len(self._free_list), "a block is on the free list twice"
        for b, count in enumerate(self._refcount):
            assert count >= 0, f"block {b} has refcount {count}"
            assert (count == 0) == (b in free), f"block {b}: refcount {count} but on free list: {b in free}"

    def __repr__(self) -> str:
        return (f"BlockAllocator({self.n_blocks} blocks x {self.block_size} tokens, {self.n_used} used, "
                f"{self.bytes_per_block:,} B/block, {self.kv_store.dtype}, {self.kv_store.device})")
