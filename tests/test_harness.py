"""The benchmark harness in common/: engine runners and `measure`, the `tput` sweep, the kernel-bench
sweep, the roofline and step profiler, the plots. Engines here are stand-ins that record their calls,
so each test checks what the harness does, not what an engine does; no phase is imported."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from common.bench import SeqTiming
from common.demos import RunConfig
from common.harness import (WARMUP_NEW_TOKENS_CPU, EngineRun, EngineRunner, PeakKV, measure, pick_engines,
                            run_prompts, warmup_requests, workload_pool_blocks)
from common.prompts import interleaved_latency_prompts
from common.report import REPO_ROOT, shorten
from common.workload import Request

HARNESS_MODULES = ["common.harness", "common.tput", "common.kernel_bench", "common.hf_peers", "common.roofline",
                   "common.progress", "common.plots"]


def test_the_harness_imports_no_phase():
    code = (f"import sys\nfor m in {HARNESS_MODULES!r}:\n    __import__(m)\n"
            "bad = sorted(m for m in sys.modules if m.startswith('phases'))\nprint(bad)\nsys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


# --- runners and measure ------------------------------------------------------------------------
def recording_runner(calls: list, name: str = "rec") -> EngineRunner:
    """An engine that does no work: it notes each call's (prompt ids, new tokens, max_running)."""
    def run(lm, requests, max_running):
        calls.append(([r.ids(lm) for r in requests], [r.max_new_tokens for r in requests], max_running))
        timings = [SeqTiming(arrival=0.0) for _ in requests]
        for t, r in zip(timings, requests):
            for i in range(r.max_new_tokens):
                t.token(1.0 + i)
        return EngineRun([[0] * r.max_new_tokens for r in requests], timings, 1,
                         settings=dict(max_running=max_running, knob="x"))
    return EngineRunner(name, "records its calls", run)


def test_measure_warms_up_on_the_workloads_own_shapes(tiny32):
    from common.tput import tput_requests
    calls = []
    requests = tput_requests(interleaved_latency_prompts(), 3, new_tokens=5)
    row = measure(tiny32, recording_runner(calls), requests, 2)
    (warm_ids, warm_new, warm_bs), (ids, new, bs) = calls
    # CPU: the same prompts and max_running (same prefill shapes), only a couple of new tokens.
    assert warm_ids == ids and warm_bs == bs == 2
    assert warm_new == [WARMUP_NEW_TOKENS_CPU] * 3 and new == [5] * 3
    assert row["settings"] == dict(max_running=2, knob="x") and "untimed" in row["warmup"]
    assert row["total_tokens"] == 15 and row["tok_s"] > 0
    # CUDA: exactly the requests to be timed (compiled code is built for their shapes).
    assert warmup_requests(SimpleNamespace(device="cuda:0"), requests) == requests
    measure(tiny32, recording_runner(calls := []), requests, 2, warm=False)
    assert len(calls) == 1


def test_engine_selection():
    dyn, paged, extra = (EngineRunner(n, n, run=None) for n in ("dyn", "paged", "extra"))
    engines = [dyn, paged]
    assert pick_engines(engines, ["paged"]) == [paged]
    assert pick_engines(engines, []) == engines
    with pytest.raises(ValueError, match="unknown engine"):
        pick_engines(engines, ["vllm"])
    # An on-request engine runs only when named, after the default ones.
    assert pick_engines(engines, [], [extra]) == engines
    assert pick_engines(engines, ["extra", "dyn"], [extra]) == [dyn, extra]


def test_engine_run_from_sequences_is_in_request_order():
    seqs = [SimpleNamespace(seq_id=i, output_ids=[i, i], timing=SeqTiming(arrival=float(i))) for i in (2, 0, 1)]
    run = EngineRun.from_sequences(seqs, kv_peak_bytes=7, note="n", settings={"a": 1})
    assert run.outputs == [[0, 0], [1, 1], [2, 2]] and [t.arrival for t in run.timings] == [0.0, 1.0, 2.0]
    assert (run.kv_peak_bytes, run.note, run.settings) == (7, "n", {"a": 1})


class FakeScheduler:
    """Holds one KV byte per token of each running sequence; each step every one grows by a token,
    then the oldest finishes."""

    def __init__(self, lengths):
        self.running = [SimpleNamespace(n=n) for n in lengths]
        self.freed = []

    def kv_bytes(self, seq):
        return seq.n

    def free_kv(self, seq):
        self.freed.append(seq.n)

    def step(self):
        for s in self.running:
            s.n += 1
        done = self.running[0]
        self.free_kv(done)            # as phase 2.3 retires: KV back first, then the slot
        self.running.remove(done)
        return [done]


class MeasuredFake(PeakKV, FakeScheduler):
    pass


def test_peak_kv_is_sampled_before_a_finished_sequence_lets_go():
    sched = MeasuredFake([3, 5])
    sched.step()                                   # both grow to 4 + 6 = 10, then one leaves
    assert sched.peak_kv_bytes == 10 and sched.freed == [4]
    sched.step()
    assert sched.peak_kv_bytes == 10               # 7 alone is below the peak


def test_workload_pool_blocks_fits_every_worst_case(tiny32):
    requests = [Request(prompt_ids=[5] * 10, max_new_tokens=7), Request(prompt_ids=[5] * 3, max_new_tokens=1)]
    # 10 + 7 - 1 = 16 positions: 4 blocks of 4; 3 + 1 - 1 = 3: 1 block (the last token is never fed back)
    assert workload_pool_blocks(tiny32, requests, block_size=4) == 5


def test_run_prompts_gives_every_prompt_one_arrival_and_returns_in_order():
    class Engine:
        lm = SimpleNamespace(device="cpu")

        def __init__(self):
            self.added = []

        def add(self, prompt, max_new_tokens, arrival=None):
            self.added.append((prompt, max_new_tokens, arrival))

        def run(self, progress=None):
            for i in range(len(self.added)):
                progress(i + 1, len(self.added))
            return [p for p, _, _ in self.added]

    engine = Engine()
    t0, done = run_prompts(engine, ["a", "b"], 3, "test")
    assert done == ["a", "b"] and {a for *_, a in engine.added} == {t0} and {n for _, n, _ in engine.added} == {3}


# --- the tput sweep ---------------------------------------------------------------------------------
def test_tput_warms_each_cell_once_and_reports_settings(tiny32):
    from common.tput import run_tput
    cfg = RunConfig(model="tiny", device="cpu", dtype="fp32", _lm=tiny32)
    cfg.options = dict(batch_sizes=[1, 2], new_tokens=4, engines=[], repeats=2)
    calls = []
    report = run_tput(cfg, [recording_runner(calls)], kv_note="how KV is counted")
    # Run 1: warm-up then timed run, per batch size; run 2: timed runs only.
    assert [(len(ids), new[0], bs) for ids, new, bs in calls] == [
        (1, WARMUP_NEW_TOKENS_CPU, 1), (1, 4, 1), (2, WARMUP_NEW_TOKENS_CPU, 2), (2, 4, 2), (1, 4, 1), (2, 4, 2)]
    assert calls[0][0] == calls[1][0] and calls[2][0] == calls[3][0]   # warmed on the prompts it then timed
    kv, speed = report.tables
    assert kv.notes == ["how KV is counted"]
    assert "rec settings at batch 2: max_running=2, knob=x" in speed.notes
    assert any(n.startswith("every engine at every batch size: warmed up") for n in speed.notes)
    assert all(r["settings"]["max_running"] == r["batch_size"] for r in report.data["rows"])


def test_tput_compares_every_engines_outputs_with_the_first(tiny32, tmp_path):
    from common.tput import plot_tput, run_tput

    def differs(lm, requests, max_running):
        run = recording_runner([]).run(lm, requests, max_running)
        run.outputs = [[1] * len(o) for o in run.outputs]
        return run

    cfg = RunConfig(model="tiny", device="cpu", dtype="fp32", _lm=tiny32, quick=True)
    cfg.options = dict(batch_sizes=[8], new_tokens=64, engines=[], repeats=3)
    report = run_tput(cfg, [recording_runner([], "a"), recording_runner([], "b"), EngineRunner("c", "", differs)])
    assert report.data["batch_sizes"] == [1, 2] and report.data["new_tokens"] == 4 and report.data["repeats"] == 1
    notes = report.tables[1].notes
    assert "b: outputs identical to a's" in notes and "c: outputs DIFFER from a's" in notes
    plot_tput(report, tmp_path / "tput.png")
    assert (tmp_path / "tput.png").stat().st_size > 0


# --- the kernel-bench sweep -----------------------------------------------------------------------
def test_lengths_for_mixes_lengths_and_is_reproducible():
    from common.kernel_bench import lengths_for
    lens = lengths_for(100, 8)
    assert lens[0] == 100 and all(50 <= n <= 100 for n in lens) and len(lens) == 8
    assert lengths_for(100, 8) == lens and lengths_for(100, 8, seed=1) != lens


def test_median_ms_warms_up_then_times_every_call():
    from common.kernel_bench import median_ms
    calls = []
    ms = median_ms(lambda: calls.append(1), "cpu", warmup=2, iters=5)
    assert len(calls) == 7 and ms >= 0


def test_kernel_sweep_walks_the_grid_and_checks_the_kernel_once_on_cpu(tiny32):
    from common.kernel_bench import NOT_TIMED_CPU, QUICK, kernel_options, kernel_sweep
    cfg = RunConfig(model="tiny", device="cpu", dtype="fp32", _lm=tiny32, quick=True)
    cfg.options = {o.name: o.default(on_gpu=False) for o in kernel_options()}
    seen = []

    def measure_cell(case):
        seen.append((case.batch_size, case.context, case.check_kernel))
        assert len(case.lens) == case.batch_size and max(case.lens) == case.context
        kernel = case.time_kernel(lambda: None)
        return [case.batch_size, case.context, case.time(lambda: None), kernel], dict(batch=case.batch_size)

    report, table = kernel_sweep(cfg, "bench", "title", ["batch", "context", "ms", "kernel ms"], measure_cell)
    grid = [(b, c) for b in QUICK["batch_sizes"] for c in QUICK["context_lens"]]
    assert [(b, c) for b, c, _ in seen] == grid
    assert [check for *_, check in seen] == [True] + [False] * (len(grid) - 1)   # CPU: first cell only
    assert all(row[3] == NOT_TIMED_CPU for row in table.rows)
    assert report.data["rows"] == [dict(batch=b) for b, _ in grid]
    assert report.meta["options"]["iters"] == QUICK["iters"]   # the report says what really ran


# --- roofline and step profile --------------------------------------------------------------------
def test_roofline_ceiling_and_step_profile():
    from common.roofline import measure_matmul_flops, profile_decode_step, roofline_tokens_per_s
    assert roofline_tokens_per_s(2e9, 1_000_000) == 1000.0
    assert measure_matmul_flops(torch.float32, "cpu", n=64, repeats=2) > 0
    a = torch.randn(64, 64)
    engine = SimpleNamespace(lm=SimpleNamespace(device="cpu"), step=lambda: a @ a)
    ops = profile_decode_step(engine, top=3)
    assert 1 <= len(ops) <= 3 and any("mm" in op["op"] for op in ops)
    assert all(0 <= op["share"] <= 1 for op in ops)


# --- small helpers ----------------------------------------------------------------------------------
def test_shorten_and_use_quick():
    assert shorten("abcdef", 6) == "abcdef" and shorten("abcdefg", 6) == "abcde…"
    assert shorten("abcdefg", 6, ellipsis="...") == "abc..."
    cfg = RunConfig(options={"n": 10, "m": 1})
    cfg.use_quick(n=2)
    assert cfg.n == 10
    cfg.quick = True
    cfg.use_quick(n=2)
    assert (cfg.n, cfg.m) == (2, 1)


def test_every_plot_helper_writes_a_png(tmp_path):
    from common import plots
    paths = [
        plots.side_by_side(tmp_path / "a.png", [1, 2, 4], {"y1": {"s": [1, 2, 3]}, "y2": {"s": [3, 2, 1]}}, "x"),
        plots.hbars_used_and_wasted(tmp_path / "b.png", ["p", "q"], [3, 5], [2, 0], "used", "wasted", "steps"),
        plots.gantt(tmp_path / "c.png", {"one": [dict(row=0, start=0, end=2, color=1, label="s0"),
                                                 dict(row=1, start=1, end=3, color=2, label="s1", hatched=True)]},
                    n_rows=2, row_name="slot", xlabel="s"),
        plots.per_batch_timings(tmp_path / "d.png", [dict(batch=1, context=8, a=1.0, b=None),
                                                     dict(batch=1, context=16, a=2.0, b=None)],
                                {"a": "timed", "b": "not timed"}, ylabel="ms"),
        plots.twin_lines(tmp_path / "e.png", [1, 2], ("l", [1, 2]), ("r", [10, 100]), "x", right_logy=True),
    ]
    assert all(p.stat().st_size > 0 for p in paths)
