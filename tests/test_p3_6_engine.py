"""BatchedPagedEngine: one batched forward pass per step, outputs equal HF generate token for token."""

import json

import pytest
import torch

from common.sampling import SamplingParams
from phases.p2_2_scheduler.sequence import Status
from phases.p3_6_batched_engine.engine import BatchedPagedEngine
from tests.oracles import hf_greedy

PROMPTS = [
    "What is the capital of France?",
    "Name one fruit.",
    "Explain in detail how the attention mechanism works in a transformer.",
    "What is 2 + 2?",
    "Write a short story about a robot who learns to paint.",
]


def _run(lm, prompts, max_new_tokens, **engine_kwargs):
    engine = BatchedPagedEngine(lm, **engine_kwargs)
    seqs = [engine.add(p, max_new_tokens=max_new_tokens) for p in prompts]
    engine.run()
    return engine, seqs


def test_greedy_equals_hf_generate_packaged_model(smol32):
    # max_running=3 < 5 prompts: two requests are admitted mid-run, next to running ones.
    # Block size 16 here; the tiny-model test below covers small blocks and many boundaries.
    engine, seqs = _run(smol32, PROMPTS, 16, max_running=3, block_size=16, n_blocks=256)
    for seq in seqs:
        assert seq.output_ids == hf_greedy(smol32, seq.prompt_ids, 16), seq.prompt
    assert engine.allocator.n_free == engine.allocator.n_blocks  # every block came back


def test_greedy_equals_hf_generate_tiny_model_block_boundaries(tiny32):
    engine = BatchedPagedEngine(tiny32, max_running=4, block_size=4, n_blocks=128)
    # random-token prompts of many lengths, none a multiple of the block size by design or by luck
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (n,), generator=gen).tolist() for n in (1, 3, 5, 9, 14, 22)]
    seqs = [engine.add(p, 11, ignore_eos=True) for p in prompts]
    engine.run()
    for seq in seqs:
        assert seq.output_ids == hf_greedy(tiny32, seq.prompt_ids, 11, ignore_eos=True)
    assert engine.allocator.n_free == engine.allocator.n_blocks


def test_one_forward_pass_per_phase_of_a_step(tiny32):
    engine = BatchedPagedEngine(tiny32, max_running=8, block_size=4, n_blocks=64)
    for n in (3, 6, 9):
        engine.add(list(range(200, 200 + n)), 5, ignore_eos=True)
    engine.run()
    # step 1 prefills all three in one pass; steps 2..5 decode all three in one pass each
    assert engine.n_steps == 5 and engine.n_forward_passes == 5


def test_attention_switch_walks_the_model_once_per_name_then_only_sets_the_config(tiny32, monkeypatch):
    # transformers' set_attn_implementation walks every submodule (~1 ms a call on a 28-layer model) and the
    # engine switches twice per step: after a model has met a name once, only the config's setter runs.
    from transformers import PreTrainedModel
    from phases.p3_6_batched_engine.attention import ATTN_NAME, use_paged_attention
    model = tiny32.model
    with use_paged_attention(model):
        pass                                            # each name checked by transformers once
    before = model.config._attn_implementation
    calls = []
    full_switch = PreTrainedModel.set_attn_implementation
    monkeypatch.setattr(PreTrainedModel, "set_attn_implementation",
                        lambda self, *a, **k: (calls.append(a), full_switch(self, *a, **k)))
    seen = []
    engine = BatchedPagedEngine(tiny32, max_running=2, block_size=4, n_blocks=64)
    seq = engine.add(list(range(200, 209)), 6, ignore_eos=True)
    for _ in range(3):
        engine.step()
        seen.append(model.config._attn_implementation)
    engine.run()
    assert calls == []                                  # no walk: the name was checked before
    assert seen == [before] * 3                         # and switched back after every step
    assert seq.output_ids == hf_greedy(tiny32, seq.prompt_ids, 6, ignore_eos=True)
    with use_paged_attention(model):
        assert model.config._attn_implementation == ATTN_NAME
        assert all(m.config._attn_implementation == ATTN_NAME for m in model.modules()
                   if isinstance(m, PreTrainedModel))


def test_attention_switch_takes_the_full_walk_when_a_submodel_has_its_own_config(tiny32, monkeypatch):
    import copy
    from transformers import PreTrainedModel
    from phases.p3_6_batched_engine.attention import ATTN_NAME, use_paged_attention
    model = copy.deepcopy(tiny32.model)
    model.model.config = copy.deepcopy(model.config)    # the inner model no longer shares the top config
    calls = []
    full_switch = PreTrainedModel.set_attn_implementation
    monkeypatch.setattr(PreTrainedModel, "set_attn_implementation",
                        lambda self, *a, **k: (calls.append(a), full_switch(self, *a, **k)))
    for _ in range(2):
        with use_paged_attention(model):
            assert model.model.config._attn_implementation == ATTN_NAME   # reached through the walk
    assert len(calls) == 4                              # in and back, every time


def test_index_plans_are_made_once_per_forward_pass_not_per_layer(tiny32, monkeypatch):
    from phases.p3_4_gather_kernel.dispatch import FORCE_KERNELS_ENV
    from extras.p3_5_paged_attention import cpu_path as plans
    monkeypatch.setenv(FORCE_KERNELS_ENV, "0")  # plans belong to the CPU path
    made = {"write": 0, "decode": 0}
    for kind, fn in (("write", plans.plan_write), ("decode", plans.plan_decode)):
        def counted(*args, _fn=fn, _kind=kind, **kwargs):
            made[_kind] += 1
            return _fn(*args, **kwargs)
        monkeypatch.setattr(plans, f"plan_{kind}", counted)
    assert tiny32.model.config.num_hidden_layers > 1
    engine = BatchedPagedEngine(tiny32, max_running=8, block_size=4, n_blocks=64)
    for n in (3, 6, 9):
        engine.add(list(range(200, 200 + n)), 5, ignore_eos=True)
    engine.run()
    # 5 passes write K/V (1 prefill + 4 decode); the 4 decode passes read the pool by block table
    assert made == {"write": 5, "decode": 4}


def test_every_state_visited_once_and_blocks_freed_as_sequences_finish(tiny32):
    engine = BatchedPagedEngine(tiny32, max_running=2, block_size=4, n_blocks=32)
    seqs = [engine.add([300 + i] * (2 + i), 2 + 3 * i, ignore_eos=True) for i in range(4)]
    while engine.has_work:
        engine.step()
        held = sum(s.kv.n_blocks for s in engine.running)
        assert engine.allocator.n_used == held
    for s in seqs:
        assert s.history == [Status.WAITING, Status.PREFILLING, Status.DECODING, Status.DONE]
        assert len(s.output_ids) == s.max_new_tokens


def test_steps_stream_each_token_once_and_run_reports_progress(tiny32):
    """The engine keeps phase 2.2's shape: step() -> one StepOutput per token, run(progress(n_finished, n_added))."""
    engine = BatchedPagedEngine(tiny32, max_running=2, block_size=4, n_blocks=32)
    seqs = [engine.add([400 + i] * (3 + i), 2 + i, ignore_eos=True) for i in range(3)]
    streamed = {s.seq_id: [] for s in seqs}
    while engine.has_work:
        for out in engine.step():
            streamed[out.seq.seq_id].append(out.token_id)
            assert out.finished == (out.seq.status is Status.DONE)
    assert all(streamed[s.seq_id] == s.output_ids for s in seqs)
    calls, steps_before = [], engine.n_steps
    engine.add([500, 501], 3, ignore_eos=True)
    assert [s.seq_id for s in engine.run(progress=lambda done, added: calls.append((done, added)))] == [0, 1, 2, 3]
    assert calls == [(3, 4), (3, 4), (4, 4)] and engine.n_steps - steps_before == 3


def test_seeded_sampling_is_reproducible(tiny32):
    params = SamplingParams(temperature=0.9, top_k=50, top_p=0.9, seed=1234)
    runs = []
    for _ in range(2):
        engine = BatchedPagedEngine(tiny32, block_size=4, n_blocks=64)
        seq = engine.add("Name one fruit.", max_new_tokens=8, sampling=params, ignore_eos=True)
        engine.run()
        runs.append(seq.output_ids)
    assert runs[0] == runs[1]


def test_abort_frees_blocks_at_once(tiny32):
    engine = BatchedPagedEngine(tiny32, block_size=4, n_blocks=32)
    a = engine.add(list(range(300, 310)), 20, ignore_eos=True)
    engine.add(list(range(400, 405)), 3, ignore_eos=True)
    engine.step()
    engine.step()
    engine.abort(a)
    assert a.finish_reason == "abort" and a.status is Status.DONE
    engine.run()
    assert engine.allocator.n_free == engine.allocator.n_blocks


def test_bad_input_is_refused_up_front(tiny32):
    engine = BatchedPagedEngine(tiny32, block_size=4, n_blocks=8)
    with pytest.raises(ValueError, match="empty prompt"):
        engine.add("", 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.add([5, 6], 0)
    with pytest.raises(ValueError, match="context"):
        engine.add([5] * tiny32.max_context, 1)
    with pytest.raises(ValueError, match="whole pool"):
        engine.add([5] * 30, 10)   # 40 tokens > 8 blocks x 4
    with pytest.raises(ValueError, match="max_running"):
        BatchedPagedEngine(tiny32, max_running=0, n_blocks=8)
    assert not engine.has_work  # nothing half-queued
    assert engine.add([5, 6], 2).seq_id == 0  # a refused request took no id


def test_runners_agree_with_each_other(tiny32):
    from measure.workload import mixed_work
    from measure.hf_peers import run_hf_cb, run_hf_compiled, run_hf_static
    from phases.p2_1_naive_batching.demo import run_static
    from phases.p3_6_batched_engine.demo import run_batched

    requests = mixed_work(tiny32.vocab_size, n=5, prompt_len=(3, 9), output_len=(2, 7))
    expected = [hf_greedy(tiny32, r.prompt_ids, r.max_new_tokens, ignore_eos=True) for r in requests]
    for run in (run_batched, run_static, run_hf_static, run_hf_compiled, run_hf_cb):
        result = run(tiny32, requests, 3)
        assert result.outputs == expected, run.__name__
        assert [t.n_generated for t in result.timings] == [r.max_new_tokens for r in requests]
        assert result.kv_peak_bytes > 0
        assert result.settings, f"{run.__name__} does not say what it ran with"


def test_hf_compiled_peer_runs_a_static_cache_and_equals_hf_greedy(tiny32):
    # On CPU transformers does not compile (only on accelerators), so both calls run the eager
    # static-cache path; the compiled path is for the gpu tier. EOS honoured here, unlike above.
    from measure.workload import Request
    from measure.hf_peers import run_hf_compiled

    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, 40000, (n,), generator=gen).tolist() for n in (2, 7, 12)]
    requests = [Request(prompt_ids=p, max_new_tokens=n) for p, n in zip(prompts, (9, 4, 6))]
    for compile in (False, True):
        result = run_hf_compiled(tiny32, requests, 2, compile=compile)
        assert result.outputs == [hf_greedy(tiny32, r.prompt_ids, r.max_new_tokens) for r in requests]
        s = result.settings
        assert s["cache_implementation"] == "static" and s["compiled"] is False and s["disable_compile"] is True
        assert s["rows"] == 3 and s["padded_prompt_len"] == 12 and s["max_new_tokens"] == 9
        assert s["static_cache_len"] == f">= {12 + 9 - 1}"
        for t in result.timings:   # CPU: one clock reading per step, in order, after the arrival
            assert t.arrival <= t.first_token <= t.finish and t.token_times == sorted(t.token_times)


def test_peers_run_on_cuda_by_default_and_anywhere_by_name():
    from measure.demos import get
    from measure.harness import pick_engines
    from measure.hf_peers import HF_COMPILED
    from phases.p3_6_batched_engine.demo import ALL_ENGINES, ON_REQUEST, default_engines

    assert HF_COMPILED not in default_engines(on_gpu=False)
    assert default_engines(on_gpu=True) == ALL_ENGINES + [HF_COMPILED]
    assert pick_engines(default_engines(on_gpu=False), ["hf_compiled", "batched"], ON_REQUEST) == [
        next(e for e in ALL_ENGINES if e.name == "batched"), HF_COMPILED]
    bench = get("workload_bench")
    assert "hf_compiled" in bench.resolve(on_gpu=True)["engines"]
    assert "hf_compiled" not in bench.resolve(on_gpu=False)["engines"]


def test_workload_bench_and_tput_demos_run_quick():
    from measure.cli import run_demo

    report = run_demo("workload_bench", model="tiny", device="cpu", dtype="fp32", quick=True)
    titles = [t.title for t in report.tables]
    assert any(t.startswith("equal work") for t in titles) and any(t.startswith("mixed work") for t in titles)
    assert any("roofline" in t for t in titles)
    ratios = next(t for t in report.tables if t.title.startswith("Ratios"))
    assert len(ratios.rows) == 4
    # Every row says how it ran and how it was warmed up, in the data and in the table notes.
    json.dumps(report.data)
    equal = next(t for t in report.tables if t.title.startswith("equal work"))
    for name, row in report.data["results"]["equal"].items():
        assert row["settings"] and row["warmup"].startswith("warmed up by one untimed run")
        assert any(n.startswith(f"{name} settings: ") for n in equal.notes)
    rows = report.data["results"]["equal"]
    assert rows["batched"]["settings"]["block_size"] == 16 and rows["batched"]["settings"]["max_running"] == 4
    assert rows["hf_static"]["settings"]["cache_implementation"].startswith("dynamic")
    assert rows["hf_cb"]["settings"]["page_size"] == 16
    report = run_demo("tput", model="tiny", device="cpu", dtype="fp32", quick=True)
    engines = report.data["engines"]
    assert {"static", "dyn", "paged", "batched", "hf_cb"} <= set(engines)
    assert all("DIFFER" not in n for t in report.tables for n in t.notes)


# --- attention as the model defines it: a sliding window, a softcap, or a clear refusal ---------------------
WINDOW_MODELS = ["tiny-sliding", "tiny-softcap"]   # Mistral (every layer windowed); Gemma 2 (softcap, mixed layers)


@pytest.fixture(scope="module")
def window_models():
    from common.model import load_model
    return {name: load_model(name, device="cpu", dtype=torch.float32) for name in WINDOW_MODELS}


def window_prompts(lm) -> list[list[int]]:
    """Prompts longer than the window (and one shorter), none a multiple of the block size (4)."""
    from common.model import TINY_WINDOW
    gen = torch.Generator().manual_seed(7)
    lengths = (3, TINY_WINDOW + 2, 14, 23)
    assert max(lengths) > TINY_WINDOW and min(lengths) < TINY_WINDOW
    return [torch.randint(100, 40000, (n,), generator=gen).tolist() for n in lengths]


def _run_ids(engine, prompts, max_new_tokens):
    seqs = [engine.add(p, max_new_tokens, ignore_eos=True) for p in prompts]
    engine.run()
    assert engine.allocator.n_free == engine.allocator.n_blocks
    return [s.output_ids for s in seqs]


@pytest.mark.parametrize("name", WINDOW_MODELS)
def test_window_and_softcap_models_equal_hf_generate_past_the_window(window_models, name):
    lm = window_models[name]
    prompts = window_prompts(lm)
    expected = [hf_greedy(lm, p, 10, ignore_eos=True) for p in prompts]
    engine = BatchedPagedEngine(lm, max_running=2, block_size=4, n_blocks=64)
    assert _run_ids(engine, prompts, 10) == expected


@pytest.mark.parametrize("name", WINDOW_MODELS)
def test_an_attention_that_drops_the_window_and_softcap_gives_other_tokens(window_models, name, monkeypatch):
    """The control: the same engine with the layer's window and softcap ignored is wrong on these models,
    so the test above can fail."""
    from transformers import AttentionInterface
    from phases.p3_6_batched_engine import attention

    def ignoring(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, paged=None,
                 sliding_window=None, softcap=None, **kwargs):
        return attention.paged_attention_forward(module, query, key, value, attention_mask, scaling, dropout,
                                                 paged=paged, **kwargs)

    lm = window_models[name]
    prompts = window_prompts(lm)
    expected = [hf_greedy(lm, p, 10, ignore_eos=True) for p in prompts]
    monkeypatch.setattr(attention, "check_call", lambda *args: None)
    AttentionInterface.register(attention.ATTN_NAME, ignoring)
    try:
        got = _run_ids(BatchedPagedEngine(lm, max_running=2, block_size=4, n_blocks=64), prompts, 10)
    finally:
        AttentionInterface.register(attention.ATTN_NAME, attention.paged_attention_forward)
    assert got != expected


def test_attention_the_pool_cannot_compute_is_refused_by_name():
    from common.model import load_model
    from phases.p3_6_batched_engine.attention import UnsupportedAttention

    lm = load_model("tiny", device="cpu", dtype=torch.float32)        # a private copy: mutated below
    lm.model.config.attention_chunk_size = 8
    with pytest.raises(UnsupportedAttention, match="chunked attention"):
        BatchedPagedEngine(lm, n_blocks=8)
    lm.model.config.attention_chunk_size = None
    lm.model.config.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(UnsupportedAttention, match="linear_attention"):
        BatchedPagedEngine(lm, n_blocks=8)
    lm.model.config.layer_types = None
    attn = lm.model.model.layers[1].self_attn
    attn.sinks = torch.nn.Parameter(torch.zeros(lm.n_heads))
    with pytest.raises(UnsupportedAttention, match="attention sinks"):
        BatchedPagedEngine(lm, n_blocks=8)
    del attn.sinks
    attn.is_causal = False
    with pytest.raises(UnsupportedAttention, match="bidirectional"):
        BatchedPagedEngine(lm, n_blocks=8)
    attn.is_causal = True
    # A window the config declares but the attention call does not pass would be silently ignored: refused.
    lm.model.config.sliding_window = 4
    engine = BatchedPagedEngine(lm, block_size=4, n_blocks=8)
    engine.add([5, 6, 7], 2)
    with pytest.raises(UnsupportedAttention, match="declares a sliding window of 4"):
        engine.step()
