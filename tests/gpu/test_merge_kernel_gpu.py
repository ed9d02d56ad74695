"""Phase 3.9's fused split-KV merge on the tier's device: == phase 3.5's `merge_splits`, and captured in a CUDA graph.

On CUDA the kernel runs compiled (split counts that are and are not powers of two, the
model's head_dim, every output dtype), and the decode kernel with splits, merge included, is
recorded as a CUDA graph and replayed (no host read of a tensor value may hide in it). Off
CUDA (ENGINE_TEST_DEVICE=cpu) the comparison runs in the interpreter and the graph is skipped.
"""

from __future__ import annotations

import pytest
import torch

from measure.paged_inputs import random_paged_batch
from extras.p3_5_paged_attention.split_kv import merge_splits
from tests.gpu.conftest import tier_runs_on_cuda

pytestmark = pytest.mark.gpu

ON_CUDA = tier_runs_on_cuda()
SPLITS = [1, 2, 3, 8, 16] if ON_CUDA else [3]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ULP = {torch.float32: 1e-6, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}   # one rounding, relative


@pytest.mark.parametrize("n_splits", SPLITS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_merge_kernel_equals_merge_splits(gpu_device, n_splits, dtype):
    from phases.p3_9_tuned_decode_kernel.merge_kernel import merge_splits_triton   # on a CPU: turns on the interpreter
    gen = torch.Generator().manual_seed(n_splits)
    partial = torch.randn(5, 16, n_splits, 128, generator=gen)                 # [B, H, S, D] fp32
    lse = 4 * torch.randn(5, 16, n_splits, generator=gen)                      # [B, H, S]
    lse[0, :, -1] = float("-inf")            # the last split past the end of a sequence
    lse[3] = float("-inf")                   # a bucket's padding row: every split empty
    partial[3] = 0.0
    partial, lse = partial.to(gpu_device), lse.to(gpu_device)
    ref = merge_splits(partial, lse)
    out = merge_splits_triton(partial, lse, dtype)
    assert out.dtype == dtype and out.device == partial.device
    torch.testing.assert_close(out.float(), ref, atol=1e-6, rtol=ULP[dtype])
    assert not out[3].any(), "an all-empty row must come out as zeros"


@pytest.mark.skipif(not ON_CUDA, reason="CUDA graphs need a CUDA device")
def test_decode_kernel_with_splits_is_captured_and_replayed(gpu_device):
    from phases.p3_5_paged_attention.reference import paged_decode_attention_reference
    from phases.p3_9_tuned_decode_kernel.decode_kernel import tiled_decode_attention
    lens = [1, 40, 300, 0]
    b = random_paged_batch(lens, 16, 8, 128, dtype=torch.bfloat16, device=gpu_device, seed=3)
    q = torch.randn(len(lens), 16, 128, generator=torch.Generator().manual_seed(4)).to(gpu_device, torch.bfloat16)

    def step():
        return tiled_decode_attention(q, b.kv_store, 1, b.block_tables, b.seq_lens, n_splits=4, check_values=False)

    eager = step()                           # compiles both kernels before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    q.normal_()                              # new values in the captured buffers: the replay must use them
    graph.replay()
    torch.cuda.synchronize()
    ref = paged_decode_attention_reference(q.float(), b.kv_store.float(), 1, b.block_tables, b.seq_lens)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    assert not torch.equal(out, eager) and not out[3].any()
