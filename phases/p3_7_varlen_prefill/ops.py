"""The varlen prefill attention the engine calls: `plan_prefill` once per pass, then this in every layer.

CUDA: the Triton kernel. CPU (no Triton backend): extras/p3_7_varlen_prefill/cpu_path.py, the
oracle's answer computed fast for a CPU. ENGINE_FORCE_TRITON_INTERPRET=1: the kernel, interpreted.
"""

from __future__ import annotations

import torch

from extras.p3_7_varlen_prefill.cpu_path import paged_prefill_attention_cpu
from phases.p3_4_gather_kernel.dispatch import announce_reference_once, use_kernels
from phases.p3_7_varlen_prefill.plan import DEFAULT_BLOCK_M, PrefillPlan, plan_prefill

__all__ = ["paged_prefill_attention", "plan_prefill", "PrefillPlan", "DEFAULT_BLOCK_M"]

PREFILL_FEATURE = "varlen prefill attention"


def paged_prefill_attention(q: torch.Tensor, kv_store: torch.Tensor, layer_idx: int, block_tables: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, scale: float | None = None,
                            sliding_window: int | None = None, softcap: float | None = None,
                            plan: PrefillPlan | None = None,
                            new_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Causal attention of S packed segments, K/V read from the pool in place.

    q             [N, n_heads, head_dim]   the new tokens of S segments, packed (their K/V already in the pool)
    kv_store      [n_blocks, n_layers, 2, n_kv_heads, block_size, head_dim]
    block_tables  [S, max_blocks] int32    each segment's sequence's physical blocks (padding never read)
    cu_seqlens_q  [S + 1] int32            segment s owns q rows cu[s] .. cu[s+1] - 1
    context_lens  [S] int32                tokens of that sequence in the pool before this segment
    scale         softmax scale (default head_dim ** -0.5)
    sliding_window  None, or w: a query at position p sees keys p - w + 1 .. p (transformers' definition)
    softcap       None, or c: scores become c * tanh(scores / c) after scaling (Gemma 2)
    plan          `plan_prefill(cu_seqlens_q, context_lens, device=q.device)`, made once per forward
                  pass and reused by every layer (None: made here, which on a GPU reads cu_seqlens_q back)
    new_kv        optional (k, v), each [N, n_kv_heads, head_dim], just written to the pool: the CPU path
                  reads a fresh segment's K/V from them instead of copying them back out of the pool
    Query i of segment s sits at position context_lens[s] + i and attends keys 0 .. that position.
    Query head h reads KV head h // (n_heads // n_kv_heads). Returns [N, n_heads, head_dim] in q's dtype.
    """
    if use_kernels(q.device):
        from phases.p3_7_varlen_prefill.kernel import paged_prefill_attention_triton  # imports triton here only
        return paged_prefill_attention_triton(q, kv_store, layer_idx, block_tables, cu_seqlens_q, context_lens,
                                              scale, sliding_window, softcap, plan)
    announce_reference_once(PREFILL_FEATURE)
    return paged_prefill_attention_cpu(q, kv_store, layer_idx, block_tables, cu_seqlens_q, context_lens,
                                       scale, sliding_window, softcap, plan, new_kv)
