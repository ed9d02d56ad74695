"""Input checks for the varlen paged prefill attention (the kernel, the references and the CPU path alike).

Built on phase 3.4's pool/table checks and phase 3.5's dtype list and window/softcap check. A kernel
handed a wrong shape reads the wrong memory instead of raising, so every entry
point checks first and names the argument. Shape checks and checks against the
plan's host-side lengths are free. Checks of tensor *contents* (block ids
inside the pool, tensors that agree with the plan) run only on CPU tensors,
where reading them does not stall a GPU stream.
"""

from __future__ import annotations

import torch

from phases.p3_4_gather_kernel.checks import INDEX_DTYPES, check_pool, check_tables
from phases.p3_5_paged_attention.kernel_checks import FLOAT_DTYPES, check_query_heads, check_window_and_softcap
from phases.p3_7_varlen_prefill.plan import PrefillPlan

__all__ = ["check_prefill_inputs", "check_block_ids", "check_window_and_softcap"]


def _check_index(name: str, t: torch.Tensor, n: int, kv_store: torch.Tensor) -> None:
    if t.dim() != 1 or t.shape[0] != n:
        raise ValueError(f"{name} must be 1-d with {n} entries, got shape {tuple(t.shape)}")
    if t.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.device != kv_store.device:
        raise ValueError(f"{name} is on {t.device} but kv_store is on {kv_store.device}")


def check_prefill_inputs(q: torch.Tensor, kv_store: torch.Tensor, layer_idx: int, block_tables: torch.Tensor,
                         cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, plan: PrefillPlan,
                         sliding_window: int | None = None, softcap: float | None = None,
                         table_values: bool = True,
                         new_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """q [N, n_heads, head_dim] against the pool, the S segments' tables and lengths, and the plan.

    table_values=False skips checking the block ids in block_tables (CPU only anyway): for a caller
    that checks the ids it actually reads itself (the CPU path, which reads them all in one op).
    new_kv: the CPU path's optional (k, v) of the new tokens, each [N, n_kv_heads, head_dim]."""
    check_pool(kv_store, layer_idx)
    check_window_and_softcap(sliding_window, softcap)
    n_kv_heads, block_size, head_dim = kv_store.shape[3], kv_store.shape[4], kv_store.shape[5]
    if q.dim() != 3:
        raise ValueError(f"q must be [n_tokens, n_heads, head_dim] (segments packed along dim 0), "
                         f"got shape {tuple(q.shape)}")
    check_query_heads(q, kv_store)
    if block_tables.dim() != 2:
        raise ValueError(f"block_tables must be [n_segments, max_blocks], got shape {tuple(block_tables.shape)}")
    if block_tables.dtype not in INDEX_DTYPES or block_tables.device != kv_store.device:
        raise ValueError(f"block_tables must be int32 or int64 on the pool's device {kv_store.device}, "
                         f"got {block_tables.dtype} on {block_tables.device}")
    n_segments = block_tables.shape[0]
    _check_index("cu_seqlens_q", cu_seqlens_q, n_segments + 1, kv_store)
    _check_index("context_lens", context_lens, n_segments, kv_store)

    if new_kv is not None:
        expected = (q.shape[0], n_kv_heads, head_dim)
        for name, t in zip(("new_kv[0] (k)", "new_kv[1] (v)"), new_kv):
            if tuple(t.shape) != expected or t.device != q.device or t.dtype not in FLOAT_DTYPES:
                raise ValueError(f"{name} must be a float tensor [n_tokens, n_kv_heads, head_dim] = {expected} on "
                                 f"{q.device}, got {tuple(t.shape)} {t.dtype} on {t.device}")

    # Against the plan: its host-side lengths are what the CPU path loops over and what sized the grid.
    if plan.n_segments != n_segments or plan.n_tokens != q.shape[0]:
        raise ValueError(f"plan was made for {plan.n_segments} segments and {plan.n_tokens} tokens, but this call "
                         f"has {n_segments} segments (block_tables rows) and {q.shape[0]} tokens (q rows)")
    capacity = block_tables.shape[1] * block_size
    if max(plan.total_lens, default=0) > capacity:
        raise ValueError(f"a segment needs {max(plan.total_lens)} tokens (context + new) but block_tables rows "
                         f"hold at most {capacity} (max_blocks {block_tables.shape[1]} x block_size {block_size})")
    if kv_store.device.type != "cpu":
        return
    if (tuple(cu_seqlens_q.tolist()) != plan.seg_starts + (plan.n_tokens,)
            or tuple(context_lens.tolist()) != plan.context_lens):
        raise ValueError("plan was made for other cu_seqlens_q / context_lens than this call's")
    if table_values:
        totals = torch.tensor(plan.total_lens, dtype=torch.int64)
        check_tables(kv_store, block_tables, totals)   # the block ids each segment reads lie inside the pool


def check_block_ids(kv_store: torch.Tensor, ids: torch.Tensor) -> None:
    """ids: the block ids a call is about to read. Torch indexing would take a negative id silently
    (it counts from the end), so say clearly when one lies outside the pool."""
    if ids.numel() and kv_store.device.type == "cpu":
        lo, hi = torch.aminmax(ids)
        if int(lo) < 0 or int(hi) >= kv_store.shape[0]:
            raise ValueError(f"block_tables holds block ids outside the pool [0, {kv_store.shape[0]}), "
                             f"got values in [{int(lo)}, {int(hi)}]")
