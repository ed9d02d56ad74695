"""Input checks for the decode-attention and K/V-store entry points, on top of phase 3.4's pool/table checks.

Shape checks always run; value checks (slots inside the pool) only on CPU, where they stall no GPU stream.
"""

from __future__ import annotations

import torch

from phases.p3_4_gather_kernel.checks import INDEX_DTYPES, check_paged_inputs, check_pool

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
PADDING_SLOT = -1  # a slot_mapping entry that stores nothing (a padding token)


def check_window_and_softcap(sliding_window: int | None, softcap: float | None) -> None:
    """A sliding window w (keys p - w + 1 .. p) and a logit softcap c (c * tanh(scores / c)), if given."""
    if sliding_window is not None and (isinstance(sliding_window, bool) or int(sliding_window) != sliding_window
                                       or sliding_window < 1):
        raise ValueError(f"sliding_window must be None or an int >= 1 (keys p - w + 1 .. p), got {sliding_window!r}")
    if softcap is not None and not float(softcap) > 0:
        raise ValueError(f"softcap must be None or > 0 (scores become c * tanh(scores / c)), got {softcap!r}")


def check_decode_inputs(q: torch.Tensor, kv_store: torch.Tensor, layer_idx: int,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor, values: bool = True) -> None:
    """q [B, n_heads, head_dim] against the pool [.., n_kv_heads, block_size, head_dim] and the tables.
    values=False: shapes only (the tables' contents were checked once for the whole pass)."""
    check_paged_inputs(kv_store, layer_idx, block_tables, seq_lens, values)
    if q.dim() != 3:
        raise ValueError(f"q must be [batch, n_heads, head_dim] (one decode token per sequence), "
                         f"got shape {tuple(q.shape)}")
    if q.shape[0] != block_tables.shape[0]:
        raise ValueError(f"q has batch {q.shape[0]} but block_tables has {block_tables.shape[0]} rows")
    check_query_heads(q, kv_store)


def check_query_heads(q: torch.Tensor, kv_store: torch.Tensor) -> None:
    """q [.., n_heads, head_dim] (3-D) against the pool: head_dim, GQA grouping, dtype and device."""
    n_kv_heads, head_dim = kv_store.shape[3], kv_store.shape[5]
    if q.shape[2] != head_dim:
        raise ValueError(f"q head_dim {q.shape[2]} does not match the pool's head_dim {head_dim}")
    if q.shape[1] % n_kv_heads != 0:
        raise ValueError(f"n_heads {q.shape[1]} must be a multiple of n_kv_heads {n_kv_heads} (GQA)")
    if q.dtype not in FLOAT_DTYPES or kv_store.dtype not in FLOAT_DTYPES:
        raise ValueError(f"q and kv_store must be fp32/fp16/bf16, got {q.dtype} and {kv_store.dtype}")
    if q.device != kv_store.device:
        raise ValueError(f"q is on {q.device} but kv_store is on {kv_store.device}")


def check_write_inputs(kv_store: torch.Tensor, layer_idx: int, k: torch.Tensor, v: torch.Tensor,
                       slot_mapping: torch.Tensor, values: bool = True) -> None:
    """k, v [T, n_kv_heads, head_dim]; slot_mapping [T] int (block_id * block_size + offset, or -1).
    values=False: shapes only (the slots were checked once for the whole pass)."""
    check_pool(kv_store, layer_idx)
    n_blocks, n_kv_heads, block_size, head_dim = kv_store.shape[0], kv_store.shape[3], kv_store.shape[4], kv_store.shape[5]
    expected = (slot_mapping.shape[0] if slot_mapping.dim() == 1 else -1, n_kv_heads, head_dim)
    if slot_mapping.dim() != 1:
        raise ValueError(f"slot_mapping must be [n_tokens], got shape {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in INDEX_DTYPES:
        raise ValueError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    for name, t in (("k", k), ("v", v)):
        if tuple(t.shape) != expected:
            raise ValueError(f"{name} must be [n_tokens={expected[0]}, n_kv_heads={n_kv_heads}, "
                             f"head_dim={head_dim}], got {tuple(t.shape)}")
        if t.device != kv_store.device or slot_mapping.device != kv_store.device:
            raise ValueError(f"k, v and slot_mapping must be on the pool's device {kv_store.device}")
    if values and kv_store.device.type == "cpu" and slot_mapping.numel():
        lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
        if lo < PADDING_SLOT or hi >= n_blocks * block_size:
            raise ValueError(f"slot_mapping must lie in [0, {n_blocks * block_size}) (or be {PADDING_SLOT} "
                             f"for padding), got values in [{lo}, {hi}]")
