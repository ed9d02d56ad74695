"""The compiled varlen prefill kernel (phase 3.7) against its PyTorch reference, over the shapes a real engine meets.

Grid: pool block sizes 8-64, GQA groups 1/2/4/8, head_dim 64 and 128,
fp32/fp16/bf16, on a pack that mixes fresh segments and segments after a
cached context, with lengths that are not multiples of the block size (1
included), in scattered blocks of a shared pool whose other slots hold NaN.
Then sliding windows and softcaps (head_dim up to 256, Gemma 2's), one 4k-token
segment, a pack of 16 x 256 and one of 64 segments of 16..128 tokens. Oracles:
kernel == reference (in the inputs' dtype) == the fp32 reference on the same
inputs, to within one rounding of the output dtype; the fp32 reference ==
SDPA over the same K/V laid out contiguously.

On CUDA everything runs compiled. Anywhere else (ENGINE_TEST_DEVICE=cpu) the
kernel runs in Triton's CPU interpreter, one Python call per program, so only
a sample of the grid runs and the large packs are skipped.
"""

from __future__ import annotations

import itertools
import os
import random
import zlib

import pytest
import torch

from phases.p3_7_varlen_prefill import ops
from extras.p3_7_varlen_prefill.contiguous import sdpa_prefill_contiguous
from measure.paged_inputs import random_prefill_pack
from phases.p3_7_varlen_prefill.plan import plan_prefill
from phases.p3_7_varlen_prefill.reference import paged_prefill_attention_reference
from tests.gpu.conftest import tier_runs_on_cuda
from tests.gpu.grid import BLOCK_SIZES, DTYPES, GQA_GROUPS, HEAD_DIMS, N_KV_HEADS

pytestmark = pytest.mark.gpu

GEMMA2_HEAD_DIM = 256
GEMMA2_SOFTCAP = 50.0    # Gemma 2's attn_logit_softcapping
WINDOW_CASES = [(64, None), (None, GEMMA2_SOFTCAP), (100, GEMMA2_SOFTCAP)]   # (sliding_window, softcap)
# The references compute in fp32 and round once to the output dtype. The kernel rounds the
# probabilities to the value dtype before its second tl.dot (as flash-attention does), then the
# output once: about one output ulp, as in tests/gpu/test_kernels_gpu.py.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
FP32_TOL = TOL[torch.float32]

# Without a GPU the interpreter runs each program in Python: a few cases that still cover every
# block size, group, head_dim and dtype at least once.
INTERPRETER_CASES = [(8, 2, 64, "fp32"), (16, 8, 128, "bf16"), (32, 1, 128, "fp16"), (64, 4, 64, "fp32")]
INTERPRETER_WINDOW_CASES = [(128, "bf16", 64, None), (64, "fp32", 100, GEMMA2_SOFTCAP)]


def pack_lengths(block_size: int, on_cuda: bool) -> tuple[list[int], list[int]]:
    """(new tokens, cached context) per segment: one token, either side of a block boundary, a
    segment ending partway into its 4th block after two blocks of context; on CUDA two longer ones."""
    seg_lens = [1, block_size - 1, block_size + 1, 3 * block_size + 5]
    context_lens = [0, 37, 0, 2 * block_size]
    if on_cuda:
        seg_lens, context_lens = seg_lens + [100, 200], context_lens + [150, 0]
    return seg_lens, context_lens


def _ids(cases, labels):
    """Readable test ids: (8, 2, 64, 'fp32') -> 'bs8-g2-d64-fp32'."""
    return ["-".join(f"{label}{value}" for label, value in zip(labels, case)) for case in cases]


ON_CUDA = tier_runs_on_cuda()
ATTENTION_CASES = (list(itertools.product(BLOCK_SIZES, GQA_GROUPS, HEAD_DIMS, DTYPES)) if ON_CUDA
                   else INTERPRETER_CASES)
WINDOW_GRID = ([(d, name, w, c) for d in (128, GEMMA2_HEAD_DIM) for name in DTYPES for w, c in WINDOW_CASES]
               if ON_CUDA else INTERPRETER_WINDOW_CASES)


def _kernel():
    # Imported inside the tests: on a machine without a GPU, importing the kernel module turns on
    # Triton's interpreter (phases/p3_4_gather_kernel/kernel.py); a skipped tier should not.
    from phases.p3_7_varlen_prefill.kernel import paged_prefill_attention_triton
    return paged_prefill_attention_triton


def _seed(*case) -> int:
    """A seed per grid case, the same in every process (str hashes are salted per process; crc32 is not)."""
    return zlib.crc32(repr(case).encode())


def check_pack(p, dtype, **kw):
    """kernel == reference == fp32 reference == SDPA on contiguous K/V, for one pack."""
    plan = plan_prefill(p.cu_seqlens_q, p.context_lens, device=p.q.device)
    out = _kernel()(*p.args(), plan=plan, **kw)
    assert out.shape == p.q.shape and out.dtype == dtype and out.device == p.q.device
    assert torch.isfinite(out).all(), "the kernel read a slot that is not one of the sequence's tokens (NaN)"
    exact = paged_prefill_attention_reference(p.q.float(), p.kv_store.float(), *p.args()[2:], plan=plan, **kw)
    if kw.get("softcap") is None:   # SDPA has no softcap
        sdpa = sdpa_prefill_contiguous(p.q.float(), p.k.float(), p.v.float(), p.cu_seqlens_q, p.context_lens,
                                       kw.get("scale"), kw.get("sliding_window"))
        torch.testing.assert_close(exact, sdpa, **FP32_TOL)
    ref = paged_prefill_attention_reference(*p.args(), plan=plan, **kw)
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])
    torch.testing.assert_close(out.float(), exact, **TOL[dtype])
    return out


@pytest.mark.parametrize("block_size, group, head_dim, dtype_name", ATTENTION_CASES,
                         ids=_ids(ATTENTION_CASES, ("bs", "g", "d", "")))
def test_prefill_kernel_equals_reference_equals_sdpa(gpu_device, no_tf32, block_size, group, head_dim, dtype_name):
    seg_lens, context_lens = pack_lengths(block_size, ON_CUDA)
    p = random_prefill_pack(seg_lens, context_lens, block_size, N_KV_HEADS, group, head_dim,
                            dtype=DTYPES[dtype_name], device=gpu_device,
                            seed=_seed(block_size, group, head_dim, dtype_name))
    check_pack(p, DTYPES[dtype_name])


@pytest.mark.parametrize("head_dim, dtype_name, window, softcap", WINDOW_GRID,
                         ids=_ids(WINDOW_GRID, ("d", "", "w", "cap")))
def test_sliding_window_and_softcap(gpu_device, no_tf32, head_dim, dtype_name, window, softcap):
    """Windows shorter than the context, and Gemma 2's softcap; keys before every query's window are
    NaN in the pool, so a kernel that loads a key tile it should have skipped fails."""
    dtype = DTYPES[dtype_name]
    seg_lens, context_lens = ([3, 150, 70], [300, 130, 0]) if ON_CUDA else ([3, 70], [130, 0])
    p = random_prefill_pack(seg_lens, context_lens, 16, N_KV_HEADS, 2, head_dim, dtype=dtype, device=gpu_device,
                            seed=_seed(head_dim, dtype_name, window, softcap))
    kw = dict(scale=head_dim ** -0.5, sliding_window=window, softcap=softcap)
    clean = p.kv_store.clone()
    if window is not None:
        for s, context in enumerate(context_lens):
            for position in range(max(context - window + 1, 0)):
                block, offset = p.slot(s, position)
                p.kv_store[block, p.layer_idx, :, :, offset] = float("nan")
    out = _kernel()(*p.args(), **kw)
    assert torch.isfinite(out).all()
    p.kv_store = clean
    torch.testing.assert_close(out.float(), check_pack(p, dtype, **kw).float(), **TOL[dtype])


def _large_packs():
    rng = random.Random(0)
    long_lens = [rng.randint(16, 128) for _ in range(64)]
    long_contexts = [rng.choice([0, 0, rng.randint(1, 300)]) for _ in range(64)]
    return {
        "one-4k-segment": ([4096], [0]),
        "4k-after-4k-context": ([2048, 2048], [2048, 0]),
        "16x256": ([256] * 16, [0] * 8 + [17, 64, 100, 255, 256, 300, 511, 1000]),
        "64x16-128": (long_lens, long_contexts),
    }


LARGE_PACKS = _large_packs()


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("name", LARGE_PACKS)
def test_large_packs(gpu_device, no_tf32, name, dtype_name):
    if not ON_CUDA:
        pytest.skip("thousands of tokens: minutes per pack in Triton's CPU interpreter")
    seg_lens, context_lens = LARGE_PACKS[name]
    p = random_prefill_pack(seg_lens, context_lens, 16, N_KV_HEADS, 2, 128, dtype=DTYPES[dtype_name],
                            device=gpu_device, seed=_seed(name, dtype_name))
    check_pack(p, DTYPES[dtype_name])


def test_dispatcher_runs_the_kernel_on_cuda(gpu_device, no_tf32):
    p = random_prefill_pack([5, 40], [0, 20], 16, N_KV_HEADS, 2, 64, device=gpu_device, seed=3)
    plan = ops.plan_prefill([0, 5, 45], [0, 20], device=gpu_device)     # host lists: no device read-back
    out = ops.paged_prefill_attention(*p.args(), plan=plan)
    torch.testing.assert_close(out, paged_prefill_attention_reference(*p.args()), **FP32_TOL)
    if ON_CUDA:
        with pytest.raises(ValueError, match="make the plan with device"):
            _kernel()(*p.args(), plan=plan_prefill([0, 5, 45], [0, 20], device="cpu"))


def test_the_grid_is_the_full_one_on_cuda(gpu_device):
    """The tier's point is the compiled kernel over the whole grid: make sure a GPU run got it."""
    if torch.device(gpu_device).type != "cuda":
        assert ATTENTION_CASES == INTERPRETER_CASES
        pytest.skip("not on CUDA: the interpreter runs a sample of the grid")
    assert len(ATTENTION_CASES) == len(BLOCK_SIZES) * len(GQA_GROUPS) * len(HEAD_DIMS) * len(DTYPES)
    from phases.p3_4_gather_kernel.kernel import INTERPRET_ENV
    assert os.environ.get(INTERPRET_ENV, "0") != "1", "on a GPU the kernel must be compiled, not interpreted"
