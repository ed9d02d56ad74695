"""Paged decode attention, tuned: tiles of several blocks, tensor-core dots, and a split count fixed per launch.

Phase 3.5's kernel reads one block per loop trip and sums elementwise, so few bytes are ever in flight. This
one keeps its maths (one program per (sequence, KV head, split), the GQA group served from one load of K/V,
online softmax in fp32) and changes three things:

1. A key tile is TILE_BLOCKS pool blocks, each key finding its block through the table: one trip loads
   TILE x head_dim of K and of V, and `num_stages` trips are in flight at once.
2. Scores and the weighted sum are `tl.dot`s on tensor cores; the group's query heads are padded to 16 rows
   (the smallest `tl.dot` operand). K and V stay in their dtype; accumulators are fp32.
3. The split count is the grid's third axis, fixed per launch so a CUDA graph can replay it; each
   sequence's visible blocks are shared out among the splits inside the kernel.

    for j0 in my blocks, TILE_BLOCKS at a time:
        j      [TILE]        logical block of each key;  phys = block_tables[b, j]
        K, V   [TILE, D]     kv_store[phys, layer, 0/1, g, pos % block_size]
        s      [ROWS, TILE]  tl.dot(q, K^T) * scale -> softcap -> -inf past the length / before the window
        m' = max(m, rowmax s); a = e^(m - m'); l = l * a + rowsum e^(s - m'); acc = acc * a + e^(s - m') @ V
"""

from __future__ import annotations

import torch

from phases.p3_4_gather_kernel.kernel import use_interpreter_without_gpu

# Without a GPU the kernel runs in Triton's CPU interpreter; the switch must be on before `@triton.jit`.
INTERPRETING = use_interpreter_without_gpu()

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from extras.p3_9_tuned_decode_kernel.launch_configs import LaunchConfig, launch_config  # noqa: E402  (speed only)
from phases.p3_4_gather_kernel.checks import require_power_of_two  # noqa: E402
from phases.p3_5_paged_attention.kernel_checks import check_decode_inputs, check_window_and_softcap  # noqa: E402
from phases.p3_5_paged_attention.kernels import NO_SOFTCAP, NO_WINDOW  # noqa: E402
from phases.p3_9_tuned_decode_kernel.merge_kernel import merge_splits_triton  # noqa: E402

MIN_DOT = 16   # the smallest M, N and K `tl.dot` takes on a GPU: query rows and key tiles are padded up to it


@triton.jit
def _tiled_decode_kernel(
    q_ptr, kv_ptr, tables_ptr, lens_ptr, out_ptr, lse_ptr,
    layer_idx, scale, window, softcap,
    s_q_seq, s_q_head, s_q_dim,
    s_blk, s_layer, s_kv, s_head, s_tok, s_dim,
    s_tab_seq, s_tab_blk,
    s_out_seq, s_out_head, s_out_split, s_out_dim,
    s_lse_seq, s_lse_head, s_lse_split,
    GROUP: tl.constexpr, QUERY_ROWS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, TILE_BLOCKS: tl.constexpr,
    WRITE_LSE: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    n_splits = tl.num_programs(2)

    seq_len = tl.load(lens_ptr + seq)
    n_blocks = tl.cdiv(seq_len, BLOCK_SIZE)
    lo = 0                                              # first key position the query sees
    if USE_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    visible = lo // BLOCK_SIZE                          # first block holding a visible key
    per_split = tl.cdiv(n_blocks - visible, n_splits)   # this sequence's blocks, shared out evenly
    first = visible + split * per_split
    last = tl.minimum(first + per_split, n_blocks)

    TILE: tl.constexpr = TILE_BLOCKS * BLOCK_SIZE
    rows = tl.arange(0, QUERY_ROWS)                     # query heads of the group, padded to QUERY_ROWS
    dims = tl.arange(0, HEAD_DIM)
    keys = tl.arange(0, TILE)
    key_block = keys // BLOCK_SIZE                      # which block of the tile each key is in
    key_slot = keys % BLOCK_SIZE                        # and where inside it
    heads = kv_head * GROUP + rows
    row_ok = rows < GROUP
    # The padding rows cost tensor-core work, which decode has to spare (it waits on memory); never stored.
    q = tl.load(q_ptr + seq * s_q_seq + heads[:, None] * s_q_head + dims[None, :] * s_q_dim,
                mask=row_ok[:, None], other=0.0)                                   # [ROWS, D]
    if UPCAST:
        q = q.to(tl.float32)            # the interpreter's bf16 arithmetic is wrong: compute in fp32 there

    m_i = tl.full([QUERY_ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([QUERY_ROWS], tl.float32)
    acc = tl.zeros([QUERY_ROWS, HEAD_DIM], tl.float32)
    head_base = kv_ptr + layer_idx * s_layer + kv_head * s_head
    for j0 in range(first, last, TILE_BLOCKS):
        j = j0 + key_block                                                          # [TILE]
        in_range = j < last
        phys = tl.load(tables_ptr + seq * s_tab_seq + j * s_tab_blk, mask=in_range, other=0).to(tl.int64)
        pos = j * BLOCK_SIZE + key_slot
        valid = in_range & (pos < seq_len) & (pos >= lo)
        addr = head_base + phys[:, None] * s_blk + key_slot[:, None] * s_tok + dims[None, :] * s_dim
        k = tl.load(addr, mask=valid[:, None], other=0.0)                           # [TILE, D]
        v = tl.load(addr + s_kv, mask=valid[:, None], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        # K, V stay in their dtype (bf16 reads half fp32's bytes); fp32 takes IEEE dots, exact against HF.
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale                                                               # [ROWS, TILE] fp32
        if USE_SOFTCAP:
            s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)              # c * tanh(s / c)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))      # finite: a tile's first block holds a visible key
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    # An empty range (a split past the end, a padding row of length 0) writes zeros and lse -inf.
    has_any = l_i > 0
    out = acc / tl.where(has_any, l_i, 1.0)[:, None]
    dst = out_ptr + seq * s_out_seq + heads[:, None] * s_out_head + split * s_out_split + dims[None, :] * s_out_dim
    tl.store(dst, out, mask=row_ok[:, None])
    if WRITE_LSE:
        lse = tl.where(has_any, m_i + tl.log(tl.where(has_any, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + seq * s_lse_seq + heads * s_lse_head + split * s_lse_split, lse, mask=row_ok)


def tiled_decode_attention(q: torch.Tensor, kv_store: torch.Tensor, layer_idx: int, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float | None = None, n_splits: int = 1,
                           sliding_window: int | None = None, softcap: float | None = None,
                           config: LaunchConfig | None = None, check_values: bool = True) -> torch.Tensor:
    """q [B, n_heads, head_dim] -> [B, n_heads, head_dim] in q's dtype; phase 3.5's arguments, and
    n_splits: programs per (sequence, KV head) (split_rule.py); above 1, partials merged by merge_kernel.py.
    config: the launch (default: `launch_config`). check_values=False: shapes only (checked once per pass)."""
    check_decode_inputs(q, kv_store, layer_idx, block_tables, seq_lens, values=check_values)
    check_window_and_softcap(sliding_window, softcap)
    require_power_of_two("block_size", kv_store.shape[4])
    require_power_of_two("head_dim", kv_store.shape[5])
    if kv_store.shape[5] < MIN_DOT:
        raise ValueError(f"head_dim {kv_store.shape[5]} is below {MIN_DOT}, the smallest dimension `tl.dot` takes on a "
                         "GPU; phase 3.5's kernel (paged_decode_attention_triton) serves such small heads")
    if isinstance(n_splits, bool) or not isinstance(n_splits, int) or n_splits < 1:
        raise ValueError(f"n_splits must be an int >= 1, got {n_splits!r}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    batch, n_heads, head_dim = q.shape
    n_kv_heads, block_size = kv_store.shape[3], kv_store.shape[4]
    group = n_heads // n_kv_heads
    config = config or launch_config(head_dim, kv_store.dtype)
    if n_splits == 1:
        out = torch.empty(batch, n_heads, 1, head_dim, dtype=q.dtype, device=q.device)
        lse = None
    else:
        out = torch.empty(batch, n_heads, n_splits, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(batch, n_heads, n_splits, dtype=torch.float32, device=q.device)
    if batch:
        _tiled_decode_kernel[(batch, n_kv_heads, n_splits)](
            q, kv_store, block_tables, seq_lens, out, lse if lse is not None else out,
            layer_idx, float(scale), int(sliding_window or NO_WINDOW), float(softcap or NO_SOFTCAP),
            *q.stride(), *kv_store.stride(), *block_tables.stride(), *out.stride(),
            *(lse.stride() if lse is not None else (0, 0, 0)),
            GROUP=group, QUERY_ROWS=max(MIN_DOT, triton.next_power_of_2(group)),
            BLOCK_SIZE=block_size, HEAD_DIM=head_dim, TILE_BLOCKS=config.tile_blocks_for(block_size, MIN_DOT),
            WRITE_LSE=lse is not None, USE_WINDOW=sliding_window is not None, USE_SOFTCAP=softcap is not None,
            UPCAST=INTERPRETING, IEEE=kv_store.dtype == torch.float32 or INTERPRETING,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
    if lse is None:
        return out[:, :, 0]
    return merge_splits_triton(out, lse, q.dtype)       # [B, H, S, D] fp32 -> [B, H, D] in q's dtype
