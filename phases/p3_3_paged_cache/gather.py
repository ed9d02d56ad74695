"""The slow baseline gather: copy one sequence's K/V out of the pool, block by block.

    kv_store: [n_blocks, n_layers, 2, n_kv_heads, block_size, head_dim]   (index 0 = K, 1 = V)

Token position p lives at (block_ids[p // block_size], p % block_size). Attention wants one contiguous
[1, n_kv_heads, n_tokens, head_dim] tensor, so this slices every block and concatenates: one copy and one
Python iteration per block, per layer, per sequence.
"""

from __future__ import annotations

import torch

from phases.p3_1_block_allocator.allocator import blocks_for

K_INDEX, V_INDEX = 0, 1  # position of K and V in the pool's third dimension


def gather_python(kv_store: torch.Tensor, block_ids: list[int], n_tokens: int,
                  layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the first `n_tokens` tokens of one sequence, each [1, n_kv_heads, n_tokens, head_dim].
    `block_ids`: the sequence's physical blocks in logical order."""
    if kv_store.dim() != 6:
        raise ValueError(f"kv_store must be [n_blocks, n_layers, 2, n_kv_heads, block_size, head_dim], "
                         f"got shape {tuple(kv_store.shape)}")
    n_blocks, n_layers, _, n_kv_heads, block_size, head_dim = kv_store.shape
    if not 0 <= layer_idx < n_layers:
        raise IndexError(f"layer_idx {layer_idx} out of range for a pool with {n_layers} layers")
    if n_tokens < 0:
        raise ValueError(f"n_tokens must be >= 0, got {n_tokens}")
    n_needed = blocks_for(n_tokens, block_size)  # blocks that hold at least one of the tokens
    if n_needed > len(block_ids):
        raise ValueError(f"{n_tokens} tokens need {n_needed} blocks of {block_size}, "
                         f"but the block table has only {len(block_ids)}")
    if n_tokens == 0:
        empty = kv_store.new_zeros(1, n_kv_heads, 0, head_dim)
        return empty, empty.clone()

    k_chunks, v_chunks = [], []
    for i, phys in enumerate(block_ids[:n_needed]):
        # The last block may be partly filled: take only its first `used` slots.
        used = min(block_size, n_tokens - i * block_size)
        block = kv_store[phys, layer_idx]  # [2, n_kv_heads, block_size, head_dim]
        k_chunks.append(block[K_INDEX, :, :used])  # [n_kv_heads, used, head_dim]
        v_chunks.append(block[V_INDEX, :, :used])
    k = torch.cat(k_chunks, dim=1).unsqueeze(0)  # [1, n_kv_heads, n_tokens, head_dim]
    v = torch.cat(v_chunks, dim=1).unsqueeze(0)
    return k, v
