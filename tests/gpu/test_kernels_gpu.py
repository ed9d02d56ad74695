"""The compiled Triton kernels against their PyTorch references, over the shapes a real engine meets.

Grid: block sizes 8-64, GQA groups 1/2/4/8 (query heads per KV head), head_dim
64 and 128, fp32/fp16/bf16, and sequence lengths that are not multiples of the
block size (1 included), in scattered blocks of a shared pool. Oracles:

- gather and K/V store copy values, so kernel == reference bit for bit;
- paged decode attention (single pass and split-KV) == the fp32 reference to
  within one rounding of the output dtype, and the reference == SDPA over the
  same K/V laid out contiguously.

On CUDA the whole grid runs compiled. Anywhere else (ENGINE_TEST_DEVICE=cpu)
the kernels run in Triton's CPU interpreter, one Python call per program, so
only a sample of the grid runs: enough to check the tier's own logic.
"""

from __future__ import annotations

import itertools
import os
import zlib

import pytest
import torch

from measure.paged_inputs import random_paged_batch
from extras.p3_5_paged_attention.contiguous import sdpa_decode_contiguous
from phases.p3_4_gather_kernel.reference import gather_reference
from extras.p3_5_paged_attention.cpu_path import write_kv_reference
from phases.p3_5_paged_attention.reference import paged_decode_attention_reference
from tests.gpu.conftest import tier_runs_on_cuda
from tests.gpu.grid import BLOCK_SIZES, DTYPES, GQA_GROUPS, HEAD_DIMS, N_KV_HEADS

pytestmark = pytest.mark.gpu

WRITE_N_KV_HEADS = 3     # not a power of two: the store kernel pads the head axis and masks it
N_LAYERS = 2
LAYER = 1                # not layer 0, so a kernel that ignores the layer stride reads the wrong K/V
SPLIT_BLOCKS = 2         # split-KV: blocks per program, so the longer sequences span several splits
N_WRITE_TOKENS = 7
PADDING_SLOT = -1
# The references compute in fp32 and round once to the output dtype; so does the kernel
# (in a different summation order). Allow about one output ulp, as tests/test_p3_5_kernels.py does.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
FP32_TOL = TOL[torch.float32]

# Without a GPU the interpreter runs each program in Python: a few cases that still cover every
# block size, group, head_dim and dtype at least once.
INTERPRETER_ATTENTION_CASES = [(8, 2, 64, "fp32"), (16, 8, 128, "bf16"), (32, 1, 128, "fp16"), (64, 4, 64, "fp32")]
INTERPRETER_COPY_CASES = [(8, 128, "bf16"), (64, 64, "fp32"), (16, 64, "fp16")]


def lengths_for(block_size: int) -> list[int]:
    """Sequence lengths that are not multiples of the block size: one token, either side of
    the first boundary, and two that end partway into their 4th and 5th blocks."""
    return [1, block_size - 1, block_size + 1, 3 * block_size + 5, 5 * block_size - 3]


def _ids(cases, labels):
    """Readable test ids: (8, 2, 64, 'fp32') -> 'bs8-g2-d64-fp32'."""
    return ["-".join(f"{label}{value}" for label, value in zip(labels, case)) for case in cases]


ATTENTION_CASES = (list(itertools.product(BLOCK_SIZES, GQA_GROUPS, HEAD_DIMS, DTYPES))
                   if tier_runs_on_cuda() else INTERPRETER_ATTENTION_CASES)
COPY_CASES = (list(itertools.product(BLOCK_SIZES, HEAD_DIMS, DTYPES))
              if tier_runs_on_cuda() else INTERPRETER_COPY_CASES)
ATTENTION_IDS = _ids(ATTENTION_CASES, ("bs", "g", "d", ""))
COPY_IDS = _ids(COPY_CASES, ("bs", "d", ""))


def _kernels():
    # Imported inside the tests: on a machine without a GPU, importing the kernel modules turns on
    # Triton's interpreter (phases/p3_4_gather_kernel/kernel.py); a skipped tier should not.
    from phases.p3_4_gather_kernel.kernel import gather_triton
    from extras.p3_5_paged_attention.split_kv import paged_decode_attention_split
    from phases.p3_5_paged_attention.kernels import paged_decode_attention_triton, write_kv_triton
    return gather_triton, paged_decode_attention_triton, paged_decode_attention_split, write_kv_triton


def _seed(*case) -> int:
    """A seed per grid case, the same in every process (str hashes are salted per process; crc32 is not)."""
    return zlib.crc32(repr(case).encode())


@pytest.mark.parametrize("block_size, group, head_dim, dtype_name", ATTENTION_CASES, ids=ATTENTION_IDS)
def test_paged_decode_attention_equals_reference_equals_sdpa(gpu_device, no_tf32, block_size, group, head_dim,
                                                             dtype_name):
    _, attention_triton, attention_split, _ = _kernels()
    dtype = DTYPES[dtype_name]
    lens = lengths_for(block_size)
    seed = _seed(block_size, group, head_dim, dtype_name)
    b = random_paged_batch(lens, block_size, N_KV_HEADS, head_dim, n_layers=N_LAYERS, dtype=dtype,
                           device=gpu_device, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(len(lens), N_KV_HEADS * group, head_dim, generator=gen).to(dtype=dtype, device=gpu_device)
    args = (b.kv_store, LAYER, b.block_tables, b.seq_lens)

    # The reference against the second oracle, in fp32 on the same (rounded) inputs: SDPA over contiguous K/V.
    q32, kv32 = q.float(), b.kv_store.float()
    exact = paged_decode_attention_reference(q32, kv32, LAYER, b.block_tables, b.seq_lens)    # [B, H, D] fp32
    k, v = gather_reference(kv32, LAYER, b.block_tables, b.seq_lens)
    torch.testing.assert_close(exact, sdpa_decode_contiguous(q32, k, v, b.seq_lens), **FP32_TOL)

    ref = paged_decode_attention_reference(q, *args)
    single = attention_triton(q, *args)
    split = attention_split(q, *args, blocks_per_split=SPLIT_BLOCKS)
    assert single.shape == split.shape == q.shape
    assert single.dtype == split.dtype == ref.dtype == dtype
    assert single.device == q.device and torch.isfinite(single).all() and torch.isfinite(split).all()
    for out in (single, split):
        torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])
        torch.testing.assert_close(out.float(), exact, **TOL[dtype])


@pytest.mark.parametrize("block_size, head_dim, dtype_name", COPY_CASES, ids=COPY_IDS)
def test_gather_is_bit_equal_to_reference(gpu_device, block_size, head_dim, dtype_name):
    gather_triton, *_ = _kernels()
    dtype = DTYPES[dtype_name]
    lens = lengths_for(block_size) + [0]   # and an empty sequence: all padding
    b = random_paged_batch(lens, block_size, N_KV_HEADS, head_dim, n_layers=N_LAYERS, dtype=dtype,
                           device=gpu_device, seed=_seed(block_size, head_dim, dtype_name))
    k_ref, v_ref = gather_reference(b.kv_store, LAYER, b.block_tables, b.seq_lens)
    k, v = gather_triton(b.kv_store, LAYER, b.block_tables, b.seq_lens)
    assert k.shape == (len(lens), N_KV_HEADS, max(lens), head_dim) and k.dtype == dtype
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    for i, n in enumerate(lens):
        assert not k[i, :, n:].any() and not v[i, :, n:].any(), "past a sequence's length the gather writes zeros"


@pytest.mark.parametrize("block_size, head_dim, dtype_name", COPY_CASES, ids=COPY_IDS)
def test_write_kv_is_bit_equal_to_reference_and_touches_only_its_slots(gpu_device, block_size, head_dim,
                                                                       dtype_name):
    *_, write_kv_triton = _kernels()
    dtype = DTYPES[dtype_name]
    seed = _seed(block_size, head_dim, dtype_name)
    b = random_paged_batch(lengths_for(block_size), block_size, WRITE_N_KV_HEADS, head_dim, n_layers=N_LAYERS,
                           dtype=dtype, device=gpu_device, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    k = torch.randn(N_WRITE_TOKENS, WRITE_N_KV_HEADS, head_dim, generator=gen).to(dtype=dtype, device=gpu_device)
    v = torch.randn(N_WRITE_TOKENS, WRITE_N_KV_HEADS, head_dim, generator=gen).to(dtype=dtype, device=gpu_device)
    n_slots = b.kv_store.shape[0] * block_size
    slots = torch.randperm(n_slots, generator=gen)[:N_WRITE_TOKENS]
    slots[1] = PADDING_SLOT                                     # a padding token stores nothing
    pools = [b.kv_store.clone(), b.kv_store.clone()]
    write_kv_reference(pools[0], LAYER, k, v, slots.to(gpu_device))
    write_kv_triton(pools[1], LAYER, k, v, slots.to(gpu_device))
    assert torch.equal(pools[0], pools[1])

    expected = b.kv_store.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot != PADDING_SLOT:
            expected[slot // block_size, LAYER, 0, :, slot % block_size] = k[t]
            expected[slot // block_size, LAYER, 1, :, slot % block_size] = v[t]
    assert torch.equal(pools[1], expected)


def test_the_grid_is_the_full_one_on_cuda(gpu_device):
    """The tier's point is the compiled kernels over the whole grid: make sure a GPU run got it."""
    if torch.device(gpu_device).type != "cuda":
        assert len(ATTENTION_CASES) == len(INTERPRETER_ATTENTION_CASES)
        pytest.skip("not on CUDA: the interpreter runs a sample of the grid")
    assert len(ATTENTION_CASES) == len(BLOCK_SIZES) * len(GQA_GROUPS) * len(HEAD_DIMS) * len(DTYPES)
    assert len(COPY_CASES) == len(BLOCK_SIZES) * len(HEAD_DIMS) * len(DTYPES)
    from phases.p3_4_gather_kernel.kernel import INTERPRET_ENV
    assert os.environ.get(INTERPRET_ENV, "0") != "1", "on a GPU the kernels must be compiled, not interpreted"
