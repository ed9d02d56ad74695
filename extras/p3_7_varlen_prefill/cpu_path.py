"""Phase 3.7's CPU path: the oracle's answer, computed fast on a CPU (speed only, off the reading path).

`ops.paged_prefill_attention` runs this on CPU tensors (Triton has no CPU
backend). It returns what `reference.paged_prefill_attention_reference`
returns, tested equal; what it adds is only how: one indexing copy of every
block the pack reads, then one SDPA per segment in q's dtype (GQA inside SDPA,
no repeated K/V), and `is_causal` where no mask is needed. The measurements
that shaped it: docs/measurements/p3_7_varlen_prefill.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from phases.p3_1_block_allocator.allocator import blocks_for
from phases.p3_4_gather_kernel.reference import K_INDEX, V_INDEX
from phases.p3_5_paged_attention.kernel_checks import FLOAT_DTYPES
from phases.p3_7_varlen_prefill.checks import check_prefill_inputs
from phases.p3_7_varlen_prefill.plan import PrefillPlan, plan_prefill
from phases.p3_7_varlen_prefill.reference import segment_positions, soft_cap, visible_keys


def check_block_ids(kv_store: torch.Tensor, ids: torch.Tensor) -> None:
    """ids: the block ids a call is about to read. Torch indexing would take a negative id silently
    (it counts from the end), so say clearly when one lies outside the pool."""
    if ids.numel() and kv_store.device.type == "cpu":
        lo, hi = torch.aminmax(ids)
        if int(lo) < 0 or int(hi) >= kv_store.shape[0]:
            raise ValueError(f"block_tables holds block ids outside the pool [0, {kv_store.shape[0]}), "
                             f"got values in [{int(lo)}, {int(hi)}]")


def check_new_kv(q: torch.Tensor, kv_store: torch.Tensor, new_kv: tuple[torch.Tensor, torch.Tensor]) -> None:
    """new_kv: the new tokens' (k, v), each [N, n_kv_heads, head_dim], packed like q."""
    expected = (q.shape[0], kv_store.shape[3], kv_store.shape[5])
    for name, t in zip(("new_kv[0] (k)", "new_kv[1] (v)"), new_kv):
        if tuple(t.shape) != expected or t.device != q.device or t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name} must be a float tensor [n_tokens, n_kv_heads, head_dim] = {expected} on "
                             f"{q.device}, got {tuple(t.shape)} {t.dtype} on {t.device}")


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
    """The reference's contract, computed the fast way for a CPU (the CPU path of phase 3.7's ops.py).

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
    phase 3.6's loop did for a fresh prompt. The values are the same, so the answer
    is too (tested); the kernel always reads the pool, in place, for free.
    """
    if plan is None:
        plan = plan_prefill(cu_seqlens_q, context_lens, device=q.device)
    check_prefill_inputs(q, kv_store, layer_idx, block_tables, cu_seqlens_q, context_lens, plan,
                         sliding_window, softcap, table_values=False)  # the ids read: checked below
    if new_kv is not None:
        check_new_kv(q, kv_store, new_kv)
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
            visible = visible_keys(*segment_positions(plan, s, q.device), sliding_window)
            o = _attend_fp32_softcapped(qs[0], k[0], v[0], visible, scale, softcap).to(q.dtype)[None]
        elif context == 0 and (sliding_window is None or total <= sliding_window):
            o = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            visible = visible_keys(*segment_positions(plan, s, q.device), sliding_window)
            o = F.scaled_dot_product_attention(qs, k, v, attn_mask=visible[None, None], scale=scale, enable_gqa=gqa)
        outs.append(o[0].transpose(0, 1))                               # [T, H, D]
    return torch.cat(outs)                                             # one copy for the whole pack
