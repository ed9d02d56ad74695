"""Phase 0 and 1: both decode loops equal Hugging Face greedy `generate`, token for token, and refuse bad input."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from phases.p0_generate import generate as p0_generate
from phases.p0_generate import generate_ids as p0_generate_ids
from phases.p1_kv_cache import generate as p1_generate
from phases.p1_kv_cache import generate_ids as p1_generate_ids

LOOPS = {"p0": p0_generate_ids, "p1": p1_generate_ids}
SMOL_PROMPTS = [  # (prompt, how greedy decoding ends within NEW_TOKENS)
    ("What is the capital of France?", "eos"),                             # "The capital of France is Paris."
    ("Write a short story about a robot who learns to paint.", "length"),  # runs to the cap
]
TINY_PROMPTS = ["The quick brown fox", "Explain how the attention mechanism works in a transformer model."]
NEW_TOKENS = 20


def hf_greedy(lm, prompt_ids: list[int], max_new_tokens: int, eos_ids: set[int]) -> list[int]:
    """New tokens of `model.generate(do_sample=False)` on the same ids, with the same EOS set."""
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = lm.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                do_sample=False, eos_token_id=sorted(eos_ids) or None,
                                pad_token_id=lm.pad_token_id)
    return out[0, len(prompt_ids):].tolist()


class Untouchable:
    """Stands in for a model: any call means the input check came too late."""
    def __call__(self, *args, **kwargs):
        raise AssertionError("the model ran before the request was checked")


@pytest.mark.parametrize("prompt, finish", SMOL_PROMPTS)
def test_both_loops_equal_hf_generate_on_packaged_model(smol32, prompt, finish):
    ids = smol32.prompt_ids(prompt)
    expected = hf_greedy(smol32, ids, NEW_TOKENS, smol32.eos_token_ids)
    # The instruct model really uses its EOS (<|im_end|>) on a short question.
    assert (expected[-1] in smol32.eos_token_ids) == (finish == "eos")
    for phase, generate_ids in LOOPS.items():
        result = generate_ids(smol32, ids, NEW_TOKENS)
        assert result.output_ids == expected, phase
        assert result.finish_reason == finish, phase
        assert result.text == smol32.decode(expected)


@pytest.mark.parametrize("prompt", TINY_PROMPTS)
def test_both_loops_equal_hf_generate_on_tiny_model(tiny32, prompt):
    ids = tiny32.prompt_ids(prompt)
    expected = hf_greedy(tiny32, ids, NEW_TOKENS, tiny32.eos_token_ids)
    for phase, generate_ids in LOOPS.items():
        assert generate_ids(tiny32, ids, NEW_TOKENS).output_ids == expected, phase


def test_text_prompt_and_ids_give_the_same_result(tiny32):
    ids = tiny32.prompt_ids(TINY_PROMPTS[0])
    assert p0_generate(tiny32, TINY_PROMPTS[0], 8).output_ids == p0_generate(tiny32, ids, 8).output_ids
    assert p1_generate(tiny32, TINY_PROMPTS[0], 8).output_ids == p1_generate_ids(tiny32, ids, 8).output_ids


def test_stop_at_eos_and_ignore_eos_on_tiny_model(tiny32):
    """Make the 5th greedy token the EOS: both loops and HF stop right there; ignore_eos runs on."""
    ids = tiny32.prompt_ids(TINY_PROMPTS[1])
    free_run = p1_generate_ids(tiny32, ids, NEW_TOKENS, ignore_eos=True).output_ids
    eos = free_run[4]
    stop_at = free_run.index(eos) + 1
    lm = dataclasses.replace(tiny32, eos_token_ids={eos})
    expected = hf_greedy(lm, ids, NEW_TOKENS, {eos})
    assert expected == free_run[:stop_at]
    for phase, generate_ids in LOOPS.items():
        stopped = generate_ids(lm, ids, NEW_TOKENS)
        assert stopped.output_ids == expected and stopped.finish_reason == "eos", phase
        ran_on = generate_ids(lm, ids, NEW_TOKENS, ignore_eos=True)
        assert ran_on.output_ids == free_run and ran_on.finish_reason == "length", phase


def test_result_timing_is_consistent(tiny32):
    result = p1_generate(tiny32, TINY_PROMPTS[0], 6, ignore_eos=True)
    assert result.n_generated == 6 == len(result.step_ms) == len(result.positions)
    assert result.positions[0] == len(result.prompt_ids)
    assert all(ms >= 0 for ms in result.step_ms)
    assert result.step_ms[0] == pytest.approx(result.timing.ttft_ms)
    assert sum(result.step_ms) == pytest.approx(result.timing.latency_ms)
    assert result.tok_s > 0


def test_seeded_sampling_is_reproducible(tiny32):
    from common.sampling import SamplingParams
    params = SamplingParams(temperature=1.0, top_k=50, seed=1234)
    for generate_ids in LOOPS.values():
        ids = tiny32.prompt_ids(TINY_PROMPTS[0])
        assert generate_ids(tiny32, ids, 10, params).output_ids == generate_ids(tiny32, ids, 10, params).output_ids


@pytest.mark.parametrize("phase", list(LOOPS))
def test_bad_input_is_refused_before_any_model_work(tiny32, phase):
    generate = {"p0": p0_generate, "p1": p1_generate}[phase]
    lm = dataclasses.replace(tiny32, model=Untouchable())
    with pytest.raises(ValueError, match="empty prompt"):
        generate(lm, "")
    with pytest.raises(ValueError, match="empty prompt"):
        generate(lm, [])
    for bad in (0, -3):
        with pytest.raises(ValueError, match="max_new_tokens must be > 0"):
            generate(lm, "hello", max_new_tokens=bad)
    with pytest.raises(ValueError, match="max_new_tokens must be an int"):
        generate(lm, "hello", max_new_tokens=2.5)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        generate(lm, [1, 2, lm.vocab_size])
    with pytest.raises(ValueError, match="string or a list of token ids"):
        generate(lm, 42)


@pytest.mark.parametrize("phase", list(LOOPS))
def test_prompt_longer_than_context_is_refused(tiny32, phase):
    generate = {"p0": p0_generate, "p1": p1_generate}[phase]
    lm = dataclasses.replace(tiny32, model=Untouchable())
    ids = [1] * (lm.max_context - 4)
    with pytest.raises(ValueError, match=f"exceeds tiny's context of {lm.max_context} tokens"):
        generate(lm, ids, max_new_tokens=5)
    with pytest.raises(ValueError, match="context"):
        generate(lm, [1] * (lm.max_context + 1), max_new_tokens=1)


def test_decode_sweep_quick_on_tiny(tmp_path):
    from measure.cli import run_demo
    from phases.p1_kv_cache.demo import QUICK_NEW_TOKENS, plot_decode_sweep

    report = run_demo("decode_sweep", model="tiny", device="cpu", dtype="fp32", quick=True)
    no_cache, cache, speedup = report.tables
    for table in (no_cache, cache):
        assert table.columns == ["new_tokens", "tok/s", "ms/tok", "TTFT (ms)", "peak MB"]
        assert [row[0] for row in table.rows] == QUICK_NEW_TOKENS
        assert all(v > 0 for row in table.rows for v in row[1:])
    assert speedup.columns == ["new_tokens", "ms/tok no cache", "ms/tok KV cache", "speedup"]
    runs = report.data["runs"]
    assert len(runs) == 2 * len(QUICK_NEW_TOKENS)
    assert all(len(r["step_ms"]) == len(r["positions"]) == r["new_tokens"] for r in runs)
    png = tmp_path / "decode_sweep.png"
    plot_decode_sweep(report, png)
    assert png.stat().st_size > 0


def test_decode_sweep_refuses_lengths_past_the_context():
    from measure.cli import run_demo
    with pytest.raises(ValueError, match="context"):
        run_demo("decode_sweep", model="tiny", device="cpu", dtype="fp32", options={"new_tokens": [10**6]})


@pytest.mark.notebook("01_decode_loops.ipynb")
def test_notebook_runs():
    from tests.nbrun import run_notebook
    run_notebook("01_decode_loops.ipynb")
