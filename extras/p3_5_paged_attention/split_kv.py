"""Phase 3.5's split-KV variant ("flash-decoding"): the decode kernel over shares of each context, then a merge.

Off the reading path: phase 3.9 makes split-KV a tuned rule. Here the same
kernel (kernels.py) runs with its split axis > 1: program (b, g, s) covers
`blocks_per_split` blocks and writes its partial output and log-sum-exp;
`merge_splits` combines the partials in PyTorch.
"""

from __future__ import annotations

import torch
import triton

from phases.p3_5_paged_attention.kernel_checks import check_decode_inputs, check_window_and_softcap
from phases.p3_5_paged_attention.kernels import _check_kernel_shapes, _launch


def merge_splits(partial: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Combine split-KV partials: partial [B, H, S, D] fp32 (each normalised over its split),
    lse [B, H, S] fp32 log-sum-exp of each split's scores -> [B, H, D] fp32.

    softmax over the whole context = sum over splits of e^(lse_s - lse_total) * partial_s.
    """
    top = lse.amax(dim=-1, keepdim=True)                          # [B, H, 1]
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # all-empty rows: weights 0
    w = torch.exp(lse - top)                                      # [B, H, S], 0 for empty splits
    total = w.sum(dim=-1, keepdim=True)
    return (partial * w[..., None]).sum(dim=2) / total.clamp_min(torch.finfo(total.dtype).tiny)


def paged_decode_attention_split(q: torch.Tensor, kv_store: torch.Tensor, layer_idx: int,
                                 block_tables: torch.Tensor, seq_lens: torch.Tensor,
                                 scale: float | None = None, blocks_per_split: int = 8,
                                 sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Split-KV variant ("flash-decoding"): program (b, g, s) covers only blocks
    [s * blocks_per_split, (s + 1) * blocks_per_split) and writes its normalised partial output and log-sum-exp
    m + log(l); `merge_splits` then combines the partials. That buys parallelism when B * n_kv_heads programs
    are too few to fill a GPU (long contexts at small batch). A split that lies wholly before the window has
    nothing to read and weighs 0 in the merge. (`paged_decode_attention_triton` is n_splits = 1: a program
    covers the whole context and writes the final output.)"""
    check_decode_inputs(q, kv_store, layer_idx, block_tables, seq_lens)
    check_window_and_softcap(sliding_window, softcap)
    _check_kernel_shapes(kv_store)
    if blocks_per_split < 1:
        raise ValueError(f"blocks_per_split must be >= 1, got {blocks_per_split}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    batch, n_heads, head_dim = q.shape
    n_splits = max(triton.cdiv(block_tables.shape[1], blocks_per_split), 1)
    partial = torch.empty(batch, n_heads, n_splits, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, n_heads, n_splits, dtype=torch.float32, device=q.device)
    if batch:
        _launch(q, kv_store, layer_idx, block_tables, seq_lens, scale, partial, lse, blocks_per_split, n_splits,
                sliding_window, softcap)
    return merge_splits(partial, lse).to(q.dtype)
