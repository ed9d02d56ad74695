"""Triton kernels of the paged engine: fused paged decode attention and the K/V store that writes new tokens
into the pool. (The grid's split axis serves a split-KV variant kept in extras/p3_5_paged_attention/split_kv.py.)

Decode attention, one query token per sequence:

    out[b, h] = softmax(q[b, h] . K[b, kv(h)]^T * scale) @ V[b, kv(h)]

where K[b, g] and V[b, g] are read *in place* from the pool through the block table, never gathered into a
contiguous copy first.

Grid: (B, n_kv_heads, n_splits). Program (b, g, s) serves KV head g of sequence b and ALL the query heads
that share it (GQA group of n_heads / n_kv_heads). Why the whole group and not one query head: decode is
bound by memory traffic (each K/V element is used for one multiply-add per query head), so loading a K/V
tile once and scoring it against every query head of the group divides the bytes read by the group size.
The group is small (1 to 8), below the 16 rows `tl.dot` needs on a GPU, so the scores are an elementwise
multiply and a sum over head_dim rather than a tensor-core dot. Each program walks its blocks in order:

    for j in its blocks:                        phys = block_tables[b, j]
        K_j, V_j   [BLOCK_SIZE, HEAD_DIM]       one dense tile each from kv_store[phys, layer, 0/1, g]
        s          [GROUP, BLOCK_SIZE]          q . K_j^T * scale, -inf past seq_len
        online softmax: m_new = max(m, rowmax s); acc = acc * e^(m - m_new) + e^(s - m_new) @ V_j
                        l = l * e^(m - m_new) + rowsum e^(s - m_new)
    out = acc / l                                (fp32 throughout, cast to q's dtype on store)
"""

from __future__ import annotations

import torch

from phases.p3_4_gather_kernel.kernel import use_interpreter_without_gpu

use_interpreter_without_gpu()   # before `@triton.jit`: without a GPU, Triton's interpreter

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from phases.p3_4_gather_kernel.checks import next_power_of_two, require_power_of_two  # noqa: E402
from phases.p3_5_paged_attention.kernel_checks import (check_decode_inputs, check_window_and_softcap,  # noqa: E402
                                                       check_write_inputs)

NO_WINDOW = 0      # the kernel's `window` argument when the layer has none (never read then)
NO_SOFTCAP = 1.0   # its `softcap` argument when the layer has none (never read then)


# A layer with a sliding window w (Mistral; Gemma 2's local layers) sees only the last w keys: the loop starts
# at the block holding position seq_len - w (earlier blocks are never loaded) and masks the slots before it.
# A layer with a logit softcap c (Gemma 2) bends every score to c * tanh(s / c) before the max.
@triton.jit
def _paged_decode_kernel(
    q_ptr, kv_ptr, tables_ptr, lens_ptr, out_ptr, lse_ptr,
    layer_idx, scale, blocks_per_split, window, softcap,
    s_q_seq, s_q_head, s_q_dim,
    s_blk, s_layer, s_kv, s_head, s_tok, s_dim,
    s_tab_seq, s_tab_blk,
    s_out_seq, s_out_head, s_out_split, s_out_dim,
    s_lse_seq, s_lse_head, s_lse_split,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, WRITE_LSE: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)

    seq_len = tl.load(lens_ptr + seq)
    n_blocks = tl.cdiv(seq_len, BLOCK_SIZE)
    first = split * blocks_per_split
    last = tl.minimum(first + blocks_per_split, n_blocks)
    lo = 0                                             # first key position this layer lets the query see
    if USE_WINDOW:
        lo = tl.maximum(seq_len - window, 0)           # the query sits at seq_len - 1: keys seq_len - w ..
        first = tl.maximum(first, lo // BLOCK_SIZE)    # blocks wholly before the window are never loaded

    g = tl.arange(0, GROUP_PAD)                        # query head inside the group (padded)
    dims = tl.arange(0, HEAD_DIM)
    offs = tl.arange(0, BLOCK_SIZE)
    heads = kv_head * GROUP + g                        # [G] query heads served here
    g_ok = g < GROUP
    # Loads are cast to fp32: accumulation precision, and the interpreter's bf16 maths is wrong.
    q = tl.load(q_ptr + seq * s_q_seq + heads[:, None] * s_q_head + dims[None, :] * s_q_dim,
                mask=g_ok[:, None], other=0.0).to(tl.float32)
    q = q * scale                                      # [G, D]

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)   # running max of the scores
    l_i = tl.zeros([GROUP_PAD], tl.float32)                  # running sum of e^(s - m_i)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)        # running sum of e^(s - m_i) * V
    head_base = kv_ptr + layer_idx * s_layer + kv_head * s_head
    for j in range(first, last):
        phys = tl.load(tables_ptr + seq * s_tab_seq + j * s_tab_blk).to(tl.int64)
        tile = head_base + phys * s_blk + offs[:, None] * s_tok + dims[None, :] * s_dim   # [BS, D]
        pos = j * BLOCK_SIZE + offs                                                      # [BS]
        valid = (pos < seq_len) & (pos >= lo)
        k = tl.load(tile, mask=valid[:, None], other=0.0).to(tl.float32)
        v = tl.load(tile + s_kv, mask=valid[:, None], other=0.0).to(tl.float32)

        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)                                 # [G, BS]
        if USE_SOFTCAP:
            s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)                     # c * tanh(s / c)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))     # finite: every visited block has a valid slot
        alpha = tl.exp(m_i - m_new)                    # rescales what was summed under the old max
        p = tl.exp(s - m_new[:, None])                                                   # [G, BS]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)        # [G, D]
        m_i = m_new

    # An empty range (a split past the end, or seq_len 0) leaves l_i = 0: write zeros, lse -inf.
    has_any = l_i > 0
    out = acc / tl.where(has_any, l_i, 1.0)[:, None]
    dst = out_ptr + seq * s_out_seq + heads[:, None] * s_out_head + split * s_out_split + dims[None, :] * s_out_dim
    tl.store(dst, out, mask=g_ok[:, None])
    if WRITE_LSE:
        lse = tl.where(has_any, m_i + tl.log(tl.where(has_any, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + seq * s_lse_seq + heads * s_lse_head + split * s_lse_split, lse, mask=g_ok)


def _launch(q, kv_store, layer_idx, block_tables, seq_lens, scale, out, lse, blocks_per_split, n_splits,
            sliding_window=None, softcap=None):
    batch, n_heads, head_dim = q.shape
    n_kv_heads, block_size = kv_store.shape[3], kv_store.shape[4]
    group = n_heads // n_kv_heads
    lse_arg = lse if lse is not None else out          # never touched when WRITE_LSE is False
    lse_strides = lse.stride() if lse is not None else (0, 0, 0)
    _paged_decode_kernel[(batch, n_kv_heads, n_splits)](
        q, kv_store, block_tables, seq_lens, out, lse_arg,
        layer_idx, float(scale), blocks_per_split, int(sliding_window or NO_WINDOW), float(softcap or NO_SOFTCAP),
        *q.stride(), *kv_store.stride(), *block_tables.stride(), *out.stride(), *lse_strides,
        GROUP=group, GROUP_PAD=next_power_of_two(group),
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, WRITE_LSE=lse is not None,
        USE_WINDOW=sliding_window is not None, USE_SOFTCAP=softcap is not None,
    )


def _check_kernel_shapes(kv_store: torch.Tensor) -> None:
    require_power_of_two("block_size", kv_store.shape[4])
    require_power_of_two("head_dim", kv_store.shape[5])


def paged_decode_attention_triton(q: torch.Tensor, kv_store: torch.Tensor, layer_idx: int,
                                  block_tables: torch.Tensor, seq_lens: torch.Tensor,
                                  scale: float | None = None, sliding_window: int | None = None,
                                  softcap: float | None = None) -> torch.Tensor:
    """One launch for the batch: q [B, n_heads, head_dim] -> [B, n_heads, head_dim] in q's dtype."""
    check_decode_inputs(q, kv_store, layer_idx, block_tables, seq_lens)
    check_window_and_softcap(sliding_window, softcap)
    _check_kernel_shapes(kv_store)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    batch, n_heads, head_dim = q.shape
    out = torch.empty(batch, n_heads, 1, head_dim, dtype=q.dtype, device=q.device)  # split axis of size 1
    if batch:
        _launch(q, kv_store, layer_idx, block_tables, seq_lens, scale, out, None,
                blocks_per_split=max(block_tables.shape[1], 1), n_splits=1,
                sliding_window=sliding_window, softcap=softcap)
    return out[:, :, 0]


@triton.jit
def _write_kv_kernel(
    kv_ptr, k_ptr, v_ptr, slots_ptr, layer_idx,
    s_blk, s_layer, s_kv, s_head, s_tok, s_dim,
    s_in_tok, s_in_head, s_in_dim,                   # k and v share strides (checked on the host)
    N_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    # Program t stores token t's K and V, all KV heads: one [H, D] tile each.
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + tok).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM)
    mask = (heads < N_KV_HEADS)[:, None] & (slot >= 0)  # slot -1 marks a padding token: no write
    src = tok * s_in_tok + heads[:, None] * s_in_head + dims[None, :] * s_in_dim
    k = tl.load(k_ptr + src, mask=mask)
    v = tl.load(v_ptr + src, mask=mask)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    dst = (kv_ptr + block * s_blk + layer_idx * s_layer + offset * s_tok
           + heads[:, None] * s_head + dims[None, :] * s_dim)
    tl.store(dst, k.to(kv_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + s_kv, v.to(kv_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(kv_store: torch.Tensor, layer_idx: int, k: torch.Tensor, v: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """Store k, v [T, n_kv_heads, head_dim] at slots [T] (slot = block * block_size + offset; -1 skips)."""
    check_write_inputs(kv_store, layer_idx, k, v, slot_mapping)
    require_power_of_two("head_dim", kv_store.shape[5])
    if k.stride() != v.stride():  # the kernel takes one set of input strides for both
        k, v = k.contiguous(), v.contiguous()
    n_tokens, n_kv_heads = k.shape[0], k.shape[1]
    if n_tokens == 0:
        return
    _write_kv_kernel[(n_tokens,)](
        kv_store, k, v, slot_mapping, layer_idx,
        *kv_store.stride(), *k.stride(),
        N_KV_HEADS=n_kv_heads, HEADS_PAD=next_power_of_two(n_kv_heads),
        BLOCK_SIZE=kv_store.shape[4], HEAD_DIM=kv_store.shape[5],
    )
