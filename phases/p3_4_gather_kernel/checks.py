"""Input checks shared by the paged gather kernel and its reference.

A kernel handed a wrong shape does not raise: it reads the wrong memory. So
every entry point raises a ValueError naming the argument. Value checks (block
ids inside the pool) read tensor contents, which would stall a GPU stream, so
they run on CPU tensors only.
"""

from __future__ import annotations

import torch

POOL_DIMS = "[n_blocks, n_layers, 2, n_kv_heads, block_size, head_dim]"
INDEX_DTYPES = (torch.int32, torch.int64)


def is_power_of_two(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def next_power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def require_power_of_two(name: str, value: int) -> None:
    """Triton's `tl.arange` only spans powers of two, so tile sizes must be one."""
    if not is_power_of_two(value):
        raise ValueError(f"{name} must be a power of two for the Triton kernels (tl.arange needs one), "
                         f"got {value}; use the PyTorch reference path for other sizes")


def check_pool(kv_store: torch.Tensor, layer_idx: int) -> None:
    if not isinstance(kv_store, torch.Tensor) or kv_store.dim() != 6:
        shape = tuple(kv_store.shape) if isinstance(kv_store, torch.Tensor) else type(kv_store).__name__
        raise ValueError(f"kv_store must be a 6-d tensor {POOL_DIMS}, got {shape}")
    if kv_store.shape[2] != 2:
        raise ValueError(f"kv_store dim 2 holds K and V and must be 2, got {kv_store.shape[2]}")
    n_layers = kv_store.shape[1]
    if not 0 <= int(layer_idx) < n_layers:
        raise ValueError(f"layer_idx {layer_idx} out of range for a pool with {n_layers} layers")


def check_tables(kv_store: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 values: bool = True) -> None:
    """block_tables [B, max_blocks] and seq_lens [B], integer, on the pool's device.
    values=False: skip the value checks, for tables already checked once this forward pass."""
    if block_tables.dim() != 2:
        raise ValueError(f"block_tables must be [batch, max_blocks], got shape {tuple(block_tables.shape)}")
    if seq_lens.dim() != 1 or seq_lens.shape[0] != block_tables.shape[0]:
        raise ValueError(f"seq_lens must be [batch] with batch = block_tables.shape[0] = {block_tables.shape[0]}, "
                         f"got shape {tuple(seq_lens.shape)}")
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens)):
        if t.dtype not in INDEX_DTYPES:
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
        if t.device != kv_store.device:
            raise ValueError(f"{name} is on {t.device} but kv_store is on {kv_store.device}")
    if not values or kv_store.device.type != "cpu" or seq_lens.numel() == 0:
        return
    n_blocks, block_size = kv_store.shape[0], kv_store.shape[4]
    capacity = block_tables.shape[1] * block_size
    if int(seq_lens.min()) < 0 or int(seq_lens.max()) > capacity:
        raise ValueError(f"seq_lens must lie in [0, {capacity}] (max_blocks {block_tables.shape[1]} x "
                         f"block_size {block_size}), got {seq_lens.tolist()}")
    # Only the entries a sequence actually uses must be valid ids; padding is never read.
    used = torch.arange(block_tables.shape[1])[None, :] < (seq_lens[:, None] + block_size - 1) // block_size
    ids = block_tables[used]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n_blocks):
        raise ValueError(f"block_tables holds block ids outside the pool [0, {n_blocks})")


def check_paged_inputs(kv_store: torch.Tensor, layer_idx: int, block_tables: torch.Tensor,
                       seq_lens: torch.Tensor, values: bool = True) -> None:
    check_pool(kv_store, layer_idx)
    check_tables(kv_store, block_tables, seq_lens, values)
