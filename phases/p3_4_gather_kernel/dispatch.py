"""Pick the Triton kernel (CUDA tensors) or the PyTorch reference (CPU: Triton's interpreter is far too slow to serve).

ENGINE_FORCE_TRITON_INTERPRET=1 forces the kernel on CPU (tests). A CPU run says once per feature that it is
not exercising the kernels.
"""

from __future__ import annotations

import logging
import os

import torch

from phases.p3_4_gather_kernel.reference import gather_reference

FORCE_KERNELS_ENV = "ENGINE_FORCE_TRITON_INTERPRET"
log = logging.getLogger(__name__)
_announced: set[str] = set()


def use_kernels(device: torch.device | str) -> bool:
    """True on CUDA, or on CPU when ENGINE_FORCE_TRITON_INTERPRET=1 (tests)."""
    if torch.device(device).type == "cuda":
        return True
    return os.environ.get(FORCE_KERNELS_ENV, "0") == "1"


def announce_reference_once(feature: str) -> None:
    """Say once per process that `feature` runs its PyTorch reference (no GPU)."""
    if feature not in _announced:
        _announced.add(feature)
        log.warning("no GPU: %s uses the PyTorch reference path", feature)


def gather_kv(kv_store: torch.Tensor, layer_idx: int, block_tables: torch.Tensor, seq_lens: torch.Tensor,
              max_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(k, v) each [B, n_kv_heads, max_len, head_dim]: the Triton gather on CUDA, the reference on CPU."""
    if use_kernels(kv_store.device):
        from phases.p3_4_gather_kernel.kernel import gather_triton  # imports triton only when needed
        return gather_triton(kv_store, layer_idx, block_tables, seq_lens, max_len)
    announce_reference_once("the KV gather")
    return gather_reference(kv_store, layer_idx, block_tables, seq_lens, max_len)
