"""Phase 3.11's fused kernels (under the CPU interpreter) against the model's own modules, and the engine that
launches them against HF `generate`, token for token."""

import pytest
import torch

from common.model import load_model
from extras.p3_11_fused_ops.overlap import FusedOverlappedEngine
from phases.p3_4_gather_kernel.dispatch import FORCE_KERNELS_ENV
from phases.p3_10_cuda_graphs.engine import StaticDecodeEngine
from phases.p3_11_fused_ops import layers
from phases.p3_11_fused_ops.engine import FusedDecodeEngine
from phases.p3_11_fused_ops.kernels import rms_norm, rotary, silu_and_mul
from tests.oracles import hf_greedy, run_ignoring_eos
from tests.test_p3_8_engine import random_prompts

# fp32: the kernels sum in another order than PyTorch. bf16: rotary rounds once where PyTorch rounds thrice, and
# Triton's CPU interpreter truncates fp32 -> bf16 (a GPU rounds to nearest), so here bf16 is a loose check; the
# gpu tier checks it to an ulp.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# --- the kernels -----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [64, 48])                  # a power of two, and one the row pads to 64
def test_rms_norm_equals_the_models_norm(dtype, width):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
    norm = Qwen3RMSNorm(width, eps=1e-6).to(dtype)
    norm.weight.data = randn(width, seed=1).to(dtype)
    x = randn(2, 3, width, dtype=dtype)
    torch.testing.assert_close(rms_norm(x, norm.weight, norm.variance_epsilon), norm(x), **TOL[dtype])
    heads = randn(3, 1, 4, width, dtype=dtype, seed=2)         # Qwen3's q_norm input: [B, T, H, D]
    torch.testing.assert_close(rms_norm(heads, norm.weight, 1e-6), norm(heads), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_equals_hf_for_queries_and_keys_in_the_models_layout(dtype):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    lm = load_model("tiny", dtype=torch.float32)
    batch, seq, head_dim = 3, 2, lm.head_dim
    # As the attention layer makes them: [B, T, H, D] projections, transposed to [B, H, T, D] (not contiguous).
    q = randn(batch, seq, 4, head_dim, dtype=dtype).transpose(1, 2)
    k = randn(batch, seq, 2, head_dim, dtype=dtype, seed=1).transpose(1, 2)
    positions = torch.tensor([[5, 6], [0, 1], [40, 41]])
    cos, sin = LlamaRotaryEmbedding(lm.model.config)(q, positions)           # [B, T, D] in q's dtype
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    got_q, got_k = rotary(q, k, cos, sin)
    torch.testing.assert_close(got_q, want_q, **TOL[dtype])
    torch.testing.assert_close(got_k, want_k, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_equals_the_swiglu_gate(dtype):
    gate, up = randn(5, 1, 300, dtype=dtype), randn(5, 1, 300, dtype=dtype, seed=1)   # 1,500: two programs
    want = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(silu_and_mul(gate, up), want, **TOL[dtype])


def test_bad_shapes_are_refused_with_the_shapes_named():
    x = randn(2, 8)
    with pytest.raises(ValueError, match=r"weight must be \[8\]"):
        rms_norm(x, randn(6), 1e-6)
    q, k, cos = randn(1, 2, 3, 6), randn(1, 1, 3, 6), randn(1, 3, 6)
    with pytest.raises(ValueError, match=r"cos and sin must be \[1, 3, 6\]"):
        rotary(q, k, cos[:, :2], cos[:, :2])
    with pytest.raises(ValueError, match="even head_dim"):
        rotary(randn(1, 2, 3, 5), randn(1, 1, 3, 5), randn(1, 3, 5), randn(1, 3, 5))
    with pytest.raises(ValueError, match="gate and up must match"):
        silu_and_mul(randn(4), randn(5))


# --- the engine ------------------------------------------------------------------------------------
def run(lm, engine_cls, prompts, new_tokens, **kwargs):
    engine = engine_cls(lm, max_running=4, block_size=4, n_blocks=64, **kwargs)
    return engine, run_ignoring_eos(engine, prompts, new_tokens)


@pytest.mark.parametrize("model,fused", [("tiny", dict(norms=5, mlps=2)), ("tiny-qwen3", dict(norms=9, mlps=2))])
def test_fused_step_equals_hf_and_launches_every_fused_kernel(model, fused, monkeypatch):
    """Llama's layer and Qwen3's (a norm on every head's queries and keys too), greedy in fp32, a batch that
    shrinks across buckets: the tokens are HF's, and each decode step launched the fused kernels."""
    monkeypatch.setenv(FORCE_KERNELS_ENV, "1")
    lm = load_model(model, dtype=torch.float32)
    prompts, new_tokens = random_prompts((3, 9, 5), seed=8), (2, 6, 4)
    before = layers.fused_calls.copy()
    engine, outputs = run(lm, FusedDecodeEngine, prompts, new_tokens, buckets=[1, 2, 4])
    for p, n, out in zip(prompts, new_tokens, outputs):
        assert out == hf_greedy(lm, p, n, ignore_eos=True)
    found = engine.fused_modules
    assert (found.norms, found.mlps, found.left_norms) == (fused["norms"], fused["mlps"], [])
    calls = layers.fused_calls - before
    steps = engine.runner.n_static_steps
    assert steps > 0 and engine.runner.n_padded_rows > 0
    assert calls == {"rms_norm": steps * found.norms, "rotary": steps * lm.n_layers, "silu_and_mul": steps * found.mlps}


def test_outside_the_step_the_model_is_its_own(monkeypatch):
    """Installed on a shared model, the fused forwards stay out of HF's generate and of prefill passes."""
    monkeypatch.setenv(FORCE_KERNELS_ENV, "1")
    lm = load_model("tiny", dtype=torch.float32)
    FusedDecodeEngine(lm, max_running=2, n_blocks=16)
    before = layers.fused_calls.copy()
    prompt = random_prompts((7,), seed=9)[0]
    ids = torch.tensor([prompt])
    lm.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
    engine = FusedDecodeEngine(lm, max_running=2, n_blocks=16)
    engine.add(prompt, 1, ignore_eos=True)
    engine.run()                                   # one token: the prefill pass only
    assert layers.fused_calls == before


def test_a_norm_it_does_not_know_is_left_alone(monkeypatch):
    """Gemma 2's norm multiplies by (1 + weight) and its MLP is not SiLU: left to the model; rotary still fused."""
    monkeypatch.setenv(FORCE_KERNELS_ENV, "1")
    lm = load_model("tiny-softcap", dtype=torch.float32)
    prompts = random_prompts((4, 6), seed=10)
    before = layers.fused_calls.copy()
    engine, outputs = run(lm, FusedDecodeEngine, prompts, (3, 3))
    assert (engine.fused_modules.norms, engine.fused_modules.mlps) == (0, 0)
    assert engine.fused_modules.left_norms == ["Gemma2RMSNorm"]
    assert engine.fused_modules.rotary_files == ["transformers.models.gemma2.modeling_gemma2"]
    assert set(layers.fused_calls - before) == {"rotary"}
    for p, out in zip(prompts, outputs):
        assert out == hf_greedy(lm, p, 3, ignore_eos=True)


def test_overlapped_fused_steps_equal_the_plain_static_engine(monkeypatch):
    monkeypatch.setenv(FORCE_KERNELS_ENV, "1")
    lm = load_model("tiny-qwen3", dtype=torch.float32)
    prompts, new_tokens = random_prompts((5, 8), seed=11), (5, 3)
    before = layers.fused_calls.copy()
    engine, overlapped = run(lm, FusedOverlappedEngine, prompts, new_tokens)
    assert engine.fused_ops and set(layers.fused_calls - before) == {"rms_norm", "rotary", "silu_and_mul"}
    _, plain = run(lm, StaticDecodeEngine, prompts, new_tokens)
    assert overlapped == plain and engine.n_overlapped_steps > 0


def test_a_rotary_call_the_kernel_does_not_take_goes_to_the_models_function(monkeypatch):
    from transformers.models.llama import modeling_llama
    monkeypatch.setenv(FORCE_KERNELS_ENV, "1")
    layers.install_fused_ops(load_model("tiny", dtype=torch.float32).model)
    routed = modeling_llama.apply_rotary_pos_emb
    assert routed.routes_to_fused
    q, k = randn(1, 2, 4, 16).transpose(1, 2), randn(1, 2, 2, 16, seed=1).transpose(1, 2)   # [B, H, T=2, D]
    cos, sin = randn(1, 2, 16, seed=2), randn(1, 2, 16, seed=3)
    before = layers.fused_calls.copy()
    with layers.fused_ops_on():
        for args, kwargs in [((q, k, cos, sin, 1), {}),                  # unsqueeze_dim given by position
                             ((q.transpose(1, 2), k.transpose(1, 2), cos, sin), {"unsqueeze_dim": 2}),  # [B, T, H, D]
                             ((q, k, cos.float().half(), sin.half()), {})]:                # another dtype
            got = routed(*args, **kwargs)
            want = routed.__wrapped__(*args, **kwargs)
            assert all(torch.equal(g, w) for g, w in zip(got, want))
        assert layers.fused_calls == before                               # none of them fused
        routed(q, k, cos, sin, unsqueeze_dim=1)
    assert layers.fused_calls - before == {"rotary": 1}


def test_fused_ops_off_cuda_is_refused_and_off_by_default(tiny32, monkeypatch):
    monkeypatch.setenv(FORCE_KERNELS_ENV, "0")
    with pytest.raises(ValueError, match="fused_ops=True needs the model on a CUDA device"):
        FusedDecodeEngine(tiny32, max_running=2, n_blocks=16, fused_ops=True)
    engine = FusedDecodeEngine(tiny32, max_running=2, n_blocks=16)
    assert engine.fused_ops is False and engine.fused_modules is None


# --- the demos and the compile for an H100 ----------------------------------------------------------
def test_fused_bench_counts_fewer_kernels_for_the_fused_step():
    from measure.cli import run_demo
    report = run_demo("fused_bench", model="tiny", device="cpu", dtype="fp32", quick=True)
    rows = {r["engine"]: r for r in report.data["kernels"]}
    plain, fused = rows["p3_10 static step"], rows["p3_11 fused step"]
    assert fused["kernels"] < plain["kernels"]
    assert fused["by_op"]["triton:_rms_norm_kernel"] == 5 and "pow" not in fused["by_op"]   # 2 layers x 2 + final
    assert fused["by_op"]["linear"] == plain["by_op"]["linear"]                           # the matmuls stay


def test_the_fused_kernels_compile_for_an_h100():
    """Built for sm_90 ahead of time (no GPU), in a fresh process (this one has them under the interpreter)."""
    import subprocess
    import sys
    from tests.test_p3_7_prefill_kernel import REPO_ROOT
    script = ("import torch\n"
              "from measure.fused_aot_check import compile_rms_norm, compile_rotary, compile_silu_and_mul\n"
              "for cost in (compile_rms_norm(torch.bfloat16), compile_rotary(torch.bfloat16),"
              " compile_silu_and_mul(torch.float32)):\n"
              "    print(cost.registers, cost.spill_bytes)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    costs = [tuple(map(int, line.split())) for line in done.stdout.strip().splitlines()[-3:]]
    assert len(costs) == 3 and all(0 < registers <= 255 and spill == 0 for registers, spill in costs)


@pytest.mark.notebook("06_static_decode.ipynb")
def test_notebook_runs():
    """notebooks/06_static_decode: chunked and whole prefill, the static step and seeded draws all give the
    oracle's tokens, and the overlapped engine wastes one row per EOS end and answers as the static one."""
    import re
    from tests.nbrun import run_notebook
    nb = run_notebook("06_static_decode.ipynb")
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert len(re.findall(r"largest pass (\d+) tokens, outputs equal to HF generate: True", text)) == 2
    assert "outputs equal to phase 3.8's engine: True" in text and "outputs equal to HF generate:        True" in text
    assert "buckets used [1, 2, 4, 8]" in text and "equal: True" in text and "same answers: True" in text
    kernels = re.findall(r"(\w+Engine): (\d+) kernels per decode step", text)                 # phase 3.11's count
    assert [k for k, _ in kernels] == ["StaticDecodeEngine", "FusedDecodeEngine"] and "same tokens: True" in text
    assert int(kernels[1][1]) < int(kernels[0][1])
    ends = re.search(r"OverlappedDecodeEngine: \d+ steps, ends (\[.*?\]).*?(\d+) overlapped, (\d+) rows wasted", text)
    assert ends and int(ends.group(2)) > 0 and int(ends.group(3)) == ends.group(1).count("eos") > 0
