"""The paged-attention operations the engine calls: the Triton kernels on CUDA, PyTorch paths on CPU.

    paged_decode_attention(q, kv_store, layer_idx, block_tables, seq_lens, scale, plan=None,
                           sliding_window=None, softcap=None) -> [B, n_heads, head_dim]
    write_kv(kv_store, layer_idx, k, v, slot_mapping, plan=None)                  (in place)
    plan_decode(kv_store, block_tables, seq_lens) / plan_write(kv_store, slot_mapping)
        what the CPU paths work out once per forward pass; None on a GPU
    gather_kv(kv_store, layer_idx, block_tables, seq_lens) -> (k, v)              (phase 3.4)

On CPU tensors (Triton has no CPU backend) the paths in extras/p3_5_paged_attention/cpu_path.py
run, tested equal to reference.py's oracles, and the first call says so once.
ENGINE_FORCE_TRITON_INTERPRET=1 forces the kernels on CPU, in Triton's interpreter, for tests.
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
    """Decode attention for a batch, K/V read from the pool in place.

    q            [B, n_heads, head_dim]  one new token per sequence (its K/V already written)
    kv_store     [n_blocks, n_layers, 2, n_kv_heads, block_size, head_dim]
    block_tables [B, max_blocks] int32   physical block ids (pad with 0; never read past the length)
    seq_lens     [B] int32               tokens in the pool per sequence, the new one included
    scale        softmax scale (default head_dim ** -0.5)
    plan         `plan_decode(...)` of these tables, made once per forward pass (CPU path; None: made here)
    sliding_window  None, or w: the query (at position seq_len - 1) sees only the last w keys
    softcap      None, or c: scores become c * tanh(scores / c) after scaling (Gemma 2)
    Returns [B, n_heads, head_dim] in q's dtype.
    """
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
