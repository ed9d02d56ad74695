"""Phase 3.10's CPU step (extras/p3_10_cuda_graphs/cpu_step.py): the compiled decode attention that reads the pool
in place equals phase 3.5's reference, packed linears equal plain ones and give the model back untouched, and an
engine with the CPU step on still equals HF `generate` token for token in fp32 and the plain step in bf16."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from common.model import load_model
from extras.p3_10_cuda_graphs.cpu_step import (PackedWeights, cpp_compiler, cpu_step_here, decode_attention_in_place,
                                               native_bf16_matmul)
from phases.p3_5_paged_attention.reference import paged_decode_attention_reference
from phases.p3_10_cuda_graphs.engine import StaticDecodeEngine
from phases.p3_10_cuda_graphs.runner import StaticRunner
from tests.oracles import hf_greedy
from tests.test_p3_5_kernels import LAYER, close, make_case
from tests.test_p3_10_engine import NEW_TOKENS, PROMPT_LENGTHS, run
from tests.test_p3_8_engine import random_prompts

needs_bf16 = pytest.mark.skipif(not native_bf16_matmul(), reason="this CPU's oneDNN has no native bf16 matmul")
pytestmark = pytest.mark.skipif(cpp_compiler() is None, reason="no C++ compiler: torch.compile cannot build the loop")


@pytest.mark.parametrize("dtype, window, softcap", [(torch.float32, None, None), (torch.float32, 3, 1.5),
                                                    (torch.bfloat16, None, None)])
def test_in_place_attention_equals_the_reference(dtype, window, softcap):
    q, b = make_case(4, 3, dtype=dtype, lens=[1, 4, 7, 13, 24], seed=5)   # group 3, as SmolLM2's 9 over 3
    args = (q * 4, b.kv_store, LAYER, b.block_tables, b.seq_lens)
    ref = paged_decode_attention_reference(*args, sliding_window=window, softcap=softcap)
    close(decode_attention_in_place(*args, sliding_window=window, softcap=softcap), ref, dtype)
    with pytest.raises(ValueError, match="layer_idx"):
        decode_attention_in_place(q, b.kv_store, 7, b.block_tables, b.seq_lens)


def test_fp32_engine_with_the_cpu_step_equals_hf_generate():
    """fp32 packs nothing (the plain weights stay) but attends with the compiled loop: still HF's tokens."""
    tiny = load_model("tiny", dtype=torch.float32)
    assert not cpu_step_here(tiny)
    prompts = random_prompts(PROMPT_LENGTHS, seed=1)
    engine, outputs = run(tiny, prompts, cpu_step=True)
    assert engine.runner.cpu_step and engine.runner.n_static_steps > 0
    assert not engine.runner.packed_weights.forwards
    for p, n, out in zip(prompts, NEW_TOKENS, outputs):
        assert out == hf_greedy(tiny, p, n, ignore_eos=True)


@needs_bf16
def test_packed_linears_equal_plain_ones_and_are_handed_back():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 32, bias=False)).to(torch.bfloat16)
    x = torch.randn(2, 3, 64).to(torch.bfloat16)
    plain = model(x)
    packed = PackedWeights(model)
    with packed.on():
        assert all("forward" in m.__dict__ for m in model)
        torch.testing.assert_close(model(x), plain, atol=2e-2, rtol=2e-2)
    assert not any("forward" in m.__dict__ for m in model)          # nn.Linear's own forward again
    assert len(packed.forwards) == 2
    model[0].weight = nn.Parameter(torch.randn_like(model[0].weight))   # replaced (as 4.6 re-cuts): packed again
    with packed.on():
        torch.testing.assert_close(model[0](x), F.linear(x, model[0].weight, model[0].bias), atol=5e-2, rtol=2e-2)


def static_logits(lm, prompts, steps=4, **kwargs):
    """The logits [S, V] of each of the first `steps` static steps."""
    engine = StaticDecodeEngine(lm, max_running=len(prompts), block_size=4, n_blocks=64, **kwargs)
    for p in prompts:
        engine.add(p, steps + 1, ignore_eos=True)
    replay, seen = engine.runner.replay, []
    engine.runner.replay = lambda batch: seen.append(replay(batch)) or seen[-1]
    engine.run()
    return engine, seen


@needs_bf16
def test_bf16_engine_with_the_cpu_step_is_as_close_to_fp32_as_the_plain_step():
    """In bf16 two matmul kernels round differently, so greedy tokens may part after a near-tie. So the first
    static step's logits are held against the fp32 model's: the CPU step errs no more than the plain one does."""
    lm = load_model("tiny", dtype=torch.bfloat16)
    assert cpu_step_here(lm)
    prompts = random_prompts((3, 9, 14, 22), seed=1)
    on, with_step = static_logits(lm, prompts)
    off, plain = static_logits(lm, prompts, cpu_step=False)
    _, exact = static_logits(load_model("tiny", dtype=torch.float32), prompts)
    assert on.runner.cpu_step and on.runner.packed_weights.forwards and not off.runner.cpu_step
    err = {name: (logits[0].float() - exact[0]).abs().mean() for name, logits in (("on", with_step), ("off", plain))}
    assert err["on"] <= 2 * err["off"], err


def test_the_cpu_step_is_refused_off_a_cpu():
    tiny = load_model("tiny", dtype=torch.float32)
    elsewhere = dataclasses.replace(tiny, device="cuda")
    with pytest.raises(ValueError, match="counterpart of a CUDA graph"):
        StaticRunner(elsewhere, allocator=None, max_running=4, cuda_graphs=False, cpu_step=True)
