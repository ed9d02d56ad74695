"""Varlen paged prefill attention as one Triton kernel: every segment of a packed prefill, one launch per layer.

Flash-attention style. The queries of S segments are packed, q [N, n_heads, head_dim]; each segment's K/V
(its cached context and its own new tokens, already written) are read in place through its block table.

Grid: (n_tiles, n_heads). Program (t, h) computes query tile t (plan.py) for query head h, reading KV head
h // group. With p = context_lens[seg] + i the position of the tile's query row i:

    Q          [BLOCK_M, D]        rows first .. first + BLOCK_M - 1 of segment seg, loaded once
    m, l, acc  [BLOCK_M], [BLOCK_M], [BLOCK_M, D]     fp32 running max, sum, weighted V
    for key tile [start, start + BLOCK_N) in lo .. hi:   (positions of this sequence)
        phys   = block_tables[seg, pos // block_size]       one table entry per key: a key tile may span
        K, V   [BLOCK_N, D]  from kv_store[phys, layer, 0/1, kv_head, pos % block_size]   several pool blocks,
        s      = Q @ K^T * scale  (tl.dot)  -> softcap -> -inf where not visible         or part of one
        online softmax: m' = max(m, rowmax s); a = 2^(m - m'); l = l * a + rowsum 2^(s - m')
                        acc = acc * a + 2^(s - m') @ V (tl.dot);  m = m'
    out rows = acc / l               cast to q's dtype on store

Key tiles the tile cannot see are never visited (lo and hi, causal and windowed); scores are kept in base 2.
"""

from __future__ import annotations

import math

import torch

from phases.p3_4_gather_kernel.kernel import use_interpreter_without_gpu

INTERPRETING = use_interpreter_without_gpu()   # before `@triton.jit`: without a GPU, Triton's interpreter

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from extras.p3_7_varlen_prefill.tile_configs import tile_config  # noqa: E402  (speed-only launch table)
from phases.p3_4_gather_kernel.checks import require_power_of_two  # noqa: E402
from phases.p3_7_varlen_prefill.checks import check_prefill_inputs  # noqa: E402
from phases.p3_7_varlen_prefill.plan import DEFAULT_BLOCK_M, MIN_DOT_TILE, PrefillPlan, plan_prefill  # noqa: E402

LOG2E = tl.constexpr(math.log2(math.e))   # e^x = 2^(x * log2 e)
NO_WINDOW = 0      # the kernel's `window` argument when the layer has none (never read then)
NO_SOFTCAP = 1.0   # its `softcap` argument when the layer has none (never read then)


@triton.jit
def _paged_prefill_kernel(
    q_ptr, kv_ptr, tables_ptr, cu_ptr, ctx_ptr, tiles_ptr, out_ptr,
    layer_idx, scale, softcap, window,
    s_tile, s_tile_field,
    s_q_tok, s_q_head, s_q_dim,
    s_blk, s_layer, s_kv, s_head, s_tok, s_dim,
    s_tab_seg, s_tab_blk,
    s_out_tok, s_out_head, s_out_dim,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, UPCAST: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP

    # Which segment this tile belongs to, and where it starts inside it (the plan).
    seg = tl.load(tiles_ptr + tile * s_tile)
    first = tl.load(tiles_ptr + tile * s_tile + s_tile_field)
    seg_start = tl.load(cu_ptr + seg)
    seg_len = tl.load(cu_ptr + seg + 1) - seg_start
    context = tl.load(ctx_ptr + seg)

    rows = first + tl.arange(0, BLOCK_M)                       # [M] query rows inside the segment
    row_ok = rows < seg_len                                    # the last tile of a segment is partial
    q_pos = context + rows                                     # [M] absolute positions
    dims = tl.arange(0, HEAD_DIM)
    tok = (seg_start + rows).to(tl.int64)                      # [M] rows of the packed q / out
    q = tl.load(q_ptr + tok[:, None] * s_q_tok + head * s_q_head + dims[None, :] * s_q_dim,
                mask=row_ok[:, None], other=0.0)               # [M, D]
    if UPCAST:
        q = q.to(tl.float32)

    # Keys [lo, hi): hi is one past the last query's position (causal); with a window w, lo is the
    # first key the first query still sees (p - w + 1). Earlier or later key tiles are never loaded.
    hi = context + tl.minimum(first + BLOCK_M, seg_len)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(context + first - window + 1, 0)
    qk_scale = scale * LOG2E                                   # scores in base 2: exp2 is the cheaper instruction

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)        # running max of the scores (base 2)
    l_i = tl.zeros([BLOCK_M], tl.float32)                      # running sum of 2^(s - m_i)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)            # running sum of 2^(s - m_i) * V
    table = tables_ptr + seg.to(tl.int64) * s_tab_seg
    head_base = kv_ptr + layer_idx * s_layer + kv_head * s_head
    for start in range(lo, hi, BLOCK_N):
        k_pos = start + tl.arange(0, BLOCK_N)                  # [N] key positions in the sequence
        k_ok = k_pos < hi
        # One table entry per key: the tile may cross pool blocks (block_size < BLOCK_N) or cover
        # part of one (block_size > BLOCK_N), and a sequence's blocks are scattered in the pool.
        phys = tl.load(table + (k_pos // BLOCK_SIZE) * s_tab_blk, mask=k_ok, other=0).to(tl.int64)
        kv_rows = head_base + phys * s_blk + (k_pos % BLOCK_SIZE) * s_tok          # [N]
        k = tl.load(kv_rows[:, None] + dims[None, :] * s_dim, mask=k_ok[:, None], other=0.0)   # [N, D]
        v = tl.load(kv_rows[:, None] + s_kv + dims[None, :] * s_dim, mask=k_ok[:, None], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        # fp16/bf16 tiles go to `tl.dot` as they are (fp32 accumulation; p rounded to V's dtype, as
        # flash-attention does); fp32 tiles take "ieee", no TF32, so fp32 runs compare token for token.
        s = tl.dot(q, tl.trans(k), input_precision="ieee")     # [M, N] fp32
        if USE_SOFTCAP:
            s = s * scale
            s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)   # c * tanh(s / c)
            s = s * LOG2E
        else:
            s = s * qk_scale
        # Inside [lo, hi) a per-element mask does the rest: the diagonal, the window's edge.
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]    # causal, inside this sequence
        if USE_WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row that has seen no visible key yet keeps m = -inf; subtract 0 there, not -inf (NaN).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)                          # rescales what was summed under the old max
        p = tl.exp2(s - m_safe[:, None])                       # [M, N], 0 where not visible
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    # Every real row sees at least itself, so l_i > 0 there; padding rows are not stored.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    dst = out_ptr + tok[:, None] * s_out_tok + head * s_out_head + dims[None, :] * s_out_dim
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def paged_prefill_attention_triton(q: torch.Tensor, kv_store: torch.Tensor, layer_idx: int,
                                   block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                   context_lens: torch.Tensor, scale: float | None = None,
                                   sliding_window: int | None = None, softcap: float | None = None,
                                   plan: PrefillPlan | None = None, block_n: int | None = None) -> torch.Tensor:
    """One launch for the whole packed prefill: q [N, n_heads, head_dim] -> [N, n_heads, head_dim], q's dtype.
    plan: `plan_prefill(...)`, once per pass (its block_m is BLOCK_M); block_n: key rows per tile."""
    if plan is None:
        plan = plan_prefill(cu_seqlens_q, context_lens, DEFAULT_BLOCK_M, device=q.device)
    check_prefill_inputs(q, kv_store, layer_idx, block_tables, cu_seqlens_q, context_lens, plan,
                         sliding_window, softcap)
    head_dim = kv_store.shape[5]
    require_power_of_two("head_dim", head_dim)
    config = tile_config(head_dim, q.dtype)
    block_n = config.block_n if block_n is None else block_n
    require_power_of_two("block_n", block_n)
    if min(head_dim, block_n) < MIN_DOT_TILE:
        raise ValueError(f"head_dim ({head_dim}) and block_n ({block_n}) must be >= {MIN_DOT_TILE} for tl.dot; "
                         f"use the PyTorch path (ops.paged_prefill_attention on CPU) for smaller heads")
    if q.dtype != kv_store.dtype:
        raise ValueError(f"q ({q.dtype}) and kv_store ({kv_store.dtype}) must share a dtype: tl.dot takes one")
    if plan.tiles.device != q.device:
        raise ValueError(f"plan.tiles is on {plan.tiles.device}; make the plan with device={q.device}")
    scale = head_dim ** -0.5 if scale is None else scale
    n_heads = q.shape[1]
    out = q.new_empty(q.shape)                                         # [N, H, D], contiguous
    if plan.n_tiles == 0:
        return out
    _paged_prefill_kernel[(plan.n_tiles, n_heads)](
        q, kv_store, block_tables, cu_seqlens_q, context_lens, plan.tiles, out,
        layer_idx, float(scale), float(softcap or NO_SOFTCAP), int(sliding_window or NO_WINDOW),
        *plan.tiles.stride(), *q.stride(), *kv_store.stride(), *block_tables.stride(), *out.stride(),
        GROUP=n_heads // kv_store.shape[3], BLOCK_SIZE=kv_store.shape[4], HEAD_DIM=head_dim,
        BLOCK_M=plan.block_m, BLOCK_N=block_n,
        USE_WINDOW=sliding_window is not None, USE_SOFTCAP=softcap is not None, UPCAST=INTERPRETING,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out
