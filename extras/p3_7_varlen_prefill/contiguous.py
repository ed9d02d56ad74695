"""What a non-paged engine does for a packed prefill: SDPA per segment over contiguous K/V.

Phase 3.7's second oracle (it has no softcap: SDPA offers none) and the benches' baseline.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from phases.p3_7_varlen_prefill.checks import check_window_and_softcap
from phases.p3_7_varlen_prefill.plan import plan_prefill
from phases.p3_7_varlen_prefill.reference import segment_positions, visible_keys


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
        visible = visible_keys(*segment_positions(plan, s, q.device), sliding_window)   # [T, L]
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=visible[None, None], scale=scale,
                                           enable_gqa=qs.shape[1] != ks.shape[1])
        out[start:start + length] = o[0].transpose(0, 1)
    return out
