"""Phase 3.11 on the tier's device: the fused kernels, compiled, equal the model's modules, and the fused
decode step (captured as CUDA graphs on CUDA) equals HF `generate`, token for token (fp32, TF32 off).

Off CUDA (ENGINE_TEST_DEVICE=cpu) the engine test forces the kernels into Triton's interpreter, as
tests/test_p3_11_fused_ops.py does, so the tier itself can be checked without a GPU.
"""

from __future__ import annotations

import pytest
import torch

from common.model import load_model
from extras.p3_11_fused_ops.overlap import FusedOverlappedEngine
from phases.p3_4_gather_kernel.dispatch import FORCE_KERNELS_ENV
from phases.p3_11_fused_ops import layers
from phases.p3_11_fused_ops.engine import FusedDecodeEngine
from phases.p3_11_fused_ops.kernels import rms_norm, rotary, silu_and_mul
from tests.gpu.conftest import tier_runs_on_cuda
from tests.gpu.test_engine_p3_8_gpu import random_prompts
from tests.oracles import hf_greedy, run_ignoring_eos
from tests.test_p3_11_fused_ops import TOL

# Compiled, fp32 -> bf16 rounds to nearest: rms_norm and silu_and_mul round where the model rounds, so they
# differ from it by summation order only, at most one bf16 ulp (2^-7 relative at worst). Rotary rounds once where
# PyTorch rounds three times: TOL's looser bound.
ONE_ULP = {torch.float32: TOL[torch.float32], torch.bfloat16: dict(atol=1e-6, rtol=2 ** -7)}

pytestmark = pytest.mark.gpu

ON_CUDA = tier_runs_on_cuda()
PROMPT_LENGTHS = (1, 6, 11, 19)
NEW_TOKENS = (6, 2, 9, 4)     # finish one by one: the batch shrinks through the buckets


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_kernels_compiled_equal_the_models_modules(gpu_device, dtype):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb
    gen = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(gpu_device, dtype)

    norm = Qwen3RMSNorm(1024, eps=1e-6).to(gpu_device, dtype)
    norm.weight.data = randn(1024)
    x = randn(7, 1, 1024)
    tol = ONE_ULP[dtype] if ON_CUDA else TOL[dtype]      # off CUDA the interpreter truncates (see TOL)
    torch.testing.assert_close(rms_norm(x, norm.weight, norm.variance_epsilon), norm(x), **tol)
    q, k = randn(5, 1, 16, 128).transpose(1, 2), randn(5, 1, 8, 128).transpose(1, 2)
    cos, sin = randn(5, 1, 128), randn(5, 1, 128)
    for got, want in zip(rotary(q, k, cos, sin), apply_rotary_pos_emb(q, k, cos, sin)):
        torch.testing.assert_close(got, want, **TOL[dtype])
    gate, up = randn(5, 1, 3072), randn(5, 1, 3072)
    torch.testing.assert_close(silu_and_mul(gate, up), torch.nn.functional.silu(gate) * up, **tol)


@pytest.mark.parametrize("engine_cls", [FusedDecodeEngine, FusedOverlappedEngine])
@pytest.mark.parametrize("model", ["tiny", "tiny-qwen3"])
def test_fused_graph_decode_equals_hf_generate(gpu_device, no_tf32, monkeypatch, engine_cls, model):
    if not ON_CUDA:
        monkeypatch.setenv(FORCE_KERNELS_ENV, "1")
    lm = load_model(model, device=gpu_device, dtype=torch.float32)
    engine = engine_cls(lm, max_running=4, block_size=4, n_blocks=256)
    assert engine.fused_ops
    before = layers.fused_calls.copy()
    prompts = random_prompts(PROMPT_LENGTHS, seed=13)
    outputs = run_ignoring_eos(engine, prompts, NEW_TOKENS)
    for p, n, out in zip(prompts, NEW_TOKENS, outputs):
        assert out == hf_greedy(lm, p, n, ignore_eos=True)
    calls = layers.fused_calls - before
    # Every fused kind ran: on CUDA while each graph was captured (replays run no Python), else every step.
    assert set(calls) == {"rms_norm", "rotary", "silu_and_mul"}
    assert engine.runner.graphs if ON_CUDA else not engine.runner.graphs
