"""What a non-paged engine does for decode: SDPA over contiguous K/V. Phase 3.5's second oracle and the benches' baseline."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from phases.p3_5_paged_attention.kernel_checks import check_window_and_softcap
from phases.p3_5_paged_attention.reference import decode_visible


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
