"""The split-KV merge as one Triton kernel: partials and log-sum-exps in, the attention output out, one launch.

Per (sequence, query head) the decode kernel leaves one partial output per split, normalised over its own
keys, and its log-sum-exp. With top = max_s lse_s:

    softmax over the whole context = sum_s e^(lse_s - top) * partial_s / sum_s e^(lse_s - top)

In PyTorch (phase 3.5's `merge_splits`) that is a dozen small kernels, each a pass over HBM; here one program
per (sequence, query head) loads the S log-sum-exps and S x D partials once, in fp32, and writes the output in
its dtype. A split with lse = -inf weighs 0; a row with every split empty (length 0) comes out as zeros.
"""

from __future__ import annotations

import torch

from phases.p3_4_gather_kernel.kernel import use_interpreter_without_gpu

use_interpreter_without_gpu()   # before `@triton.jit`: without a GPU the kernel runs in Triton's interpreter

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

MIN_LANES = 2   # axes are padded to a power of two of at least 2 (no one-lane axis to reduce over)
FP32_TINY = tl.constexpr(torch.finfo(torch.float32).tiny)   # merge_splits' floor under the weights' sum


@triton.jit
def _merge_splits_kernel(
    partial_ptr, lse_ptr, out_ptr, n_splits, head_dim,
    s_p_seq, s_p_head, s_p_split, s_p_dim,
    s_l_seq, s_l_head, s_l_split,
    s_o_seq, s_o_head, s_o_dim,
    SPLITS: tl.constexpr, DIMS: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    splits = tl.arange(0, SPLITS)                       # [SPLITS] the split axis, padded to a power of two
    dims = tl.arange(0, DIMS)                           # [DIMS]   the head_dim axis, likewise
    split_ok = splits < n_splits
    dim_ok = dims < head_dim

    lse = tl.load(lse_ptr + seq * s_l_seq + head * s_l_head + splits * s_l_split,
                  mask=split_ok, other=float("-inf"))                                # [SPLITS] fp32
    top = tl.max(lse, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)     # every split empty: weights e^-inf = 0, no NaN
    w = tl.exp(lse - top)                               # [SPLITS], 0 for an empty split or a padding lane
    filled = split_ok & (lse > float("-inf"))           # an empty split's partial is never read
    part = tl.load(partial_ptr + seq * s_p_seq + head * s_p_head + splits[:, None] * s_p_split
                   + dims[None, :] * s_p_dim, mask=filled[:, None] & dim_ok[None, :], other=0.0)   # [SPLITS, DIMS]
    total = tl.sum(w, axis=0)
    out = tl.sum(part * w[:, None], axis=0) / tl.maximum(total, FP32_TINY)       # [DIMS]
    tl.store(out_ptr + seq * s_o_seq + head * s_o_head + dims * s_o_dim,
             out.to(out_ptr.dtype.element_ty), mask=dim_ok)                         # cast once, at the store


def merge_splits_triton(partial: torch.Tensor, lse: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """partial [B, H, S, D] fp32 (each split normalised over its keys), lse [B, H, S] fp32 (-inf: an empty
    split) -> [B, H, D] in `out_dtype` (default fp32): `merge_splits(partial, lse).to(out_dtype)` in one launch."""
    if partial.dim() != 4 or lse.shape != partial.shape[:3]:
        raise ValueError(f"partial must be [B, H, S, D] and lse [B, H, S], got {tuple(partial.shape)} and "
                         f"{tuple(lse.shape)}")
    if partial.dtype != torch.float32 or lse.dtype != torch.float32:
        raise ValueError(f"partial and lse must be fp32, got {partial.dtype} and {lse.dtype}")
    if partial.device != lse.device:
        raise ValueError(f"partial is on {partial.device} but lse is on {lse.device}")
    batch, n_heads, n_splits, head_dim = partial.shape
    if n_splits < 1:
        raise ValueError("partial needs at least one split")
    out = torch.empty(batch, n_heads, head_dim, dtype=out_dtype or torch.float32, device=partial.device)
    if out.numel():
        _merge_splits_kernel[(batch, n_heads)](
            partial, lse, out, n_splits, head_dim, *partial.stride(), *lse.stride(), *out.stride(),
            SPLITS=max(MIN_LANES, triton.next_power_of_2(n_splits)),
            DIMS=max(MIN_LANES, triton.next_power_of_2(head_dim)),
        )
    return out
