"""The varlen prefill attention the engine calls: `plan_prefill` once per pass, then this in every layer.

CUDA: the Triton kernel. CPU: extras/p3_7_varlen_prefill/cpu_path.py. ENGINE_FORCE_TRITON_INTERPRET=1: the
kernel, interpreted.
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
    """Causal attention of S packed segments, K/V read from the pool in place: q [N, n_heads, head_dim]
    (their K/V already written) -> [N, n_heads, head_dim] in q's dtype.

    block_tables [S, max_blocks], cu_seqlens_q [S + 1], context_lens [S] (tokens in the pool before this
    segment): query i of segment s sits at context_lens[s] + i. sliding_window w, softcap c: as phase 3.5.
    plan: `plan_prefill(...)`, once per pass. new_kv: the (k, v) just written, [N, n_kv_heads, head_dim]
    each, which the CPU path reads instead of the pool."""
    if use_kernels(q.device):
        from phases.p3_7_varlen_prefill.kernel import paged_prefill_attention_triton  # imports triton here only
        return paged_prefill_attention_triton(q, kv_store, layer_idx, block_tables, cu_seqlens_q, context_lens,
                                              scale, sliding_window, softcap, plan)
    announce_reference_once(PREFILL_FEATURE)
    return paged_prefill_attention_cpu(q, kv_store, layer_idx, block_tables, cu_seqlens_q, context_lens,
                                       scale, sliding_window, softcap, plan, new_kv)
