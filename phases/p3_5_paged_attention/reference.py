"""PyTorch references for phase 3.5's kernels: the CPU path and the test oracles.

- `paged_decode_attention_reference`: gather the batch's K/V with phase 3.4's
  `gather_reference`, then plain masked attention in fp32.
- `sdpa_decode_contiguous`: the second oracle, and what a non-paged engine
  does: SDPA over K/V already stored contiguously (padded), with a length mask.
- `paged_decode_attention_gather_sdpa`: gather, then SDPA. The same answer as
  the first, without fp32 copies of K/V or repeat_interleave.
- `paged_decode_attention_gather_bmm`: the same answer again, shaped for a CPU
  (gather per KV head with index_select, grouped batched matmuls); the CPU
  path of `ops.paged_decode_attention`.
- `write_kv_reference`: store new K/V into the pool by slot with one index_put.

What a layer may ask besides causality, honoured by every path that can express it:
- a sliding window w (Mistral, Gemma 2/3's local layers): a query at position p
  sees keys p - w + 1 .. p (`visible_keys`; transformers' own definition);
- a logit softcap c (Gemma 2): scores become c * tanh(scores / c) after the scale
  (`soft_cap`). SDPA has no softcap, so the SDPA oracles take a window only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from phases.p3_4_gather_kernel.reference import K_INDEX, V_INDEX, gather_reference, max_length
from phases.p3_5_paged_attention.kernel_checks import (check_decode_inputs, check_window_and_softcap,
                                                       check_write_inputs)
from phases.p3_5_paged_attention.plans import DecodePlan, WritePlan, plan_decode, plan_write


def visible_keys(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None = None) -> torch.Tensor:
    """q_pos [T], k_pos [L] absolute positions -> [T, L] bool: which keys each query attends.

    Causal, plus transformers' sliding window: a query at p sees keys p - w + 1 .. p
    (masking_utils.sliding_window_overlay: kv_idx > q_idx - sliding_window)."""
    visible = k_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        visible &= k_pos[None, :] > q_pos[:, None] - sliding_window
    return visible


def soft_cap(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Gemma 2's attention logit softcapping: c * tanh(scores / c), applied after the scale."""
    return scores if softcap is None else softcap * torch.tanh(scores / softcap)


def decode_visible(seq_lens: torch.Tensor, length: int, sliding_window: int | None = None) -> torch.Tensor:
    """[B, length] bool: the keys the one new query of each sequence sees. It sits at position
    seq_lens[b] - 1, so that is every slot before seq_lens[b], and with a window only the last w of them.
    A sequence of length 0 sees nothing."""
    return visible_keys(seq_lens.to(torch.int64) - 1, torch.arange(length, device=seq_lens.device), sliding_window)


def paged_decode_attention_reference(q: torch.Tensor, kv_store: torch.Tensor, layer_idx: int,
                                     block_tables: torch.Tensor, seq_lens: torch.Tensor,
                                     scale: float | None = None, max_len: int | None = None,
                                     sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """q [B, n_heads, head_dim] -> [B, n_heads, head_dim] (q's dtype); a sequence of length 0 gets zeros."""
    check_decode_inputs(q, kv_store, layer_idx, block_tables, seq_lens)
    check_window_and_softcap(sliding_window, softcap)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    group = q.shape[1] // kv_store.shape[3]
    max_len = max_length(seq_lens, max_len)
    k, v = gather_reference(kv_store, layer_idx, block_tables, seq_lens, max_len)  # [B, H_kv, L, D]
    # GQA: query head h reads KV head h // group, so repeat each KV head `group` times.
    k = k.float().repeat_interleave(group, dim=1)                                    # [B, H, L, D]
    v = v.float().repeat_interleave(group, dim=1)
    scores = soft_cap(torch.einsum("bhd,bhld->bhl", q.float(), k) * scale, softcap)  # [B, H, L]
    valid = decode_visible(seq_lens.to(q.device), max_len, sliding_window)          # [B, L]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)  # a fully masked row (length 0) softmaxes to NaN
    out = torch.einsum("bhl,bhld->bhd", probs, v)
    return out.to(q.dtype)


def sdpa_decode_contiguous(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float | None = None, sliding_window: int | None = None) -> torch.Tensor:
    """SDPA for one query token per sequence over contiguous, padded K/V.

    q [B, n_heads, head_dim]; k, v [B, n_kv_heads, max_len, head_dim]; positions at or
    past seq_lens[b] are masked out (and, with a window w, those before seq_lens[b] - w).
    Runs in the inputs' dtype, as a model would.
    Returns [B, n_heads, head_dim]; a sequence of length 0 gets zeros.
    """
    batch, n_heads, _ = q.shape
    n_kv_heads, max_len = k.shape[1], k.shape[2]
    if n_heads % n_kv_heads:
        raise ValueError(f"n_heads {n_heads} must be a multiple of n_kv_heads {n_kv_heads}")
    check_window_and_softcap(sliding_window, None)
    mask = decode_visible(seq_lens.to(q.device), max_len, sliding_window)                     # [B, L]
    out = F.scaled_dot_product_attention(q[:, :, None, :], k.to(q.dtype), v.to(q.dtype),
                                         attn_mask=mask[:, None, None, :], scale=scale,
                                         enable_gqa=n_heads != n_kv_heads)              # [B, H, 1, D]
    # SDPA turns a fully masked row into NaN; give it zeros, like the other paths.
    return out[:, :, 0].masked_fill((seq_lens == 0).to(q.device)[:, None, None], 0)


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
    (plans.py); without one it is made here. A sliding window narrows the plan's
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
    `plan`: the (block, offset) of each slot, made once per forward pass (plans.py)."""
    check_write_inputs(kv_store, layer_idx, k, v, slot_mapping, values=False)  # the plan checks values
    if plan is None:
        plan = plan_write(kv_store, slot_mapping)
    if plan.rows is not None:
        k, v = k[plan.rows], v[plan.rows]                                        # drop padding tokens
    # Advanced indices (blocks, offsets) split by a slice: the indexed view is [T', n_kv_heads, head_dim].
    kv_store[plan.blocks, layer_idx, K_INDEX, :, plan.offsets] = k.to(kv_store.dtype)
    kv_store[plan.blocks, layer_idx, V_INDEX, :, plan.offsets] = v.to(kv_store.dtype)
