"""Compile phase 3.7's prefill kernel for an H100 without one: does it build, and what does it cost per thread?

Triton compiles ahead of time for a named target: Python -> Triton IR -> PTX ->
a cubin, through the `ptxas` that ships inside the triton wheel. None of that
needs a GPU. Running the kernel does, so this checks only what compilation
can: that every variant builds for sm_90, and the registers, spilled bytes
and shared memory each variant asks for (`ptxas -v`). The tile configs in
phases/p3_7_varlen_prefill/kernel.py were picked with it: among a few candidates, the largest tiles that
built without spilling registers.

    python -m measure.prefill_aot_check        # the table, one row per config

It must run in its own process: with no GPU the kernel module normally turns on
Triton's interpreter, which replaces the compiler for the whole process.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

INTERPRET_ENV = "TRITON_INTERPRET"   # Triton's switch to its CPU interpreter

if "phases.p3_7_varlen_prefill.kernel" not in sys.modules:
    os.environ[INTERPRET_ENV] = "0"   # compile, do not interpret (must precede the kernel's import)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402

from measure.report import Report, environment_meta  # noqa: E402
from extras.p3_7_varlen_prefill import tile_configs  # noqa: E402
from phases.p3_7_varlen_prefill import kernel  # noqa: E402

H100_ARCH = 90
WARP_SIZE = 32
ALIGNMENT = 16      # what Triton's launch checks pointers and integer arguments against ("tt.divisibility")
TRITON_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
POINTER_ARGS = ("q_ptr", "kv_ptr", "out_ptr")                     # in the attention dtype
INDEX_POINTER_ARGS = ("tables_ptr", "cu_ptr", "ctx_ptr", "tiles_ptr")
FLOAT_ARGS = ("scale", "softcap")
UNIT_STRIDES = ("s_q_dim", "s_dim", "s_out_dim", "s_tile_field")  # contiguous last dims: Triton specialises 1s
# What a launch marks divisible by 16: tensors start aligned, and strides over head_dim-sized axes are multiples.
DIVISIBLE = POINTER_ARGS + INDEX_POINTER_ARGS + ("s_q_tok", "s_q_head", "s_blk", "s_layer", "s_kv", "s_head", "s_tok",
                                                 "s_out_tok", "s_out_head")
EXAMPLE_GROUP = 2                                                 # query heads per KV head
EXAMPLE_BLOCK_SIZE = 16                                           # pool block size


@dataclass(frozen=True)
class KernelCost:
    registers: int        # per thread
    spill_bytes: int      # spill stores per thread (0 = everything fits in registers)
    shared_bytes: int     # per program (Triton's staging buffers for tl.dot and pipelining)


def compiled_report(name: str, model: str, dtype: str, arch: int = H100_ARCH) -> Report:
    """A report of kernels compiled, not run, for sm_<arch> (its device named so, for results/ file names)."""
    report = Report(name, meta=environment_meta(device=f"sm_{arch} (compiled, not run)", model=model, dtype=dtype))
    report.meta["device_name"] = f"sm{arch}-compiled"
    return report


def finish_report(report: Report, rows: list[dict], results_dir: str | None) -> None:
    """Attach the rows, print the report, and save it under results_dir if one was given."""
    from measure.report import print_report, save_report
    report.data = dict(rows=rows)
    print_report(report)
    if results_dir:
        print(f"saved {save_report(report, results_dir)}")


def compile_for_gpu(fn, signature: dict[str, str], constants: dict, arch: int = H100_ARCH,
                    divisible: tuple[str, ...] = (), **options) -> KernelCost:
    """Compile `@triton.jit` fn for sm_<arch> with these argument types and constexprs (Triton's defaults for
    any launch option not given: num_warps, num_stages); return what ptxas reports.
    divisible: arguments a launch would mark divisible by 16 (an aligned pointer, a stride that is a multiple
    of 16), which lets the compiler vectorise loads as the real launch does."""
    signature = dict(signature) | {name: "constexpr" for name in constants}
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", ALIGNMENT]] for name in divisible}
    source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, WARP_SIZE), options=options)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
        ptx.write(compiled.asm["ptx"])
        ptx.flush()
        report = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name=sm_{arch}a", ptx.name, "-o", os.devnull],
                                capture_output=True, text=True, check=True).stderr
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    spills = int(re.search(r"(\d+) bytes spill stores", report).group(1))
    return KernelCost(registers, spills, compiled.metadata.shared)


def compile_prefill_kernel(dtype: torch.dtype, head_dim: int, window: bool = False, softcap: bool = False,
                           arch: int = H100_ARCH) -> KernelCost:
    """Compile one variant with kernel.py's tile config for (head_dim, dtype); return what ptxas reports."""
    if kernel.INTERPRETING:
        raise RuntimeError("the kernel module was imported under Triton's interpreter; run this in a fresh process")
    fn = kernel._paged_prefill_kernel
    config = tile_configs.tile_config(head_dim, dtype)
    signature = {name: "i32" for name in fn.arg_names}
    signature.update({name: "*" + TRITON_DTYPES[dtype] for name in POINTER_ARGS})
    signature.update({name: "*i32" for name in INDEX_POINTER_ARGS})
    signature.update({name: "fp32" for name in FLOAT_ARGS})
    constants = dict(GROUP=EXAMPLE_GROUP, BLOCK_SIZE=EXAMPLE_BLOCK_SIZE, HEAD_DIM=head_dim,
                     BLOCK_M=kernel.DEFAULT_BLOCK_M, BLOCK_N=config.block_n,
                     USE_WINDOW=window, USE_SOFTCAP=softcap, UPCAST=False, **{name: 1 for name in UNIT_STRIDES})
    return compile_for_gpu(fn, signature, constants, arch, divisible=DIVISIBLE, num_warps=config.num_warps,
                           num_stages=config.num_stages)


def main() -> None:
    print(f"{'dtype':6} {'head_dim':>8} {'BLOCK_M':>7} {'BLOCK_N':>7} {'warps':>5} {'stages':>6} "
          f"{'regs':>5} {'spill B':>7} {'shared B':>8}")
    for (fp32, largest), config in tile_configs.TILE_CONFIGS.items():
        for dtype in ((torch.float32,) if fp32 else (torch.float16, torch.bfloat16)):
            cost = compile_prefill_kernel(dtype, largest, window=True, softcap=True)
            print(f"{TRITON_DTYPES[dtype]:6} {largest:>8} {kernel.DEFAULT_BLOCK_M:>7} {config.block_n:>7} "
                  f"{config.num_warps:>5} {config.num_stages:>6} {cost.registers:>5} {cost.spill_bytes:>7} "
                  f"{cost.shared_bytes:>8}")


if __name__ == "__main__":
    main()
