"""The CPU's counterpart of phase 3.10's CUDA graph: what a step prepares once and reuses (speed only).

A CPU has no graphs, and the static step runs eagerly there. What a graph
prepares once (kernels chosen, memory fixed, launches recorded) has two CPU
counterparts that pay off on every step after the first:

- **Packed weights** (`PackedWeights`). oneDNN's bf16 matmul reorders a
  plain [out, in] weight into its blocked layout on every call. Reordered once
  (`mkldnn._reorder_linear_weight`, as torch.compile's freezing and vLLM's
  CPU build do), each linear runs on the packed copy (`_linear_pointwise`).
  The packed copies are extra memory, one per linear: the plain weights stay
  for every other user of the model (HF `generate`, other engines, sharding).
- **Decode attention as one compiled loop** (`decode_attention_in_place`).
  Phase 3.5's CPU path gathers every sequence's K/V into a fresh
  [n_kv_heads, B, L, D] copy per layer, then runs two batched matmuls.
  Written as a gather plus reductions and compiled by inductor, the same math
  becomes one C++ loop that reads K/V where they sit in the pool: no copy.
  It is compiled at the first static step, and once more when the batch or
  the longest table first changes (dynamo then marks those sizes dynamic).

`cpu_step_here(lm)` says where both are on by default: bf16 on a CPU whose
oneDNN has native bf16 matmuls, with a C++ compiler for inductor. fp32 keeps
phase 3.5's path and the plain weights, so the fp32 tests' token-for-token
checks are untouched.
"""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from typing import Callable

import torch
from torch import nn

from extras.p3_5_paged_attention.cpu_path import plan_decode
from phases.p3_4_gather_kernel.reference import K_INDEX, V_INDEX
from phases.p3_5_paged_attention.kernel_checks import check_decode_inputs, check_window_and_softcap
from phases.p3_5_paged_attention.reference import decode_visible, soft_cap


def native_bf16_matmul() -> bool:
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def cpp_compiler() -> str | None:
    """The C++ compiler inductor builds the attention loop with (None: there is none, so no CPU step)."""
    return shutil.which(os.environ.get("CXX", "g++")) or shutil.which("clang++")


def cpu_step_here(lm) -> bool:
    """The default: bf16 on a CPU with native bf16 matmuls and a C++ compiler (fp32 keeps the plain path)."""
    return (torch.device(lm.device).type == "cpu" and lm.dtype == torch.bfloat16 and native_bf16_matmul()
            and cpp_compiler() is not None)


class PackedWeights:
    """Every plain bf16 `nn.Linear` of `model`, its weight packed for oneDNN at the first step; `on()` routes the
    linears to the packed copies for one step. Weights replaced or re-cut since are all packed again."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.forwards: list[tuple[nn.Linear, Callable]] = []   # each linear, and its forward on the packed weight
        self._packed_from: list[int] | None = None            # the weights' data_ptr when they were packed

    def linears(self) -> list[nn.Linear]:
        # Exactly nn.Linear: a subclass (or a wrapper such as 4.6's row-parallel linear) keeps its own forward.
        return [m for m in self.model.modules() if type(m) is nn.Linear and m.weight.dtype == torch.bfloat16]

    def pack(self) -> None:
        linears = self.linears()
        self.forwards = [(m, _packed_forward(torch.ops.mkldnn._reorder_linear_weight(m.weight.detach()), m.bias))
                         for m in linears]
        self._packed_from = [m.weight.data_ptr() for m in linears]

    @contextmanager
    def on(self):
        """For the duration: each linear's forward is oneDNN's matmul on its packed weight. Written straight
        into the module's __dict__ (it shadows nn.Linear.forward): nn.Module's __setattr__ is slow per step."""
        if self._packed_from != [m.weight.data_ptr() for m, _ in self.forwards]:
            self.pack()
        for linear, forward in self.forwards:
            linear.__dict__["forward"] = forward
        try:
            yield
        finally:
            for linear, _ in self.forwards:
                linear.__dict__.pop("forward", None)


def _packed_forward(packed: torch.Tensor, bias: torch.Tensor | None):
    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")   # x [.., in] -> [.., out]
    return forward


def _attend_in_place(q: torch.Tensor, kv_layer: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor,
                     n_logical: int, scale: float, softcap: float | None) -> torch.Tensor:
    """q [B, H, D], kv_layer [n_blocks, 2, H_kv, bs, D] (one layer of the pool, a view), ids [B * n_logical]
    (block per (sequence, logical block)), valid [B, L] -> [B, H, D]. Compiled: the indexing is fused into the
    reductions, so no gathered copy is ever written."""
    batch, n_heads, head_dim = q.shape
    n_kv_heads, block_size = kv_layer.shape[2], kv_layer.shape[3]
    blocks = kv_layer[ids.view(batch, n_logical)]                          # [B, n_logical, 2, H_kv, bs, D]
    k = blocks[:, :, K_INDEX].permute(0, 2, 1, 3, 4).reshape(batch, n_kv_heads, n_logical * block_size, head_dim)
    v = blocks[:, :, V_INDEX].permute(0, 2, 1, 3, 4).reshape(batch, n_kv_heads, n_logical * block_size, head_dim)
    qg = q.view(batch, n_kv_heads, n_heads // n_kv_heads, head_dim).float()   # [B, H_kv, G, D]
    scores = soft_cap((qg[:, :, :, None, :] * k[:, :, None].float()).sum(-1) * scale, softcap)  # [B, H_kv, G, L]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = scores.softmax(-1).nan_to_num(0.0)                                   # length 0 -> zeros
    out = (probs[..., None] * v[:, :, None].float()).sum(-2)                    # [B, H_kv, G, D]
    return out.reshape(batch, n_heads, head_dim).to(q.dtype)


_compiled_attend = torch.compile(_attend_in_place)


def decode_attention_in_place(q: torch.Tensor, kv_store: torch.Tensor, layer_idx: int, block_tables: torch.Tensor,
                              seq_lens: torch.Tensor, scale: float | None = None, plan=None,
                              sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Phase 3.5's `paged_decode_attention` contract on a CPU, K/V read in place by the compiled loop.
    `plan`: 3.5's `plan_decode` of these tables (made here without one)."""
    check_decode_inputs(q, kv_store, layer_idx, block_tables, seq_lens, values=plan is None)
    check_window_and_softcap(sliding_window, softcap)
    if plan is None:
        plan = plan_decode(kv_store, block_tables, seq_lens)
    if plan.n_logical == 0:
        return torch.zeros_like(q)
    valid = plan.valid                                                           # [B, L]
    if sliding_window is not None:
        valid = valid & decode_visible(seq_lens.to(valid.device), valid.shape[1], sliding_window)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    # The layer's view, not its index: an int index would be a constant to dynamo (one compile per layer).
    return _compiled_attend(q, kv_store[:, layer_idx], plan.ids, valid, plan.n_logical, float(scale), softcap)
