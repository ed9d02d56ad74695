"""Compile phase 3.11's fused kernels for an H100 without one: registers, spills and shared memory per kernel.

The same compile step as phases 3.7 and 3.9 (`compile_for_gpu`: Triton IR ->
PTX -> `ptxas -v`, inside the triton wheel, no GPU), over the three kernels as
the fused step launches them for Qwen3-0.6B (hidden 1,024; 16 query heads and 8
KV heads of 128 dims; MLP width 3,072). It says that they build for sm_90 and
what they ask of a thread; not how fast they run.

    python -m measure.fused_aot_check --results-dir results

It runs in its own process: without a GPU the kernel module otherwise switches
Triton's interpreter on for the whole process.
"""

from __future__ import annotations

import argparse
import os
import sys

INTERPRET_ENV = "TRITON_INTERPRET"   # Triton's switch to its CPU interpreter

if "phases.p3_11_fused_ops.kernels" not in sys.modules:
    os.environ[INTERPRET_ENV] = "0"   # compile, do not interpret (must precede the kernels' import)

import torch  # noqa: E402
import triton  # noqa: E402

from measure.prefill_aot_check import (H100_ARCH, TRITON_DTYPES, KernelCost, compile_for_gpu,  # noqa: E402
                                       compiled_report, finish_report)
from phases.p3_11_fused_ops import kernels  # noqa: E402

QWEN3_HIDDEN, QWEN3_HEAD_DIM = 1024, 128
# As a launch specialises them: tensors start aligned, and row strides of these widths are multiples of 16.
NORM_DIVISIBLE = ("x_ptr", "w_ptr", "out_ptr", "n_cols", "s_x_row", "s_out_row")
ROTARY_DIVISIBLE = ("q_ptr", "k_ptr", "cos_ptr", "sin_ptr", "q_out_ptr", "k_out_ptr", "half",
                    "s_q_b", "s_q_h", "s_q_t", "s_k_b", "s_k_h", "s_k_t", "s_qo_b", "s_qo_h", "s_qo_t",
                    "s_ko_b", "s_ko_h", "s_ko_t", "s_c_b", "s_c_t")
SILU_DIVISIBLE = ("gate_ptr", "up_ptr", "out_ptr")


def _require_compiler() -> None:
    if kernels.INTERPRETING:
        raise RuntimeError("the kernel module was imported under Triton's interpreter; run this in a fresh process")


def _signature(fn, pointers: tuple[str, ...], dtype: torch.dtype, floats: tuple[str, ...] = ()) -> dict[str, str]:
    signature = {name: "i32" for name in fn.arg_names}
    signature.update({name: "*" + TRITON_DTYPES[dtype] for name in pointers})
    signature.update({name: "fp32" for name in floats})
    return signature


def compile_rms_norm(dtype: torch.dtype, width: int = QWEN3_HIDDEN, arch: int = H100_ARCH) -> KernelCost:
    """`rms_norm` over rows of `width` (the hidden size; or head_dim for Qwen3's q/k norms)."""
    _require_compiler()
    fn, block = kernels._rms_norm_kernel, triton.next_power_of_2(width)
    return compile_for_gpu(fn, _signature(fn, ("x_ptr", "w_ptr", "out_ptr"), dtype, ("eps",)), dict(BLOCK=block),
                           arch, divisible=NORM_DIVISIBLE, num_warps=kernels.row_warps(block))


def compile_rotary(dtype: torch.dtype, head_dim: int = QWEN3_HEAD_DIM, arch: int = H100_ARCH) -> KernelCost:
    _require_compiler()
    fn = kernels._rotary_kernel
    pointers = ("q_ptr", "k_ptr", "cos_ptr", "sin_ptr", "q_out_ptr", "k_out_ptr")
    return compile_for_gpu(fn, _signature(fn, pointers, dtype), dict(HALF=triton.next_power_of_2(head_dim // 2)),
                           arch, divisible=ROTARY_DIVISIBLE, num_warps=1)


def compile_silu_and_mul(dtype: torch.dtype, arch: int = H100_ARCH) -> KernelCost:
    _require_compiler()
    fn = kernels._silu_and_mul_kernel
    return compile_for_gpu(fn, _signature(fn, ("gate_ptr", "up_ptr", "out_ptr"), dtype),
                           dict(BLOCK=kernels.ELEMENTWISE_BLOCK), arch, divisible=SILU_DIVISIBLE)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m measure.fused_aot_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--results-dir", default=None, help="also save the report there (json + md)")
    args = p.parse_args(argv)
    report = compiled_report("fused_aot", "qwen3-0.6b-shape", "bf16 and fp32")
    t = report.table(f"the fused kernels, compiled for sm_{H100_ARCH} (Qwen3-0.6B's widths)",
                     ["kernel", "dtype", "registers", "spill B / thread", "shared B"])
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for name, cost in ((f"rms_norm, width {QWEN3_HIDDEN}", compile_rms_norm(dtype)),
                           (f"rms_norm, width {QWEN3_HEAD_DIM} (q/k norm)", compile_rms_norm(dtype, QWEN3_HEAD_DIM)),
                           (f"rotary, head_dim {QWEN3_HEAD_DIM}", compile_rotary(dtype)),
                           ("silu_and_mul", compile_silu_and_mul(dtype))):
            t.add_row(name, TRITON_DTYPES[dtype], cost.registers, cost.spill_bytes, cost.shared_bytes)
            rows.append(dict(kernel=name, dtype=TRITON_DTYPES[dtype], **vars(cost)))
    t.notes.append(f"triton {triton.__version__} and the ptxas in its wheel; pointers and row strides marked "
                   "divisible by 16, as a launch specialises them; nothing here is timed")
    finish_report(report, rows, args.results_dir)


if __name__ == "__main__":
    main()
