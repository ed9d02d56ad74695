"""Batched gather in plain PyTorch: the CPU path and the oracle for the Triton kernel.

Where phase 3.3's `gather_python` loops over one sequence's blocks, this
gathers every block of every sequence with one indexing op, as the kernel does:

    blocks[b, j] = kv_store[block_tables[b, j], layer]       [2, n_kv_heads, block_size, head_dim]
    k[b, h, j * block_size + o] = blocks[b, j][0, h, o]        (v from index 1)

Whole blocks move block_size * head_dim contiguous elements at a time.
"""

from __future__ import annotations

import torch

from phases.p3_1_block_allocator.allocator import blocks_for
from phases.p3_4_gather_kernel.checks import check_paged_inputs

K_INDEX, V_INDEX = 0, 1


def max_length(seq_lens: torch.Tensor, max_len: int | None) -> int:
    """The padded length of the output. Reading it from `seq_lens` syncs a GPU; pass it if known."""
    if max_len is not None:
        return int(max_len)
    return int(seq_lens.max()) if seq_lens.numel() else 0


def gather_reference(kv_store: torch.Tensor, layer_idx: int, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, max_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a batch, each [B, n_kv_heads, max_len, head_dim] (views, maybe not contiguous), zero past each length.

    kv_store     [n_blocks, n_layers, 2, n_kv_heads, block_size, head_dim]
    block_tables [B, max_blocks] int, physical block ids in logical order (padding never read)
    seq_lens     [B] int, tokens of each sequence in the pool
    """
    check_paged_inputs(kv_store, layer_idx, block_tables, seq_lens)
    batch = block_tables.shape[0]
    _, _, _, n_kv_heads, block_size, head_dim = kv_store.shape
    max_len = max_length(seq_lens, max_len)
    n_logical = blocks_for(max_len, block_size)                              # blocks covering max_len
    if n_logical > block_tables.shape[1]:
        raise ValueError(f"max_len {max_len} needs {n_logical} blocks but block_tables has {block_tables.shape[1]}")
    lens = seq_lens.to(kv_store.device)[:, None]                              # [B, 1]

    # Table entries past a sequence's end are padding: read block 0 there instead (zeroed below).
    starts = torch.arange(n_logical, device=kv_store.device) * block_size      # [n_logical]
    ids = torch.where(starts[None, :] < lens, block_tables[:, :n_logical].long(), 0)  # [B, n_logical]
    # Index the pool with the block ids in the middle of a [2, n_kv_heads, n_blocks, ...] view, so the
    # one copy the indexing makes already has the output's layout: [2, n_kv_heads, B, n_logical, block_size, head_dim].
    layer = kv_store[:, layer_idx].permute(1, 2, 0, 3, 4)                 # [2, n_kv_heads, n_blocks, block_size, head_dim]
    kv = layer[:, :, ids].view(2, n_kv_heads, batch, n_logical * block_size, head_dim)
    kv = kv.transpose(1, 2)                                                  # [2, B, n_kv_heads, n_logical * block_size, head_dim]
    # `kv` is a fresh copy (advanced indexing copies), so zero each sequence's tail in
    # place. Slicing touches only the tails; a length mask would rewrite every element.
    for b, n in enumerate(lens[:, 0].tolist()):
        kv[:, b, :, n:] = 0
    kv = kv[:, :, :, :max_len]                                                # may be a view past max_len
    return kv[K_INDEX], kv[V_INDEX]
