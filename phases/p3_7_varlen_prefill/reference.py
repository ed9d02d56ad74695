"""Varlen paged prefill attention in PyTorch: the oracle the kernel is held to.

Query i of segment s sits at p = context_lens[s] + i and sees key k if k <= p (causal, never across
segments) and, with a sliding window w, k > p - w; scores = q . K^T * scale, then c * tanh(scores / c)
with a softcap c. Each segment's K/V come from phase 3.4's `gather_reference`; mask and cap are phase
3.5's. (SDPA over contiguous K/V, the second oracle: extras/p3_7_varlen_prefill/contiguous.py.)
"""

from __future__ import annotations

import torch

from phases.p3_4_gather_kernel.reference import gather_reference
from phases.p3_5_paged_attention.reference import soft_cap, visible_keys  # noqa: F401  (re-exported)
from phases.p3_7_varlen_prefill.checks import check_prefill_inputs
from phases.p3_7_varlen_prefill.plan import PrefillPlan, plan_prefill


def segment_positions(plan: PrefillPlan, s: int, device) -> tuple[torch.Tensor, torch.Tensor]:
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
        visible = visible_keys(*segment_positions(plan, s, q.device), sliding_window)
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)    # each query sees itself: no NaN
        out[start:start + length] = (probs @ v).transpose(0, 1).to(q.dtype)   # [T, H, D]
    return out
