"""Phase 2.1: a left-padded batch decodes every row exactly as the row would decode alone."""

import pytest
import torch

from common.prompts import SHORT_PROMPTS, WASTE_DEMO_PROMPTS
from phases.p2_1_naive_batching import generate as gen_mod
from phases.p2_1_naive_batching.batch import cache_bytes
from phases.p2_1_naive_batching.generate import generate_batch
from phases.p2_1_naive_batching.padding import left_pad
from tests.oracles import hf_greedy

# Four prompts of different lengths (so rows get different amounts of PAD); on
# SmolLM2 the capital-of-France row stops at EOS long before the others.
PROMPTS = [WASTE_DEMO_PROMPTS[1], SHORT_PROMPTS[0], SHORT_PROMPTS[3], WASTE_DEMO_PROMPTS[2]]
NEW_TOKENS = 16
_REFERENCE: dict = {}
_RESULTS: dict = {}


def reference(lm, prompts=PROMPTS, n=NEW_TOKENS, ignore_eos=False) -> list[list[int]]:
    """HF greedy output of each prompt run ALONE (no padding), cached per model."""
    key = (lm.name, tuple(prompts), n, ignore_eos)
    if key not in _REFERENCE:
        _REFERENCE[key] = [hf_greedy(lm, lm.prompt_ids(p), n, ignore_eos) for p in prompts]
    return _REFERENCE[key]


def batched(lm):
    """generate_batch on PROMPTS, run once per model and shared by the tests below."""
    if lm.name not in _RESULTS:
        _RESULTS[lm.name] = generate_batch(lm, PROMPTS, max_new_tokens=NEW_TOKENS)
    return _RESULTS[lm.name]


# --- padding -------------------------------------------------------------------------------
def test_left_pad_mask_and_positions():
    ids, mask, pos = left_pad([[5, 6], [7, 8, 9, 10], [11]], pad_id=0)
    assert ids.tolist() == [[0, 0, 5, 6], [7, 8, 9, 10], [0, 0, 0, 11]]
    assert mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 1]]
    # Real tokens count from 0 in every row, as if there were no padding.
    assert pos.tolist() == [[0, 0, 0, 1], [0, 1, 2, 3], [0, 0, 0, 0]]


# --- the oracle: padding changes nothing ------------------------------------------------
def test_generate_batch_equals_hf_generate_per_prompt(any32):
    res = batched(any32)
    assert res.output_ids == reference(any32)
    assert len(set(res.n_pad)) > 1, "the prompts should need different amounts of padding"


def test_short_row_stops_at_eos_and_is_carried(smol32):
    res = batched(smol32)
    france = res.output_ids[1]
    assert res.finish_reasons[1] == "eos" and france[-1] in smol32.eos_token_ids
    assert res.n_decode_steps == max(res.steps_needed) == NEW_TOKENS - 1
    assert res.steps_wasted[1] == res.n_decode_steps - (len(france) - 1) > 0
    assert res.steps_wasted[0] == 0 and res.waste_pct[0] == 0.0
    # The France row finished early: its timing stops at its EOS, not at the batch's end.
    assert res.timings[1].finish < res.timings[0].finish
    assert res.timings[1].n_generated == len(france)


def test_ignore_eos_gives_every_row_the_same_work(tiny32):
    res = generate_batch(tiny32, PROMPTS[:3], max_new_tokens=5, ignore_eos=True)
    assert [len(o) for o in res.output_ids] == [5, 5, 5]
    assert res.steps_wasted == [0, 0, 0] and res.n_decode_steps == 4
    assert res.output_ids == reference(tiny32, PROMPTS[:3], 5, ignore_eos=True)
    # The shared cache holds every row at the padded width: B x (T_pad + 4 steps) tokens.
    width = max(len(p) for p in res.prompt_ids) + 4
    per_token = 2 * tiny32.n_layers * tiny32.n_kv_heads * tiny32.head_dim * 4  # fp32
    assert res.kv_bytes == 3 * width * per_token


def test_cache_bytes_of_an_empty_cache_is_zero():
    from transformers import DynamicCache
    assert cache_bytes(DynamicCache()) == 0


# --- bad input ----------------------------------------------------------------------------
@pytest.mark.parametrize("prompts, match", [([], "empty prompt list"), ([""], "empty prompt"),
                                            (["ok", ""], "prompt 1"), ("a string", "list")])
def test_bad_prompts_raise_value_error(tiny32, prompts, match):
    with pytest.raises(ValueError, match=match):
        generate_batch(tiny32, prompts, max_new_tokens=4)


def test_bad_max_new_tokens(tiny32):
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate_batch(tiny32, ["hi"], max_new_tokens=0)


def test_too_long_prompt_is_rejected_before_any_work(tiny32, monkeypatch):
    def no_work(*a, **k):
        raise AssertionError("a forward pass started before the bad prompt was rejected")
    monkeypatch.setattr(gen_mod, "PaddedBatch", no_work)
    too_long = "word " * (tiny32.max_context + 10)
    with pytest.raises(ValueError, match="context"):
        generate_batch(tiny32, ["fine", too_long], max_new_tokens=4)


# --- demos ----------------------------------------------------------------------------------
def test_sweep_demo_smoke(tmp_path):
    from measure.cli import run_demo, save_outputs
    report = run_demo("sweep", model="tiny", device="cpu", dtype="fp32", quick=True)
    rows = report.tables[0].rows
    assert [r[0] for r in rows] == report.meta["options"]["batch_sizes"]
    assert all(r[1] > 0 for r in rows)   # total tok/s
    assert report.tables[0].columns[2:4] == ["ms/step", "ms/tok (per seq)"]
    # Every row gets its token at the same clock reading each step, so per-step and per-row ms/tok agree.
    assert all(r[2] > 0 and r[2] == pytest.approx(r[3]) for r in rows)
    paths = save_outputs("sweep", report, tmp_path)
    assert any(p.suffix == ".png" and p.stat().st_size > 0 for p in paths)


def test_waste_demo_smoke(tmp_path):
    from measure.cli import run_demo, save_outputs
    report = run_demo("waste_demo", model="tiny", device="cpu", dtype="fp32", quick=True)
    rows = report.tables[0].rows
    assert len(rows) == len(WASTE_DEMO_PROMPTS)
    steps = report.data["n_decode_steps"]
    assert all(r[1] + r[2] == steps for r in rows)   # needed + wasted = the batch's steps
    save_outputs("waste_demo", report, tmp_path)
