"""Paged inputs like a busy engine's, for the kernel tests and benches (phases 3.4-3.9).

In a running engine, sequences claim and free blocks in no particular order,
so one sequence's blocks end up scattered over the pool. Both builders draw
the physical ids from a shuffled pool and fill it with random K/V.

- `random_paged_batch`: decode-shaped, a pool and each sequence's block table.
- `random_prefill_pack`: a packed prefill. Each sequence has `context_len`
  tokens already in the pool and `seg_len` new ones whose K/V were just
  written. Every slot that is not one of a sequence's tokens holds `fill`
  (NaN by default): an attention that reads a slot it should not comes out
  NaN. The same K/V are also returned contiguous, for the SDPA oracle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from phases.p3_1_block_allocator.allocator import blocks_for

K_INDEX, V_INDEX = 0, 1   # the pool's dim 2: keys, values


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


@dataclass
class PrefillPack:
    q: torch.Tensor              # [N, n_heads, head_dim] the new tokens of every segment, packed
    kv_store: torch.Tensor       # [n_blocks, n_layers, 2, n_kv_heads, block_size, head_dim]
    layer_idx: int               # the layer whose K/V below are the sequences'
    block_tables: torch.Tensor   # [S, max_blocks] int32; padding entries point at a `fill` block
    cu_seqlens_q: torch.Tensor   # [S + 1] int32
    context_lens: torch.Tensor   # [S] int32
    k: torch.Tensor              # [S, n_kv_heads, max_total, head_dim] each sequence's keys, contiguous (0-padded)
    v: torch.Tensor              # [S, n_kv_heads, max_total, head_dim]
    new_k: torch.Tensor          # [N, n_kv_heads, head_dim] the new tokens' keys, packed like q
    new_v: torch.Tensor          # [N, n_kv_heads, head_dim]

    def args(self) -> tuple:
        """(q, kv_store, layer_idx, block_tables, cu_seqlens_q, context_lens): the attention's first arguments."""
        return self.q, self.kv_store, self.layer_idx, self.block_tables, self.cu_seqlens_q, self.context_lens

    def slot(self, segment: int, position: int) -> tuple[int, int]:
        """(physical block, offset) holding token `position` of sequence `segment`."""
        block_size = self.kv_store.shape[4]
        return int(self.block_tables[segment, position // block_size]), position % block_size


def random_prefill_pack(seg_lens: list[int], context_lens: list[int], block_size: int, n_kv_heads: int,
                        group: int, head_dim: int, dtype: torch.dtype = torch.float32, device: str = "cpu",
                        n_layers: int = 2, layer_idx: int = 1, spare_blocks: int = 2, fill: float = float("nan"),
                        seed: int = 0) -> PrefillPack:
    """S = len(seg_lens) sequences, sequence s with context_lens[s] cached + seg_lens[s] new tokens."""
    if len(seg_lens) != len(context_lens):
        raise ValueError(f"seg_lens ({len(seg_lens)}) and context_lens ({len(context_lens)}) must pair up")
    if spare_blocks < 1:
        raise ValueError("spare_blocks must be >= 1: padded table entries point at a spare block")
    gen = torch.Generator().manual_seed(seed)
    totals = [c + n for c, n in zip(context_lens, seg_lens)]
    per_seq = [blocks_for(t, block_size) for t in totals]
    n_blocks = sum(per_seq) + spare_blocks
    max_total, max_blocks = max(totals, default=0), max(per_seq, default=0) or 1

    # K/V of every sequence in every layer, contiguous: [n_layers, S, n_kv_heads, max_total, head_dim].
    k_all = torch.randn(n_layers, len(totals), n_kv_heads, max_total, head_dim, generator=gen).to(dtype)
    v_all = torch.randn(n_layers, len(totals), n_kv_heads, max_total, head_dim, generator=gen).to(dtype)
    pool = torch.full((n_blocks, n_layers, 2, n_kv_heads, block_size, head_dim), fill, dtype=dtype)
    order = torch.randperm(n_blocks, generator=gen).tolist()       # scattered physical ids
    spare = order[sum(per_seq)]
    tables = torch.full((len(totals), max_blocks), spare, dtype=torch.int32)
    used = 0
    for s, (total, n) in enumerate(zip(totals, per_seq)):
        ids = order[used:used + n]
        used += n
        tables[s, :n] = torch.tensor(ids, dtype=torch.int32)
        for j, phys in enumerate(ids):
            tokens = slice(j * block_size, min((j + 1) * block_size, total))
            width = tokens.stop - tokens.start
            pool[phys, :, K_INDEX, :, :width] = k_all[:, s, :, tokens]
            pool[phys, :, V_INDEX, :, :width] = v_all[:, s, :, tokens]
        k_all[:, s, :, total:] = 0
        v_all[:, s, :, total:] = 0

    n_tokens = sum(seg_lens)
    q = torch.randn(n_tokens, n_kv_heads * group, head_dim, generator=gen).to(dtype)
    k, v = k_all[layer_idx], v_all[layer_idx]
    # The new tokens' K/V in packed order: sequence s's positions context .. total - 1.
    new_k = torch.cat([k[s, :, c:t].transpose(0, 1) for s, (c, t) in enumerate(zip(context_lens, totals))]) \
        if n_tokens else k.new_empty(0, n_kv_heads, head_dim)
    new_v = torch.cat([v[s, :, c:t].transpose(0, 1) for s, (c, t) in enumerate(zip(context_lens, totals))]) \
        if n_tokens else v.new_empty(0, n_kv_heads, head_dim)
    cu = torch.tensor([0] + torch.tensor(seg_lens, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32)
    return PrefillPack(q.to(device), pool.to(device), layer_idx, tables.to(device), cu.to(device),
                       torch.tensor(context_lens, dtype=torch.int32).to(device), k.to(device), v.to(device),
                       new_k.to(device), new_v.to(device))
