"""Compile phase 3.9's kernels for an H100 without one: registers, spills and shared memory per variant.

measure/prefill_aot_check.py compiles a kernel ahead of time for sm_90 (Triton IR ->
PTX -> `ptxas -v`, all inside the triton wheel, no GPU). This runs the same
compile step over the decode kernel's tuning grid (measure/decode_tuning.py: every
LaunchConfig, with one split and with split-KV) for a model's shape, over every
entry of extras/p3_9_tuned_decode_kernel's LAUNCH_CONFIGS (what `launch_config` picks: the tuned default, fp32
pools, head_dim 256), and over the merge kernel. It cannot say how fast a variant runs; it says which ones
spill registers to local memory, which a timing on a GPU should then explain,
and that every variant builds.

    python -m measure.decode_aot_check                      # Qwen3-0.6B's shape in bf16
    python -m measure.decode_aot_check --head-dim 64 --group 3   # SmolLM2-135M's

Like phase 3.7's, it runs in its own process: without a GPU the kernel modules
otherwise switch Triton's interpreter on for the whole process.
"""

from __future__ import annotations

import argparse
import os
import sys

INTERPRET_ENV = "TRITON_INTERPRET"   # Triton's switch to its CPU interpreter

if "phases.p3_9_tuned_decode_kernel.decode_kernel" not in sys.modules:
    os.environ[INTERPRET_ENV] = "0"   # compile, do not interpret (must precede the kernels' import)

import torch  # noqa: E402
import triton  # noqa: E402

from measure.prefill_aot_check import (H100_ARCH, TRITON_DTYPES, KernelCost, compile_for_gpu,  # noqa: E402
                                       compiled_report, finish_report)
from phases.p3_9_tuned_decode_kernel import decode_kernel, merge_kernel  # noqa: E402
from extras.p3_9_tuned_decode_kernel.launch_configs import (DEFAULT_CONFIG, LAUNCH_CONFIGS,  # noqa: E402
                                                            LaunchConfig, launch_config)
from phases.p3_9_tuned_decode_kernel.decode_kernel import MIN_DOT  # noqa: E402
from measure.decode_tuning import SPLIT_CHOICES, config_grid  # noqa: E402

# Qwen3-0.6B (the GPU runs' model): 16 query heads over 8 KV heads of 128 dims; the pool's block size.
QWEN3_HEAD_DIM, QWEN3_GROUP, BLOCK_SIZE = 128, 2, 16
# As a launch specialises them: contiguous last dims are 1 (a constant); tensors start aligned, and every
# stride over a head_dim-sized axis (a power of two >= 16, which tl.dot needs) is a multiple of 16.
DECODE_UNIT_STRIDES = ("s_q_dim", "s_dim", "s_out_dim")
DECODE_DIVISIBLE = ("q_ptr", "kv_ptr", "tables_ptr", "lens_ptr", "out_ptr", "lse_ptr", "s_q_seq", "s_q_head",
                    "s_blk", "s_layer", "s_kv", "s_head", "s_tok", "s_out_seq", "s_out_head", "s_out_split")
MERGE_UNIT_STRIDES = ("s_p_dim", "s_l_split", "s_o_dim")
MERGE_DIVISIBLE = ("partial_ptr", "lse_ptr", "out_ptr", "head_dim", "s_p_seq", "s_p_head", "s_p_split", "s_o_seq",
                   "s_o_head")


def _require_compiler() -> None:
    if decode_kernel.INTERPRETING:
        raise RuntimeError("the kernel modules were imported under Triton's interpreter; run this in a fresh process")


def compile_decode_kernel(dtype: torch.dtype, head_dim: int, group: int, split: bool,
                          config: LaunchConfig | None = None, block_size: int = BLOCK_SIZE,
                          arch: int = H100_ARCH) -> KernelCost:
    """The decode kernel as `tiled_decode_attention` launches it for a pool in `dtype`: one split writes the
    output in `dtype`; split-KV (any n_splits > 1: the count is the grid, not the code) writes fp32 partials
    and log-sum-exps. config: default `launch_config(head_dim, dtype)`, as the kernel picks it."""
    _require_compiler()
    config = config or launch_config(head_dim, dtype)
    fn = decode_kernel._tiled_decode_kernel
    out = "*fp32" if split else "*" + TRITON_DTYPES[dtype]
    signature = {name: "i32" for name in fn.arg_names}
    signature.update(q_ptr="*" + TRITON_DTYPES[dtype], kv_ptr="*" + TRITON_DTYPES[dtype], tables_ptr="*i32",
                     lens_ptr="*i32", out_ptr=out, lse_ptr=out, scale="fp32", softcap="fp32")
    constants = dict(GROUP=group, QUERY_ROWS=max(MIN_DOT, triton.next_power_of_2(group)), BLOCK_SIZE=block_size,
                     HEAD_DIM=head_dim, TILE_BLOCKS=config.tile_blocks_for(block_size, MIN_DOT), WRITE_LSE=split,
                     USE_WINDOW=False, USE_SOFTCAP=False, UPCAST=False, IEEE=dtype == torch.float32,
                     **{name: 1 for name in DECODE_UNIT_STRIDES})
    return compile_for_gpu(fn, signature, constants, arch, divisible=DECODE_DIVISIBLE, num_warps=config.num_warps,
                           num_stages=config.num_stages)


def compile_launch_configs(group: int = QWEN3_GROUP) -> list[tuple[torch.dtype, int, bool, LaunchConfig, KernelCost]]:
    """Each LAUNCH_CONFIGS entry, the tuned default included, at the largest head_dim it covers, in its dtype
    (bf16 for the 16-bit entries), with one split and with split-KV. (Smaller head_dims under an entry need
    fewer registers; they are not compiled here.) Returns (dtype, head_dim, split-KV?, config, cost)."""
    variants = []
    for (fp32, head_dim), config in LAUNCH_CONFIGS.items():
        dtype = torch.float32 if fp32 else torch.bfloat16
        assert launch_config(head_dim, dtype) == config, "the entry is what the kernel picks for its own shape"
        for split in (False, True):
            cost = compile_decode_kernel(dtype, head_dim, group, split, config)
            variants.append((dtype, head_dim, split, config, cost))
    return variants


def split_label(split: bool) -> str:
    return "split-KV" if split else "one split"


def compile_merge_kernel(out_dtype: torch.dtype, head_dim: int, n_splits: int, arch: int = H100_ARCH) -> KernelCost:
    """The merge kernel as `merge_splits_triton` launches it (Triton's default warps and stages)."""
    _require_compiler()
    fn = merge_kernel._merge_splits_kernel
    signature = {name: "i32" for name in fn.arg_names}
    signature.update(partial_ptr="*fp32", lse_ptr="*fp32", out_ptr="*" + TRITON_DTYPES[out_dtype])
    constants = dict(SPLITS=max(merge_kernel.MIN_LANES, triton.next_power_of_2(n_splits)),
                     DIMS=max(merge_kernel.MIN_LANES, triton.next_power_of_2(head_dim)),
                     **{name: 1 for name in MERGE_UNIT_STRIDES})
    return compile_for_gpu(fn, signature, constants, arch, divisible=MERGE_DIVISIBLE)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m measure.decode_aot_check",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--head-dim", type=int, default=QWEN3_HEAD_DIM)
    p.add_argument("--group", type=int, default=QWEN3_GROUP, help="query heads per KV head")
    p.add_argument("--dtype", default="bf16", choices=sorted(TRITON_DTYPES.values()))
    p.add_argument("--results-dir", default=None, help="also save the report there (json + md)")
    args = p.parse_args(argv)
    dtype = {v: k for k, v in TRITON_DTYPES.items()}[args.dtype]
    shape = f"head_dim {args.head_dim}, group {args.group}, block_size {BLOCK_SIZE}"
    qwen3 = (args.head_dim, args.group) == (QWEN3_HEAD_DIM, QWEN3_GROUP)
    model = "qwen3-0.6b-shape" if qwen3 else f"head-dim-{args.head_dim}-group-{args.group}"
    report = compiled_report("decode_aot", model, args.dtype)
    columns = ["tile blocks", "warps", "stages", "splits", "registers", "spill B / thread", "shared B"]
    t = report.table(f"the decode kernel over decode_tuning.py's grid, compiled for sm_{H100_ARCH} ({shape}, {args.dtype})",
                     columns)
    rows = []
    for config in config_grid():
        for split in (False, True):
            cost = compile_decode_kernel(dtype, args.head_dim, args.group, split, config)
            mark = " (DEFAULT_CONFIG)" if config == DEFAULT_CONFIG else ""
            t.add_row(f"{config.tile_blocks}{mark}", config.num_warps, config.num_stages, split_label(split),
                      cost.registers, cost.spill_bytes, cost.shared_bytes)
            rows.append(dict(config=vars(config), split=split, **vars(cost)))
            print(f"  {config} split={split}: {cost}", flush=True)
    t.notes.append("registers are per thread (255 is the most a thread may have: past it, values spill to local "
                   "memory); spill B is ptxas's spill stores per thread; nothing here is timed")
    t.notes.append(f"triton {triton.__version__} and the ptxas in its wheel; pointers and head_dim-sized strides "
                   "marked divisible by 16, unit strides constant, as a launch specialises them")
    picks = report.table(f"every LAUNCH_CONFIGS entry, compiled for sm_{H100_ARCH} (each at the largest head_dim "
                         f"it covers, group {args.group})",
                         ["pool", "head_dim", "tile blocks", "warps", "stages", "splits", "registers",
                          "spill B / thread", "shared B"])
    for pool_dtype, head_dim, split, config, cost in compile_launch_configs(args.group):
        picks.add_row(TRITON_DTYPES[pool_dtype], head_dim, config.tile_blocks, config.num_warps, config.num_stages,
                      split_label(split), cost.registers, cost.spill_bytes, cost.shared_bytes)
        rows.append(dict(config=vars(config), pick=True, pool=TRITON_DTYPES[pool_dtype], head_dim=head_dim,
                         split=split, **vars(cost)))
    picks.notes.append("what launch_config picks per pool dtype and head_dim, the tuned default (bf16, 128) first; "
                       "bf16 stands for fp16 too (same widths)")
    m = report.table(f"the split-KV merge kernel, compiled for sm_{H100_ARCH} (head_dim {args.head_dim}, output "
                     f"{args.dtype})", ["splits", "registers", "spill B / thread", "shared B"])
    for n_splits in SPLIT_CHOICES[1:]:
        cost = compile_merge_kernel(dtype, args.head_dim, n_splits)
        m.add_row(n_splits, cost.registers, cost.spill_bytes, cost.shared_bytes)
        rows.append(dict(merge_splits=n_splits, **vars(cost)))
    finish_report(report, rows, args.results_dir)


if __name__ == "__main__":
    main()
