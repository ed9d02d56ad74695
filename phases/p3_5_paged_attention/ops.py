"""The paged-attention operations the engine calls: the Triton kernels on CUDA, PyTorch paths on CPU.

On CPU tensors the paths of extras/p3_5_paged_attention/cpu_path.py run (tested equal to reference.py's
oracles; the first call says so), with `plan_decode` / `plan_write` working out block ids, masks and slots
once per forward pass (None on a GPU). ENGINE_FORCE_TRITON_INTERPRET=1 forces the kernels on CPU (tests).
"""

from __future__ import annotations

import torch

from extras.p3_5_paged_attention import cpu_path
from phases.p3_4_gather_kernel.dispatch import announce_reference_once, gather_kv, use_kernels

__all__ = ["paged_decode_attention", "write_kv", "gather_kv", "plan_decode", "plan_write"]

ATTENTION_FEATURE = "paged attention"


def paged_decode_attention(q: torch.Tensor, kv_store: torch.Tensor, layer_idx: int,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float | None = None,
                           plan: cpu_path.DecodePlan | None = None, sliding_window: int | None = None,
                           softcap: float | None = None) -> torch.Tensor:
    """Decode attention for a batch, K/V read from the pool in place: q [B, n_heads, head_dim] -> the same shape.

    block_tables [B, max_blocks] int32 (padding never read), seq_lens [B] int32 (the new token included),
    scale (default head_dim ** -0.5), plan (`plan_decode`, CPU), sliding_window w (the last w keys),
    softcap c (scores become c * tanh(scores / c) after scaling)."""
    if use_kernels(q.device):
        from phases.p3_5_paged_attention.kernels import paged_decode_attention_triton  # imports triton here only
        return paged_decode_attention_triton(q, kv_store, layer_idx, block_tables, seq_lens, scale,
                                             sliding_window, softcap)
    announce_reference_once(ATTENTION_FEATURE)
    return cpu_path.paged_decode_attention_gather_bmm(q, kv_store, layer_idx, block_tables, seq_lens, scale,
                                                      plan=plan, sliding_window=sliding_window, softcap=softcap)


def write_kv(kv_store: torch.Tensor, layer_idx: int, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, plan: cpu_path.WritePlan | None = None) -> None:
    """Store k, v [T, n_kv_heads, head_dim] at slot_mapping [T] (block_id * block_size + offset; -1 skips).
    plan: `plan_write(...)` of these slots, made once per forward pass (CPU path; None: made here)."""
    if use_kernels(kv_store.device):
        from phases.p3_5_paged_attention.kernels import write_kv_triton
        write_kv_triton(kv_store, layer_idx, k, v, slot_mapping)
    else:
        cpu_path.write_kv_reference(kv_store, layer_idx, k, v, slot_mapping, plan=plan)


def plan_write(kv_store: torch.Tensor, slot_mapping: torch.Tensor) -> cpu_path.WritePlan | None:
    """The per-pass half of `write_kv` on CPU; None where the Triton kernel runs (it needs none)."""
    return None if use_kernels(kv_store.device) else cpu_path.plan_write(kv_store, slot_mapping)


def plan_decode(kv_store: torch.Tensor, block_tables: torch.Tensor,
                seq_lens: torch.Tensor) -> cpu_path.DecodePlan | None:
    """The per-pass half of `paged_decode_attention` on CPU; None where the Triton kernel runs."""
    return None if use_kernels(kv_store.device) else cpu_path.plan_decode(kv_store, block_tables, seq_lens)
