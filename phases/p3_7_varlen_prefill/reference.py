"""PyTorch versions of varlen paged prefill attention: the oracle, a second oracle, and the CPU path.

All three share one contract (see ops.py for the argument shapes): query i of
segment s sits at absolute position p = context_lens[s] + i and attends the
keys its layer lets it see, all of them that sequence's tokens in the pool:

    visible(p, k) = k <= p                  causal, never across segments
                    and k > p - w           only with a sliding window w (w keys, itself included)
    scores = q . K^T * scale                then c * tanh(scores / c) with a softcap c (Gemma 2)

- `paged_prefill_attention_reference`: gather each segment's K/V with phase
  3.4's `gather_reference`, then attention written out in fp32. The oracle.
- `sdpa_prefill_contiguous`: what a non-paged engine does: SDPA per segment
  over K/V already stored contiguously. The second oracle (it has no softcap:
  SDPA offers none).
- `paged_prefill_attention_cpu`: the reference's answer, shaped for a CPU:
  one indexing copy of every block the pack reads, then one SDPA per segment
  in q's dtype (GQA inside SDPA, no repeated K/V); `is_causal` where no mask
  is needed, so a fresh prompt takes SDPA's causal kernel as phase 3.6's loop did.

The mask and the cap are phase 3.5's (`visible_keys`, `soft_cap`): its decode
kernel and phase 3.6's per-segment prefill loop use the same two.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from phases.p3_1_block_allocator.allocator import blocks_for
from phases.p3_4_gather_kernel.reference import K_INDEX, V_INDEX, gather_reference
from phases.p3_5_paged_attention.reference import soft_cap, visible_keys  # noqa: F401  (re-exported)
from phases.p3_7_varlen_prefill.checks import check_block_ids, check_prefill_inputs, check_window_and_softcap
from phases.p3_7_varlen_prefill.plan import PrefillPlan, plan_prefill


def _segment_positions(plan: PrefillPlan, s: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """[T] absolute positions of segment s's queries, [total] of its keys."""
    context, total = plan.context_lens[s], plan.total_lens[s]
    return torch.arange(context, total, device=device), torch.arange(total, device=device)


def paged_prefill_attention_reference(q: torch.Tensor, kv_store: torch.Tensor, layer_idx: int,
                                      block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                      context_lens: torch.Tensor, scale: float | None = None,
                                      sliding_window: int | None = None, softcap: float | None = None,
                                      plan: PrefillPlan | None = None) -> torch.Tensor:
    """The oracle: q [N, n_heads, head_dim] -> [N, n_heads, head_dim] in q's dtype, computed in fp32."""
    if plan is None:
        plan = plan_prefill(cu_seqlens_q, context_lens, device=q.device)
    check_prefill_inputs(q, kv_store, layer_idx, block_tables, cu_seqlens_q, context_lens, plan,
                         sliding_window, softcap)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    group = q.shape[1] // kv_store.shape[3]
    out = q.new_empty(q.shape)                                         # [N, H, D], contiguous
    for s, (start, length, total) in enumerate(zip(plan.seg_starts, plan.seg_lens, plan.total_lens)):
        if length == 0:
            continue
        lens = torch.tensor([total], dtype=torch.int32, device=q.device)
        k, v = gather_reference(kv_store, layer_idx, block_tables[s:s + 1], lens, max_len=total)  # [1, H_kv, L, D]
        # GQA: query head h reads KV head h // group, so repeat each KV head `group` times.
        k = k[0].float().repeat_interleave(group, dim=0)                        # [H, L, D]
        v = v[0].float().repeat_interleave(group, dim=0)
        qs = q[start:start + length].float().transpose(0, 1)                   # [H, T, D]
        scores = soft_cap(qs @ k.transpose(1, 2) * scale, softcap)             # [H, T, L]
        visible = visible_keys(*_segment_positions(plan, s, q.device), sliding_window)
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)    # each query sees itself: no NaN
        out[start:start + length] = (probs @ v).transpose(0, 1).to(q.dtype)   # [T, H, D]
    return out


def sdpa_prefill_contiguous(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            context_lens: torch.Tensor, scale: float | None = None,
                            sliding_window: int | None = None) -> torch.Tensor:
    """The second oracle: SDPA per segment over contiguous K/V, in q's dtype.

    q     [N, n_heads, head_dim]          packed queries, segment s = rows cu[s] .. cu[s+1] - 1
    k, v  [S, n_kv_heads, max_len, head_dim]   row s holds sequence s's keys at positions
                                          0 .. context_lens[s] + length_s - 1 (padding after is ignored)
    Returns [N, n_heads, head_dim].
    """
    check_window_and_softcap(sliding_window, None)
    plan = plan_prefill(cu_seqlens_q, context_lens, device=q.device)
    if k.dim() != 4 or k.shape != v.shape or k.shape[0] != plan.n_segments:
        raise ValueError(f"k and v must both be [S={plan.n_segments}, n_kv_heads, max_len, head_dim], "
                         f"got {tuple(k.shape)} and {tuple(v.shape)}")
    out = q.new_empty(q.shape)                                         # [N, H, D], contiguous
    for s, (start, length, total) in enumerate(zip(plan.seg_starts, plan.seg_lens, plan.total_lens)):
        if length == 0:
            continue
        qs = q[start:start + length].transpose(0, 1)[None]                     # [1, H, T, D]
        ks, vs = k[s:s + 1, :, :total].to(q.dtype), v[s:s + 1, :, :total].to(q.dtype)   # [1, H_kv, L, D]
        visible = visible_keys(*_segment_positions(plan, s, q.device), sliding_window)   # [T, L]
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=visible[None, None], scale=scale,
                                           enable_gqa=qs.shape[1] != ks.shape[1])
        out[start:start + length] = o[0].transpose(0, 1)
    return out


def _attend_fp32_softcapped(qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                            scale: float, softcap: float) -> torch.Tensor:
    """Softcapped attention, which SDPA cannot do, as grouped matmuls in fp32.

    qs [H, T, D]; k, v [H_kv, L, D]; visible [T, L] -> [H, T, D] fp32.
    Query heads of one KV head are consecutive (h = kv_head * group + g), so viewing
    qs as [H_kv, group * T, D] makes GQA one batched matmul per KV head, no repeated K/V."""
    n_heads, length, head_dim = qs.shape
    n_kv_heads, group = k.shape[0], n_heads // k.shape[0]
    qg = qs.float().reshape(n_kv_heads, group * length, head_dim)
    scores = soft_cap(qg @ k.float().transpose(1, 2) * scale, softcap)        # [H_kv, G * T, L]
    scores = scores.view(n_kv_heads, group, length, -1).masked_fill(~visible, float("-inf"))
    probs = scores.softmax(dim=-1).view(n_kv_heads, group * length, -1)
    return (probs @ v.float()).view(n_heads, length, head_dim)


def _blocks_read(plan: PrefillPlan, block_tables: torch.Tensor, block_size: int,
                 from_pool: list[bool]) -> tuple[torch.Tensor, list[int]]:
    """The block ids to read, for the segments marked in from_pool, segment after segment, each in logical
    order: [n_read] int64; and where each segment's run starts in that list. Table entries past a
    segment's length are padding, never taken. Positions are worked out on the host (the plan's
    lengths), then one indexing op takes them all."""
    n_blocks = [blocks_for(total, block_size) if read else 0 for total, read in zip(plan.total_lens, from_pool)]
    first = [sum(n_blocks[:s]) for s in range(len(n_blocks))]
    row = block_tables.shape[1]
    flat = torch.tensor([s * row + j for s, n in enumerate(n_blocks) for j in range(n)], dtype=torch.int64,
                        device=block_tables.device)
    return block_tables.reshape(-1)[flat].long(), first


def paged_prefill_attention_cpu(q: torch.Tensor, kv_store: torch.Tensor, layer_idx: int,
                                block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                                scale: float | None = None, sliding_window: int | None = None,
                                softcap: float | None = None, plan: PrefillPlan | None = None,
                                new_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The reference's contract, computed the fast way for a CPU (the CPU path of ops.py).

    One indexing copy takes every block the pack reads out of the pool (K and V,
    already in [2, H_kv, tokens, D] layout); each segment's K/V is then a slice of
    it, and each segment runs one SDPA in q's dtype with GQA done inside SDPA.
    A segment with nothing before it and no binding window uses `is_causal`
    (SDPA's causal kernel, no mask tensor). Otherwise its queries start at position
    context_len, which `is_causal` cannot express (it aligns the diagonal top-left),
    so an explicit [T, L] mask goes in. Softcapping runs as grouped fp32 matmuls
    instead (SDPA has no softcap).

    new_kv: optionally (k, v), each [N, n_kv_heads, head_dim], the packed new tokens'
    K/V that were just written to the pool. A segment with no context then reads
    them instead of copying the same values back out of the pool, which is what
    phase 3.6's loop did for a fresh prompt: on a CPU that copy is a few percent of
    a long segment's attention and ~20% of a 40-token one's. The values are the same,
    so the answer is too (tested); the kernel always reads the pool, in place, for free.

    Measured on one thread at SmolLM2's shapes (9 query heads over 3 KV heads, head_dim 64):
    copying K/V per segment cost ~45 us per segment per layer, indexing a permuted view of the
    pool (as phase 3.4's gather_reference does) ~4x the index_select below, writing each
    segment's output into a preallocated tensor ~20 us per segment over one final cat.
    """
    if plan is None:
        plan = plan_prefill(cu_seqlens_q, context_lens, device=q.device)
    check_prefill_inputs(q, kv_store, layer_idx, block_tables, cu_seqlens_q, context_lens, plan,
                         sliding_window, softcap, table_values=False, new_kv=new_kv)  # ids read: checked below
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    n_kv_heads, block_size, head_dim = kv_store.shape[3], kv_store.shape[4], kv_store.shape[5]
    if plan.n_tokens == 0:
        return q.new_empty(q.shape)
    from_pool = [new_kv is None or context > 0 for context in plan.context_lens]
    ids, first_block = _blocks_read(plan, block_tables, block_size, from_pool)
    check_block_ids(kv_store, ids)
    # index_select copies whole blocks (2 * H_kv * block_size * D contiguous elements each);
    # one more copy (the reshape) puts K and V in SDPA's layout.
    blocks = kv_store[:, layer_idx].index_select(0, ids)               # [n_read, 2, H_kv, block_size, D]
    kv = blocks.permute(1, 2, 0, 3, 4).reshape(2, n_kv_heads, ids.numel() * block_size, head_dim).to(q.dtype)
    k_pool, v_pool = kv[K_INDEX, None], kv[V_INDEX, None]              # [1, H_kv, n_read * block_size, D]
    # Head-major views, made once: each segment below is one slice along the token axis (dim 2).
    q_heads = q.transpose(0, 1)[None]                                  # [1, H, N, D]
    if new_kv is not None:
        k_new, v_new = (t.transpose(0, 1)[None].to(q.dtype) for t in new_kv)   # [1, H_kv, N, D]
    gqa = q.shape[1] != n_kv_heads
    outs = []                                                          # [T_s, H, D] per segment, in order
    for s, (start, length, context, total) in enumerate(zip(plan.seg_starts, plan.seg_lens, plan.context_lens,
                                                             plan.total_lens)):
        if length == 0:
            continue
        if from_pool[s]:
            first = first_block[s] * block_size
            k, v = k_pool[:, :, first:first + total], v_pool[:, :, first:first + total]  # [1, H_kv, L, D]
        else:                                                                           # L = T: the new tokens
            k, v = k_new[:, :, start:start + length], v_new[:, :, start:start + length]
        qs = q_heads[:, :, start:start + length]                       # [1, H, T, D]
        if softcap is not None:
            visible = visible_keys(*_segment_positions(plan, s, q.device), sliding_window)
            o = _attend_fp32_softcapped(qs[0], k[0], v[0], visible, scale, softcap).to(q.dtype)[None]
        elif context == 0 and (sliding_window is None or total <= sliding_window):
            o = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            visible = visible_keys(*_segment_positions(plan, s, q.device), sliding_window)
            o = F.scaled_dot_product_attention(qs, k, v, attn_mask=visible[None, None], scale=scale, enable_gqa=gqa)
        outs.append(o[0].transpose(0, 1))                               # [T, H, D]
    return torch.cat(outs)                                             # one copy for the whole pack
