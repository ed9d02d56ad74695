"""Attention for the static decode step: phase 3.6's decode layout over the static buffers, with phase 3.9's
tuned kernel; any other batch goes to phase 3.8's attention, so one name serves every pass. Nothing here reads
a tensor's value on the host: it runs inside a CUDA graph capture, where such a read fails.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface

from extras.p3_10_cuda_graphs.cpu_step import decode_attention_in_place
from phases.p3_4_gather_kernel.dispatch import use_kernels
from phases.p3_6_batched_engine.attention import PagedBatch, check_call, write_new_kv
from phases.p3_5_paged_attention.ops import paged_decode_attention
from phases.p3_8_chunked_prefill.attention import varlen_attention_forward

STATIC_ATTN_NAME = "engine_static_decode"


@dataclass
class StaticDecodeBatch(PagedBatch):
    """A decode pass over the static buffers: rows 0 .. bucket-1, padding rows with length 0."""
    n_splits: int = 1     # programs per (sequence, KV head) in the decode kernel (split_rule.py)
    in_place: bool = False  # a CPU step: the compiled attention reads the pool in place (runner.py's cpu_step)


def decode_attention(q: torch.Tensor, batch: StaticDecodeBatch, layer: int, scale: float | None,
                     sliding_window: int | None, softcap: float | None) -> torch.Tensor:
    """q [B, n_heads, head_dim] -> [B, n_heads, head_dim]: the tuned kernel on CUDA, phase 3.5's path on CPU
    (or, for a CPU step, extras/p3_10_cuda_graphs/cpu_step.py's compiled loop)."""
    if use_kernels(q.device):
        from phases.p3_9_tuned_decode_kernel.decode_kernel import tiled_decode_attention
        return tiled_decode_attention(q, batch.kv_store, layer, batch.block_tables, batch.seq_lens, scale,
                                      n_splits=batch.n_splits, sliding_window=sliding_window, softcap=softcap,
                                      check_values=False)
    attend = decode_attention_in_place if batch.in_place else paged_decode_attention
    return attend(q, batch.kv_store, layer, batch.block_tables, batch.seq_lens, scale, plan=batch.decode_plan,
                  sliding_window=sliding_window, softcap=softcap)


def static_attention_forward(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0,
                             paged: PagedBatch | None = None, sliding_window: int | None = None,
                             softcap: float | None = None, **kwargs):
    """The AttentionInterface entry point: query [B, H, 1, D] for a StaticDecodeBatch -> ([B, 1, H, D], None);
    any other batch goes to phase 3.8's attention."""
    if not isinstance(paged, StaticDecodeBatch):
        return varlen_attention_forward(module, query, key, value, attention_mask, scaling, dropout, paged=paged,
                                        sliding_window=sliding_window, softcap=softcap, **kwargs)
    check_call(module, sliding_window, kwargs)
    write_new_kv(paged, module.layer_idx, key, value)
    out = decode_attention(query[:, :, 0, :], paged, module.layer_idx, scaling, sliding_window, softcap)
    return out.unsqueeze(1), None                                      # [B, 1, H, D]


AttentionInterface.register(STATIC_ATTN_NAME, static_attention_forward)
