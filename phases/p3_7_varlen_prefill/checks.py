"""Input checks for the varlen prefill attention, built on phase 3.4's and 3.5's: a kernel handed a wrong
shape reads the wrong memory instead of raising. Checks of tensor *contents* run only on CPU tensors,
where reading them does not stall a GPU stream; on a GPU the plan's host-side lengths stand in.
"""

from __future__ import annotations

import torch

from phases.p3_4_gather_kernel.checks import INDEX_DTYPES, check_pool, check_tables
from phases.p3_5_paged_attention.kernel_checks import check_query_heads, check_window_and_softcap
from phases.p3_7_varlen_prefill.plan import PrefillPlan

__all__ = ["check_prefill_inputs", "check_window_and_softcap"]


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
                         table_values: bool = True) -> None:
    """q [N, n_heads, head_dim] against the pool, the S segments' tables and lengths, and the plan.
    table_values=False: skip the block ids (for a caller that checks the ids it reads itself)."""
    check_pool(kv_store, layer_idx)
    check_window_and_softcap(sliding_window, softcap)
    block_size = kv_store.shape[4]
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
