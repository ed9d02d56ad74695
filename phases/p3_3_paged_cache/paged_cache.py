"""`PagedCache`: a `transformers.Cache` for one sequence whose K/V live in the shared block pool.

`DynamicCache` grows one [1, n_kv_heads, n_tokens, head_dim] tensor per layer with `torch.cat` every
forward pass. `PagedCache` keeps nothing of its own but a `BlockTable`. Each forward pass it

  1. claims slots for the T new tokens in the table, once, at layer 0 (every layer stores the same
     positions, so all layers share one set of slots);
  2. writes each layer's new K/V into those slots of the pool, in one indexed copy (`_write`);
  3. returns the layer's whole K/V copied out block by block (`gather_python`): transformers'
     attention wants one contiguous tensor. This copy is the price of this phase.

`get_seq_length()` and `get_mask_sizes()` read the table, so the mask and positions are DynamicCache's.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from phases.p3_1_block_allocator.allocator import BlockAllocator
from phases.p3_2_block_table.block_table import BlockTable
from phases.p3_3_paged_cache.gather import gather_python

FIRST_LAYER = 0  # the layer whose update opens a forward pass (and claims its slots)


class PagedLayer(CacheLayerMixin):
    """One model layer's window on a `PagedCache`. It owns no tensors, only how many tokens it has
    written, to catch a forward pass that skips or repeats a layer."""

    is_sliding = False      # full attention: every past token stays visible
    is_compileable = False  # Python bookkeeping on every update: not for torch.compile
    is_croppable = False

    def __init__(self, cache: "PagedCache", layer_idx: int):
        super().__init__()
        self.cache = cache
        self.layer_idx = layer_idx
        self.n_written = 0
        self.is_initialized = True  # nothing to allocate lazily: the pool already exists

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self.cache.update(key_states, value_states, self.layer_idx)

    def get_seq_length(self) -> int:
        return self.cache.table.n_filled

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Called before the forward pass writes anything: the mask spans the
        # tokens already stored plus the new ones, starting at position 0.
        return self.cache.table.n_filled + query_length, 0

    def get_max_length(self) -> int:
        return -1  # grows a block at a time for as long as the pool has blocks

    def reset(self) -> None:
        self.n_written = 0


class PagedCache(Cache):
    """A drop-in for `DynamicCache` (one sequence, batch size 1) that stores K/V in a shared pool."""

    def __init__(self, allocator: BlockAllocator, table: BlockTable | None = None):
        pool = allocator.kv_store  # [n_blocks, n_layers, 2, n_kv_heads, block_size, head_dim]
        self.allocator = allocator
        self.table = table if table is not None else BlockTable(allocator.block_size)
        if self.table.block_size != allocator.block_size:
            raise ValueError(f"block table has block_size {self.table.block_size}, "
                             f"the pool {allocator.block_size}")
        super().__init__(layers=[PagedLayer(self, i) for i in range(pool.shape[1])])
        # The (block, offset) of the tokens claimed by the forward pass in flight, shared by all layers.
        self._blocks = self._offsets = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Store this pass's K/V for `layer_idx`, [1, n_kv_heads, T, head_dim] each; return all of that
        layer's, [1, n_kv_heads, n_tokens, head_dim] each."""
        if key_states.shape[0] != 1:
            raise ValueError(f"PagedCache holds one sequence; got a batch of {key_states.shape[0]}")
        if key_states.dtype != self.allocator.kv_store.dtype:
            # A silent cast would round the K/V and break the bit-identical promise.
            raise TypeError(f"K/V are {key_states.dtype} but the pool is {self.allocator.kv_store.dtype}: "
                            f"build the pool in the model's dtype (BlockAllocator.for_model)")
        layer = self.layers[layer_idx]
        n_new = key_states.shape[2]
        if layer_idx == FIRST_LAYER:
            self._claim(n_new)
        start = self.table.n_filled - n_new  # first position this pass writes
        if layer.n_written != start or self._blocks is None or len(self._blocks) != n_new:
            raise RuntimeError(f"layer {layer_idx} is out of step: it holds {layer.n_written} tokens, but this "
                               f"forward pass claimed positions {start}..{self.table.n_filled - 1}")
        self._write(layer_idx, key_states, value_states)
        layer.n_written = self.table.n_filled
        return gather_python(self.allocator.kv_store, self.table.block_ids, self.table.n_filled, layer_idx)

    def _claim(self, n_new: int) -> None:
        """Reserve the next n_new positions in the table (new blocks as needed) for every layer."""
        slots = self.table.append_slots(self.allocator, n_new)  # raises OutOfBlocks, table unchanged
        slots = torch.tensor(slots, device=self.allocator.kv_store.device)
        bs = self.allocator.block_size
        self._blocks, self._offsets = slots // bs, slots % bs   # [T] each

    def _write(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Scatter the T new tokens' K/V into their (block, offset) slots in one copy (the blog: 2 * T copies)."""
        # The pool's layer as [n_blocks, block_size, 2, n_kv_heads, head_dim] (a view, no copy),
        # so that indexing by (block, offset) picks one token's K and V for all heads.
        pool_layer = self.allocator.kv_store[:, layer_idx].permute(0, 3, 1, 2, 4)
        new = torch.stack([key_states[0], value_states[0]])   # [2, n_kv_heads, T, head_dim]
        pool_layer[self._blocks, self._offsets] = new.permute(2, 0, 1, 3)       # [T, 2, n_kv_heads, head_dim]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens stored so far (all layers hold the same positions)."""
        return self.table.n_filled

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.table.n_filled + query_length, 0

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def n_blocks(self) -> int:
        return self.table.n_blocks

    def release(self) -> None:
        """Give every block back to the pool; the cache is empty (and reusable) afterwards."""
        self.table.release(self.allocator)
        self._blocks = self._offsets = None
        for layer in self.layers:
            layer.reset()

    def reset(self) -> None:
        self.release()

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("PagedCache cannot drop tokens (no speculative decoding here)")

    def __repr__(self) -> str:
        return (f"PagedCache({self.table.n_filled} tokens in {self.table.n_blocks} blocks "
                f"{self.table.block_ids} of {self.allocator.block_size})")

    def gathered(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V of `layer_idx` as one contiguous pair (what attention read), for inspection and tests."""
        return gather_python(self.allocator.kv_store, self.table.block_ids, self.table.n_filled, layer_idx)

