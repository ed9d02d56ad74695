"""Phase 2.3: continuous batching refills a freed slot in the same step, keeps every sequence's own
cache, and still produces HF generate's greedy tokens for every prompt."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from measure.bench import kv_bytes_per_token
from phases.p2_2_scheduler.sequence import Status
from phases.p2_3_continuous_batching.scheduler import ContinuousScheduler
from tests.test_p2_1_naive_batching import NEW_TOKENS, PROMPTS, reference
from tests.test_p2_2_scheduler import check_invariants, finished, requests, run_all


# --- the oracle ---------------------------------------------------------------------------------
def test_continuous_scheduler_equals_hf_generate(any32):
    # Two slots over four prompts: on SmolLM2 the France answer ends early and its
    # slot is handed to the next prompt mid-run; slot swapping must change nothing.
    s, done = run_all(ContinuousScheduler, any32, PROMPTS, max_running=2)
    assert [q.output_ids for q in done] == reference(any32)
    assert all(q.kv is None for q in done)


# --- properties -----------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(reqs=requests, max_running=st.integers(1, 4))
def test_continuous_scheduler_properties(tiny32, reqs, max_running):
    s = ContinuousScheduler(tiny32, max_running=max_running)
    for ids, n in reqs:
        s.add(ids, n, ignore_eos=True)
    done = s.run()
    check_invariants(s, len(reqs))
    assert [len(q.output_ids) for q in done] == [n for _, n in reqs]
    admitted_by: dict[int, int] = {}
    for r in s.trace.records:
        for sid in r.slots:
            if sid is not None:
                admitted_by.setdefault(sid, r.step)
        # Work-conserving: a slot is empty during a step only when nobody is left waiting.
        if None in r.slots:
            assert all(step <= r.step for step in admitted_by.values()) and len(admitted_by) == len(reqs)
        # No carried rows: every occupied slot does real work.
        assert all(w in ("prefill", "decode") for w in r.work if w is not None)
    # Each sequence's cache ended holding prompt + output - 1 tokens (the last token is never fed back).
    per_tok = kv_bytes_per_token(tiny32)
    for q in done:
        assert s.kv_bytes_at_finish[q.seq_id] == (q.n_tokens - 1) * per_tok


def test_freed_slot_goes_to_the_next_waiting_sequence_in_the_same_step(tiny32):
    s = ContinuousScheduler(tiny32, max_running=2)
    a, b, c = s.add([101, 102], 1), s.add([103], 3), s.add([104, 105, 106], 2)
    assert finished(s.step()) == [a]
    # a finished in this step, and c already holds its slot (to prefill next step).
    assert s.slots == [c, b] and c.status is Status.PREFILLING and isinstance(c.kv, DynamicCache)
    assert a.kv is None and a.status is Status.DONE
    s.step()                                      # c prefills while b decodes its second token
    assert c.status is Status.DECODING and len(b.output_ids) == 2
    assert sorted(q.seq_id for q in finished(s.step())) == [b.seq_id, c.seq_id] and not s.has_work
    assert s.returned_at[a.seq_id] < s.returned_at[b.seq_id]  # no waiting for the batch


def test_cache_hooks_can_be_overridden(tiny32):
    """Phase 3.3 subclasses the scheduler with another KV store; the hooks must be the only way in."""
    calls = {"new": 0, "free": 0}

    class Counting(ContinuousScheduler):
        def new_kv(self, seq):
            calls["new"] += 1
            return super().new_kv(seq)

        def free_kv(self, seq):
            calls["free"] += 1
            super().free_kv(seq)

    s = Counting(tiny32, max_running=2)
    for ids in ([101], [102, 103], [104]):
        s.add(ids, 2)
    s.run()
    assert calls == {"new": 3, "free": 3}


def test_many_prompts_one_slot_equals_per_prompt_generate(tiny32):
    s, done = run_all(ContinuousScheduler, tiny32, PROMPTS, max_running=1, n=6)
    assert [q.output_ids for q in done] == reference(tiny32, PROMPTS, 6)


# --- demos and notebook -------------------------------------------------------------------------------
def test_latency_demo_smoke(tmp_path):
    from measure.cli import run_demo, save_outputs
    report = run_demo("latency_demo", model="tiny", device="cpu", dtype="fp32", quick=True)
    rows = report.tables[0].rows
    assert len(rows) == len(report.data["prompts"])
    assert {"static", "continuous"} <= set(report.data["timelines"])
    paths = save_outputs("latency_demo", report, tmp_path)
    assert any(p.suffix == ".png" for p in paths)


def test_blog_lengths_replay_the_blogs_steps():
    from common.prompts import LATENCY_DEMO_BLOG_STEPS, interleaved_latency_prompts
    from phases.p2_3_continuous_batching.demo import blog_lengths
    prompts = interleaved_latency_prompts()
    # The blog's table, in its order: short and long prompts alternating.
    assert [LATENCY_DEMO_BLOG_STEPS[p] for p in prompts] == [9, 1269, 24, 443, 23, 1592, 2, 913]
    assert blog_lengths(prompts) == [LATENCY_DEMO_BLOG_STEPS[p] + 1 for p in prompts]   # + the prefill's token
    assert blog_lengths(prompts, 0.25) == [3, 318, 7, 112, 7, 399, 2, 229]   # scaled, rounded, at least 1 step
    with pytest.raises(ValueError):
        blog_lengths(prompts, 0)
    with pytest.raises(ValueError):
        blog_lengths(["Tell me a joke about cats."])


def test_latency_demo_blog_lengths_run_each_request_its_length_with_eos_ignored(tiny32, monkeypatch):
    from common.prompts import interleaved_latency_prompts
    from phases.p2_3_continuous_batching.demo import QUICK_LENGTH_SCALE, blog_lengths, compare_schedulers
    from measure.cli import run_demo
    prompts = interleaved_latency_prompts()
    want = [n - 1 for n in blog_lengths(prompts, QUICK_LENGTH_SCALE)]
    report = run_demo("latency_demo", model="tiny", device="cpu", dtype="fp32", quick=True,
                      options={"lengths": "blog"})
    assert report.data["steps"] == want and report.data["ignore_eos"]
    assert [r[4] for r in report.tables[0].rows] == want and "blog speedup" in report.tables[0].columns
    # Every token an EOS: the blog's lengths still run to the end, under both schedulers.
    monkeypatch.setattr(tiny32, "eos_token_ids", set(range(tiny32.vocab_size)))
    d = compare_schedulers(tiny32, prompts[:4], 2, [3, 5, 2, 4], ignore_eos=True)
    assert d["steps"] == [2, 4, 1, 3] and all(d["same_output"])
    assert compare_schedulers(tiny32, prompts[:4], 2, [3, 5, 2, 4])["steps"] == [0, 0, 0, 0]   # the check bites


def test_wall_demo_smoke(tmp_path):
    from measure.cli import run_demo, save_outputs
    report = run_demo("wall", model="tiny", device="cpu", dtype="fp32", quick=True)
    rows = report.tables[0].rows
    assert [r[0] for r in rows] == report.data["concurrency"]
    assert all(0 <= r[4] <= 100 for r in rows)   # wasted %
    save_outputs("wall", report, tmp_path)


@pytest.mark.notebook("02_batching.ipynb")
def test_notebook_runs():
    from tests.nbrun import run_notebook
    run_notebook("02_batching.ipynb")


def test_latency_demo_runs_to_the_blogs_cap_on_a_gpu():
    # The blog's long answers ran 443-1,592 steps under a 2048-token cap; the CPU default stays short.
    from common.prompts import LATENCY_DEMO_MAX_TOKENS
    from measure.demos import get
    demo = get("latency_demo")
    assert demo.resolve(on_gpu=True)["max_new_tokens"] == 2048
    assert demo.resolve(on_gpu=False)["max_new_tokens"] == LATENCY_DEMO_MAX_TOKENS
