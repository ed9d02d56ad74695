"""Phase 3.9's fused split-KV merge (under the CPU interpreter) equals phase 3.5's `merge_splits` (extras/p3_5_paged_attention/split_kv.py).

Split counts of 1, 3 (not a power of two: the split axis is padded and masked) and 16; an
empty split (lse = -inf) weighs 0 and its partial is never read; a row whose splits are all
empty (a bucket's padding row) comes out as zeros; the output is written in the model's dtype.
The decode kernel's own tests (test_p3_9_decode_kernel.py) run it behind every n_splits > 1.
"""

import subprocess
import sys

import pytest
import torch

from extras.p3_5_paged_attention.split_kv import merge_splits
from extras.p3_9_tuned_decode_kernel.launch_configs import LAUNCH_CONFIGS
from phases.p3_9_tuned_decode_kernel.merge_kernel import merge_splits_triton
from tests.test_p3_7_prefill_kernel import H100_SHARED_BYTES, REPO_ROOT

BF16_ULP = 2.0 ** -7     # bf16 keeps 8 significant bits: one rounding is within this share of the value


def partials(n_splits: int, head_dim: int = 8, seed: int = 0):
    """partial [2, 3, S, D] fp32 and lse [2, 3, S] fp32, with one empty split and one all-empty row."""
    gen = torch.Generator().manual_seed(seed)
    partial = torch.randn(2, 3, n_splits, head_dim, generator=gen)
    lse = 4 * torch.randn(2, 3, n_splits, generator=gen)
    lse[0, 1, -1] = float("-inf")                      # a split past the end of its sequence
    lse[1, 2] = float("-inf")                          # a padding row: every split empty
    partial[1, 2] = 0.0                                # as the decode kernel writes an empty split
    return partial, lse


@pytest.mark.parametrize("n_splits", [1, 3, 16])
def test_merge_kernel_equals_merge_splits(n_splits):
    partial, lse = partials(n_splits, seed=n_splits)
    ref = merge_splits(partial, lse)                                                  # [2, 3, 8] fp32
    out = merge_splits_triton(partial, lse)
    assert out.shape == ref.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    assert torch.equal(out[1, 2], torch.zeros_like(out[1, 2]))                        # all empty: zeros
    half = merge_splits_triton(partial, lse, torch.bfloat16)
    assert half.dtype == torch.bfloat16                # cast once at the store (the interpreter truncates)
    torch.testing.assert_close(half.float(), ref, atol=1e-6, rtol=BF16_ULP)


def test_an_empty_splits_partial_is_never_read_and_head_dim_need_not_be_a_power_of_two():
    partial, lse = partials(3, head_dim=6, seed=1)
    ref = merge_splits(partial, lse)
    partial[0, 1, -1] = float("nan")                   # garbage where lse says the split is empty
    partial[1, 2] = float("nan")
    torch.testing.assert_close(merge_splits_triton(partial, lse), ref, atol=1e-6, rtol=1e-6)


def test_bad_inputs_are_refused():
    partial, lse = partials(2)
    with pytest.raises(ValueError, match="fp32"):
        merge_splits_triton(partial.half(), lse)
    with pytest.raises(ValueError, match=r"\[B, H, S, D\]"):
        merge_splits_triton(partial, lse[:, :, :1])


def test_the_merge_and_every_decode_launch_compile_for_an_h100_without_spilling():
    """Built for sm_90 ahead of time (phase 3.7's aot_check, no GPU needed), in a fresh process: this one
    has the kernels under the interpreter. The merge, and the decode kernel launched with every entry of
    `LAUNCH_CONFIGS` (the tuned bf16 default, head_dim 256, fp32 pools) at the largest head_dim the entry
    covers, one split and split-KV, keep everything in registers."""
    script = ("import torch\n"
              "from measure.decode_aot_check import compile_launch_configs, compile_merge_kernel\n"
              "cost = compile_merge_kernel(torch.bfloat16, 128, 8)\n"
              "print('merge', cost.registers, cost.spill_bytes, cost.shared_bytes)\n"
              "for dtype, head_dim, split, config, cost in compile_launch_configs():\n"
              "    print(f'{dtype}-{head_dim}-split={split}', cost.registers, cost.spill_bytes, cost.shared_bytes)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    variants = 1 + 2 * len(LAUNCH_CONFIGS)
    lines = done.stdout.strip().splitlines()[-variants:]
    costs = {name: tuple(map(int, numbers)) for name, *numbers in map(str.split, lines)}
    assert len(costs) == variants
    assert all(0 < registers <= 255 and shared <= H100_SHARED_BYTES for registers, _, shared in costs.values())
    spilled = [name for name, (_, spill_bytes, _) in costs.items() if spill_bytes]
    assert not spilled, f"these launches spill registers: {spilled}"
