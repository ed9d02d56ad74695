"""The gather as one Triton kernel: every sequence, every block, every KV head in one launch.

Grid: (B, ceil(max_len / block_size), n_kv_heads). Program (b, j, h) copies
logical block j of sequence b for KV head h, K and V:

    block_tables[b, j] = phys
    kv_store[phys, layer, 0, h, 0:block_size, 0:head_dim]  ->  k_out[b, h, j*bs : (j+1)*bs, :]
    kv_store[phys, layer, 1, h, 0:block_size, 0:head_dim]  ->  v_out[b, h, j*bs : (j+1)*bs, :]

Two dense loads, two dense stores per program. Slots past seq_len[b] are not
read (masked) and written as zeros; a block wholly past the end does not even
read its table entry.
"""

from __future__ import annotations

import importlib
import os
import sys

import torch

INTERPRET_ENV = "TRITON_INTERPRET"


def use_interpreter_without_gpu() -> bool:
    """Without CUDA, run Triton kernels in its CPU interpreter (each program in Python). Returns whether on.

    The switch is read when `@triton.jit` decorates, so call this before defining kernels. Triton's
    own `tl.sum`, ... are jitted when `triton` is first imported (torch._dynamo does so as a model
    loads): if that came first, rebuild them."""
    if not torch.cuda.is_available():
        os.environ.setdefault(INTERPRET_ENV, "1")
    interpreting = os.environ.get(INTERPRET_ENV, "0") == "1"
    if interpreting and "triton.language" in sys.modules:
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction
        if not isinstance(tl.standard.sum, InterpretedFunction):
            importlib.reload(tl.standard)  # re-decorate tl.sum, tl.max, ... now that the switch is on
            importlib.reload(tl)           # and rebind the `tl.` names to them
    return interpreting


use_interpreter_without_gpu()   # before the `@triton.jit` below

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from phases.p3_4_gather_kernel.checks import check_paged_inputs, require_power_of_two  # noqa: E402
from phases.p3_4_gather_kernel.reference import max_length  # noqa: E402


@triton.jit
def _gather_kv_kernel(
    kv_ptr, tables_ptr, lens_ptr, k_out_ptr, v_out_ptr,
    layer_idx, max_len,
    s_blk, s_layer, s_kv, s_head, s_tok, s_dim,      # pool strides
    s_tab_seq, s_tab_blk,                            # block-table strides
    s_out_seq, s_out_head, s_out_tok, s_out_dim,     # output strides (k_out and v_out share them)
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    head = tl.program_id(2).to(tl.int64)

    seq_len = tl.load(lens_ptr + seq)
    offs = tl.arange(0, BLOCK_SIZE)                  # [BS] slot inside the block
    dims = tl.arange(0, HEAD_DIM)                    # [D]
    pos = blk * BLOCK_SIZE + offs                    # [BS] token position in the sequence
    valid = pos < seq_len

    # The block-table entry is only read when this block holds at least one token.
    phys = tl.load(tables_ptr + seq * s_tab_seq + blk * s_tab_blk,
                   mask=blk * BLOCK_SIZE < seq_len, other=0).to(tl.int64)
    src = (kv_ptr + phys * s_blk + layer_idx * s_layer + head * s_head
           + offs[:, None] * s_tok + dims[None, :] * s_dim)               # [BS, D] pointers (K)
    k = tl.load(src, mask=valid[:, None], other=0.0)
    v = tl.load(src + s_kv, mask=valid[:, None], other=0.0)

    dst = seq * s_out_seq + head * s_out_head + pos[:, None] * s_out_tok + dims[None, :] * s_out_dim
    in_out = (pos < max_len)[:, None]
    tl.store(k_out_ptr + dst, k, mask=in_out)
    tl.store(v_out_ptr + dst, v, mask=in_out)


def gather_triton(kv_store: torch.Tensor, layer_idx: int, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, max_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `gather_reference`: (k, v) each [B, n_kv_heads, max_len, head_dim], zero-padded."""
    check_paged_inputs(kv_store, layer_idx, block_tables, seq_lens)
    _, _, _, n_kv_heads, block_size, head_dim = kv_store.shape
    require_power_of_two("block_size", block_size)
    require_power_of_two("head_dim", head_dim)
    batch = block_tables.shape[0]
    max_len = max_length(seq_lens, max_len)
    if max_len > block_tables.shape[1] * block_size:
        raise ValueError(f"max_len {max_len} exceeds what block_tables can address "
                         f"({block_tables.shape[1]} blocks x {block_size})")

    k_out = torch.empty(batch, n_kv_heads, max_len, head_dim, dtype=kv_store.dtype, device=kv_store.device)
    v_out = torch.empty_like(k_out)
    if batch == 0 or max_len == 0:
        return k_out, v_out
    grid = (batch, triton.cdiv(max_len, block_size), n_kv_heads)
    _gather_kv_kernel[grid](
        kv_store, block_tables, seq_lens, k_out, v_out,
        layer_idx, max_len,
        *kv_store.stride(), *block_tables.stride(), *k_out.stride(),
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
    )
    return k_out, v_out
