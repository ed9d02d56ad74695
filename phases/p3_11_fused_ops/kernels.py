"""Three Triton kernels that each do in one launch what the model's PyTorch code does in several.

In a CUDA graph every kernel still starts, reads HBM, writes back and drains before the next one starts,
and most of a decode step's kernels are tiny element-wise ops on one row per sequence:

    RMSNorm   to(fp32), pow, mean, add eps, rsqrt, mul, to(dtype), mul weight   8 kernels -> 1
    rotary    q*cos, cat(-q2, q1)*sin, add; the same for k                     ~10 kernels -> 1
    SwiGLU    silu(gate), * up                                                  2 kernels -> 1

Each computes in fp32 registers and rounds where the model's PyTorch code rounds (`rotary` once, at the
end: in bf16 up to an ulp apart); none reads a tensor value on the host, so a graph can capture them.
Triton's CPU interpreter truncates fp32 -> bf16, so bf16 is checked exactly only on a GPU.
"""

from __future__ import annotations

import torch

from phases.p3_4_gather_kernel.kernel import use_interpreter_without_gpu

INTERPRETING = use_interpreter_without_gpu()   # before `@triton.jit`: without a GPU, Triton's interpreter

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

ELEMENTWISE_BLOCK = 1024       # elements per program of silu_and_mul (a flat, contiguous range)
ROW_WARPS = ((256, 1), (1024, 4), (4096, 8))   # (row width up to, warps) for one program per row: wider rows, more
MAX_ROW_WARPS = 16                             # threads to load them; beyond the table, the most


def row_warps(block: int) -> int:
    """Warps for a program that holds one row of `block` lanes (a power of two)."""
    return next((warps for width, warps in ROW_WARPS if block <= width), MAX_ROW_WARPS)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, n_cols, s_x_row, s_out_row, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)                          # [BLOCK] the row, padded to a power of two
    ok = cols < n_cols
    x = tl.load(x_ptr + row * s_x_row + cols, mask=ok, other=0.0).to(tl.float32)
    mean_square = tl.sum(x * x, axis=0) / n_cols
    y = x * tl.rsqrt(mean_square + eps)
    # The model rounds the normalised row to its dtype, then multiplies by the weight in that dtype.
    y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * s_out_row + cols, (w * y).to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., n] -> weight * (x / sqrt(mean(x^2) + eps)) [..., n] in x's dtype (Llama's and Qwen3's RMSNorm:
    the statistics in fp32, the normalised row rounded to x's dtype before the weight)."""
    n = x.shape[-1]
    if weight.shape != (n,) or weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(f"weight must be [{n}] in {x.dtype} on {x.device}, got {tuple(weight.shape)} "
                         f"{weight.dtype} on {weight.device}")
    rows = x.reshape(-1, n)                              # a view when x's rows are evenly spaced (no copy)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.numel():
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, n, rows.stride(0), out.stride(0), eps,
                                           BLOCK=block, num_warps=row_warps(block))
    return out.view(x.shape)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, seq_len, n_q_heads, half,
                   s_q_b, s_q_h, s_q_t, s_k_b, s_k_h, s_k_t, s_qo_b, s_qo_h, s_qo_t, s_ko_b, s_ko_h, s_ko_t,
                   s_c_b, s_c_t, HALF: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)                # b * seq_len + t
    head = tl.program_id(1).to(tl.int64)                 # 0 .. n_q_heads-1: a query head; then the key heads
    b = token // seq_len
    t = token % seq_len
    if head < n_q_heads:
        src = q_ptr + b * s_q_b + head * s_q_h + t * s_q_t
        dst = q_out_ptr + b * s_qo_b + head * s_qo_h + t * s_qo_t
    else:
        src = k_ptr + b * s_k_b + (head - n_q_heads) * s_k_h + t * s_k_t
        dst = k_out_ptr + b * s_ko_b + (head - n_q_heads) * s_ko_h + t * s_ko_t
    i = tl.arange(0, HALF)                               # [HALF] one half of head_dim
    ok = i < half
    x1 = tl.load(src + i, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + half + i, mask=ok, other=0.0).to(tl.float32)
    trig = b * s_c_b + t * s_c_t
    c1 = tl.load(cos_ptr + trig + i, mask=ok, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + trig + half + i, mask=ok, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + trig + i, mask=ok, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + trig + half + i, mask=ok, other=0.0).to(tl.float32)
    # x * cos + rotate_half(x) * sin, where rotate_half(x) = cat(-x2, x1)
    tl.store(dst + i, (x1 * c1 - x2 * s1).to(q_out_ptr.dtype.element_ty), mask=ok)
    tl.store(dst + half + i, (x2 * c2 + x1 * s2).to(q_out_ptr.dtype.element_ty), mask=ok)


def rotary_refusal(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> str | None:
    """Why `rotary` cannot take these tensors, or None when it can."""
    if q.dim() != 4:
        return f"q must be [B, Hq, T, D], got {tuple(q.shape)}"
    batch, _, seq_len, head_dim = q.shape
    if k.dim() != 4 or k.shape[0] != batch or k.shape[2:] != (seq_len, head_dim):
        return f"k must be [{batch}, Hk, {seq_len}, {head_dim}] like q, got {tuple(k.shape)}"
    if cos.shape != (batch, seq_len, head_dim) or sin.shape != cos.shape:
        return f"cos and sin must be [{batch}, {seq_len}, {head_dim}], got {tuple(cos.shape)} and {tuple(sin.shape)}"
    if head_dim % 2 or not (q.dtype == k.dtype == cos.dtype == sin.dtype) or q.stride(-1) != 1 \
            or k.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride() != cos.stride():
        return "rotary needs an even head_dim, q, k, cos and sin of one dtype, and contiguous last dims"
    return None


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, Hq, T, D], k [B, Hk, T, D], cos and sin [B, T, D] -> (q, k) rotated (HF's `apply_rotary_pos_emb`
    with its default layout): one launch for every query and key head."""
    refusal = rotary_refusal(q, k, cos, sin)
    if refusal:
        raise ValueError(refusal)
    batch, n_q_heads, seq_len, head_dim = q.shape
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)   # the inputs' layout (HF's ops keep it too)
    if q.numel():
        half = head_dim // 2
        _rotary_kernel[(batch * seq_len, n_q_heads + k.shape[1])](
            q, k, cos, sin, q_out, k_out, seq_len, n_q_heads, half,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            q_out.stride(0), q_out.stride(1), q_out.stride(2), k_out.stride(0), k_out.stride(1), k_out.stride(2),
            cos.stride(0), cos.stride(1), HALF=triton.next_power_of_2(half), num_warps=1)
    return q_out, k_out


@triton.jit
def _silu_and_mul_kernel(gate_ptr, up_ptr, out_ptr, n, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    i = start + tl.arange(0, BLOCK)
    ok = i < n
    g = tl.load(gate_ptr + i, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + i, mask=ok, other=0.0).to(tl.float32)
    a = (g * tl.sigmoid(g)).to(out_ptr.dtype.element_ty).to(tl.float32)   # silu's output, rounded as the model's
    tl.store(out_ptr + i, (a * u).to(out_ptr.dtype.element_ty), mask=ok)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, elementwise, for gate and up of one shape and dtype: the input of SwiGLU's down_proj."""
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        raise ValueError(f"gate and up must match, got {tuple(gate.shape)} {gate.dtype} and {tuple(up.shape)} "
                         f"{up.dtype}")
    gate, up = gate.contiguous(), up.contiguous()        # nn.Linear's outputs already are: no copy
    out = torch.empty_like(gate)
    n = gate.numel()
    if n:
        _silu_and_mul_kernel[(triton.cdiv(n, ELEMENTWISE_BLOCK),)](gate, up, out, n, BLOCK=ELEMENTWISE_BLOCK)
    return out
