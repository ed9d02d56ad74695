"""PyTorch references for phase 3.5's decode attention: the test oracles, and what the kernel must match.

`paged_decode_attention_reference` gathers the batch's K/V with phase 3.4's `gather_reference`, then runs
plain masked attention in fp32. Besides causality a layer may ask for a sliding window w (Mistral, Gemma's
local layers: `visible_keys`) or a logit softcap c (Gemma 2: `soft_cap`). The CPU paths of ops.py and SDPA
over contiguous K/V (the second oracle) are in extras/.
"""

from __future__ import annotations

import torch

from phases.p3_4_gather_kernel.reference import gather_reference, max_length
from phases.p3_5_paged_attention.kernel_checks import check_decode_inputs, check_window_and_softcap


def visible_keys(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None = None) -> torch.Tensor:
    """q_pos [T], k_pos [L] -> [T, L] bool: causal, and with a window w keys p - w + 1 .. p (transformers')."""
    visible = k_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        visible &= k_pos[None, :] > q_pos[:, None] - sliding_window
    return visible


def soft_cap(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Gemma 2's attention logit softcapping: c * tanh(scores / c), applied after the scale."""
    return scores if softcap is None else softcap * torch.tanh(scores / softcap)


def decode_visible(seq_lens: torch.Tensor, length: int, sliding_window: int | None = None) -> torch.Tensor:
    """[B, length] bool: the keys each sequence's new query (at seq_lens[b] - 1) sees; none at length 0."""
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
