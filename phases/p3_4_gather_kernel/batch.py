"""Build a pool and block tables like a busy engine's, for the kernel tests and benchmarks.

In a running engine, sequences claim and free blocks in no particular order,
so one sequence's blocks end up scattered over the pool. This draws the
physical ids from a shuffled pool, and fills the pool with random K/V.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from phases.p3_1_block_allocator.allocator import blocks_for


@dataclass
class PagedBatch:
    kv_store: torch.Tensor       # [n_blocks, n_layers, 2, n_kv_heads, block_size, head_dim]
    block_tables: torch.Tensor   # [B, max_blocks] int32, padded with 0
    seq_lens: torch.Tensor       # [B] int32
    block_ids: list[list[int]]   # each sequence's table as a plain list (for the Python gather)

    @property
    def block_size(self) -> int:
        return self.kv_store.shape[4]


def random_paged_batch(seq_lens: list[int], block_size: int, n_kv_heads: int, head_dim: int,
                       n_layers: int = 2, dtype: torch.dtype = torch.float32, device: str = "cpu",
                       spare_blocks: int = 3, seed: int = 0) -> PagedBatch:
    """A pool holding the given sequences in shuffled blocks (plus `spare_blocks` unused ones)."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [blocks_for(n, block_size) for n in seq_lens]
    n_blocks = sum(per_seq) + spare_blocks
    shape = (n_blocks, n_layers, 2, n_kv_heads, block_size, head_dim)
    kv_store = torch.randn(shape, generator=gen).to(dtype=dtype, device=device)
    order = torch.randperm(n_blocks, generator=gen).tolist()   # scattered physical ids
    max_blocks = max(per_seq, default=0) or 1
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    block_ids: list[list[int]] = []
    start = 0
    for b, n in enumerate(per_seq):
        ids = order[start:start + n]
        start += n
        tables[b, :n] = torch.tensor(ids, dtype=torch.int32)
        block_ids.append(ids)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return PagedBatch(kv_store, tables.to(device), lens.to(device), block_ids)
