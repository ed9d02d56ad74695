"""Phase 3.5's CPU paths: the references' answers computed fast on a CPU (speed only, off the reading path).

`ops.py` runs these on CPU tensors (Triton has no CPU backend); the tests hold
them equal to `reference.py`'s oracles. A forward pass runs the same paged
operations in every layer over the same block tables, lengths and slots; only
the layer index changes. So whatever depends on those alone is a plan, made
once per pass (`plan_write`, `plan_decode`, which also check the inputs'
values) and handed to each layer:

- `WritePlan`: where each new token's K/V goes, as (block, offset) pairs,
  and which tokens store nothing (padding slots);
- `DecodePlan`: which block every (sequence, logical block) reads, and which
  of the gathered slots hold a real token.

The Triton kernels do this arithmetic inside each program, so on a GPU no plan
is made. The measurements that shaped these: docs/measurements/p3_5_paged_attention.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from phases.p3_1_block_allocator.allocator import blocks_for
from phases.p3_4_gather_kernel.checks import check_tables
from phases.p3_4_gather_kernel.reference import K_INDEX, V_INDEX, gather_reference, max_length
from phases.p3_5_paged_attention.kernel_checks import (PADDING_SLOT, check_decode_inputs, check_window_and_softcap,
                                                       check_write_inputs)
from extras.p3_5_paged_attention.contiguous import sdpa_decode_contiguous
from phases.p3_5_paged_attention.reference import decode_visible, soft_cap


@dataclass(frozen=True)
class WritePlan:
    rows: torch.Tensor | None   # [T'] int64: tokens that store something; None when every token does
    blocks: torch.Tensor        # [T'] int64: the block each stored token goes to
    offsets: torch.Tensor       # [T'] int64: its slot inside that block


@dataclass(frozen=True)
class DecodePlan:
    ids: torch.Tensor           # [B * n_logical] int64: block read per (sequence, logical block); 0 past the end
    valid: torch.Tensor         # [B, n_logical * block_size] bool: slot holds one of the sequence's tokens
    n_logical: int              # blocks covering the longest sequence


def plan_write(kv_store: torch.Tensor, slot_mapping: torch.Tensor) -> WritePlan:
    """slot_mapping [T] (block_id * block_size + offset, or -1 for padding) -> where each token goes."""
    n_blocks, block_size = kv_store.shape[0], kv_store.shape[4]
    if slot_mapping.numel() and kv_store.device.type == "cpu":
        lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
        if lo < PADDING_SLOT or hi >= n_blocks * block_size:
            raise ValueError(f"slot_mapping must lie in [0, {n_blocks * block_size}) (or be {PADDING_SLOT} "
                             f"for padding), got values in [{lo}, {hi}]")
    keep = slot_mapping != PADDING_SLOT
    rows = None if bool(keep.all()) else keep.nonzero()[:, 0]
    slots = (slot_mapping if rows is None else slot_mapping[rows]).long()
    return WritePlan(rows, slots // block_size, slots % block_size)


def plan_decode(kv_store: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                max_len: int | None = None) -> DecodePlan:
    """block_tables [B, max_blocks], seq_lens [B] -> the blocks to gather and the mask, for every layer."""
    check_tables(kv_store, block_tables, seq_lens)
    block_size, device = kv_store.shape[4], kv_store.device
    n_logical = blocks_for(max_length(seq_lens, max_len), block_size)
    lens = seq_lens.to(device)[:, None]                                               # [B, 1]
    starts = torch.arange(n_logical, device=device) * block_size                      # [n_logical]
    # Table entries past a sequence's end are padding: read block 0 there (masked by `valid`).
    ids = torch.where(starts[None, :] < lens, block_tables[:, :n_logical].long(), 0).reshape(-1)
    valid = torch.arange(n_logical * block_size, device=device)[None, :] < lens       # [B, L]
    return DecodePlan(ids, valid, n_logical)


def paged_decode_attention_gather_sdpa(q: torch.Tensor, kv_store: torch.Tensor, layer_idx: int,
                                       block_tables: torch.Tensor, seq_lens: torch.Tensor,
                                       scale: float | None = None, max_len: int | None = None,
                                       sliding_window: int | None = None) -> torch.Tensor:
    """`paged_decode_attention_reference`'s contract, computed as gather + SDPA (no softcap: SDPA has none)."""
    check_decode_inputs(q, kv_store, layer_idx, block_tables, seq_lens)
    k, v = gather_reference(kv_store, layer_idx, block_tables, seq_lens, max_len)  # [B, H_kv, L, D]
    return sdpa_decode_contiguous(q, k, v, seq_lens, scale, sliding_window)


def paged_decode_attention_gather_bmm(q: torch.Tensor, kv_store: torch.Tensor, layer_idx: int,
                                      block_tables: torch.Tensor, seq_lens: torch.Tensor,
                                      scale: float | None = None, max_len: int | None = None,
                                      plan: DecodePlan | None = None, sliding_window: int | None = None,
                                      softcap: float | None = None) -> torch.Tensor:
    """The reference's contract, computed the fast way for a CPU: gather per KV head, then batched matmuls.

    Two things cost time on a CPU at decode, and this avoids both (the
    phase's README has the measurements):
    - SDPA with a length mask and one query row per sequence is mostly per-row
      overhead, many times the cost of the two matmuls here. Viewing
      the query heads as [n_kv_heads, B, group, D] makes GQA a plain batched
      matmul against each KV head, with no repeated K/V.
    - the gather itself: advanced indexing into a permuted view of the pool
      copies element by element. `index_select` along the
      block axis copies whole [block_size, head_dim] rows, and doing it once per
      KV head writes the [n_kv_heads, B, L, D] layout the matmuls want directly,
      so no second, permuting copy is needed.
    Slots past a sequence's length are read but never weighted: the mask gives
    them probability exactly 0, and the pool holds only finite values (it
    starts zeroed), so 0 x stale value = 0 and no tail needs zeroing.
    `plan`: the blocks to read and the mask, made once per forward pass
    (`plan_decode` above); without one it is made here. A sliding window narrows the plan's
    mask in this layer only (Gemma 2 alternates windowed and full layers); a
    softcap bends the fp32 scores before the mask.
    """
    check_decode_inputs(q, kv_store, layer_idx, block_tables, seq_lens, values=False)  # the plan checks values
    check_window_and_softcap(sliding_window, softcap)
    if plan is None:
        plan = plan_decode(kv_store, block_tables, seq_lens, max_len)
    batch, n_heads, head_dim = q.shape
    n_kv_heads, block_size = kv_store.shape[3], kv_store.shape[4]
    if plan.valid.shape != (batch, plan.n_logical * block_size) or plan.n_logical > block_tables.shape[1]:
        raise ValueError(f"plan was made for other tables: it covers {tuple(plan.valid.shape)} slots, "
                         f"this batch has {batch} sequences and tables of {block_tables.shape[1]} blocks")
    scale = head_dim ** -0.5 if scale is None else scale
    if plan.n_logical == 0:
        return torch.zeros_like(q)
    length = plan.n_logical * block_size
    k = kv_store.new_empty(n_kv_heads, batch * plan.n_logical, block_size, head_dim)
    v = torch.empty_like(k)
    for h in range(n_kv_heads):
        torch.index_select(kv_store[:, layer_idx, K_INDEX, h], 0, plan.ids, out=k[h])  # [B * n_logical, bs, D]
        torch.index_select(kv_store[:, layer_idx, V_INDEX, h], 0, plan.ids, out=v[h])
    k = k.view(n_kv_heads, batch, length, head_dim).to(q.dtype)                  # [H_kv, B, L, D]
    v = v.view(n_kv_heads, batch, length, head_dim).to(q.dtype)
    qg = q.reshape(batch, n_kv_heads, n_heads // n_kv_heads, head_dim).transpose(0, 1)  # [H_kv, B, G, D]
    scores = soft_cap((qg @ k.transpose(-1, -2)).float() * scale, softcap)       # [H_kv, B, G, L] fp32
    valid = plan.valid                                                           # [B, L]
    if sliding_window is not None:
        valid = valid & decode_visible(seq_lens.to(valid.device), length, sliding_window)
    scores = scores.masked_fill(~valid[None, :, None, :], float("-inf"))
    probs = scores.softmax(-1).nan_to_num(0.0).to(q.dtype)                      # length 0 -> zeros
    return (probs @ v).transpose(0, 1).reshape(batch, n_heads, head_dim)        # [B, H, D]


def write_kv_reference(kv_store: torch.Tensor, layer_idx: int, k: torch.Tensor, v: torch.Tensor,
                       slot_mapping: torch.Tensor, plan: WritePlan | None = None) -> None:
    """Store k, v [T, n_kv_heads, head_dim] into the pool at `slot_mapping` [T] (-1 = skip), in place.
    `plan`: the (block, offset) of each slot, made once per forward pass (`plan_decode` above)."""
    check_write_inputs(kv_store, layer_idx, k, v, slot_mapping, values=False)  # the plan checks values
    if plan is None:
        plan = plan_write(kv_store, slot_mapping)
    if plan.rows is not None:
        k, v = k[plan.rows], v[plan.rows]                                        # drop padding tokens
    # Advanced indices (blocks, offsets) split by a slice: the indexed view is [T', n_kv_heads, head_dim].
    kv_store[plan.blocks, layer_idx, K_INDEX, :, plan.offsets] = k.to(kv_store.dtype)
    kv_store[plan.blocks, layer_idx, V_INDEX, :, plan.offsets] = v.to(kv_store.dtype)
