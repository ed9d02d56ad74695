"""The benchmark harness in measure/: engine runners and `measure`, the `tput` sweep, `workload_bench`, the
kernel-bench sweep, the roofline and step profiler, step-timed traces and `drive`, pool checks, the plots.
Engines here are stand-ins that record their calls, so each test checks what the harness does, not what
an engine does; no phase is imported."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from common.clock import SeqTiming
from common.prompts import interleaved_latency_prompts
from measure.bench import ceil_div
from measure.demos import RunConfig
from measure.harness import (WARMUP_NEW_TOKENS_CPU, EngineRun, EngineRunner, PeakKV, drive, measure, outputs_of,
                            pick_engines, pool_problems, run_prompts, warmup_requests, workload_pool_blocks)
from measure.report import REPO_ROOT, shorten
from measure.workload import Request

# One phase's own bench, tuning sweep, compile check or test inputs, moved out of its folder so a reader of the
# phase does not meet them: each drives that phase's kernel or engine directly, so it imports it.
PHASE_TOOLS = {"measure.decode_aot_check", "measure.decode_bench", "measure.decode_tuning", "measure.fused_aot_check",
               "measure.paged_inputs", "measure.preempt_checks", "measure.prefill_aot_check"}
# Every other module of the measurement package: it sits above the phases, and a demo hands it their engines.
HARNESS_MODULES = sorted(f"measure.{p.stem}" for p in (REPO_ROOT / "measure").glob("*.py")
                         if f"measure.{p.stem}" not in PHASE_TOOLS)


def test_the_phase_tools_exist():
    assert {m for m in PHASE_TOOLS if (REPO_ROOT / "measure" / f"{m.split('.')[1]}.py").exists()} == PHASE_TOOLS


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
    from measure.tput import tput_requests
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


def test_run_prompts_passes_add_options_through():
    class Engine:
        lm = SimpleNamespace(device="cpu")
        added = []

        def add(self, prompt, max_new_tokens, arrival=None, **options):
            self.added.append(options)

        def run(self, progress=None):
            return []

    engine = Engine()
    run_prompts(engine, ["a", "b"], 3, "test", ignore_eos=True)
    assert engine.added == [dict(ignore_eos=True)] * 2


def test_pool_problems_names_a_leak_and_runs_the_pools_own_checks():
    class Pool:
        n_blocks, checked = 8, 0

        def __init__(self, n_free):
            self.n_free = n_free
            self.n_used = self.n_blocks - n_free

        def check_invariants(self):
            Pool.checked += 1

    assert pool_problems(Pool(8)) == []
    assert pool_problems(Pool(5), "CPU pool") == ["CPU pool: 3 blocks leaked"]
    assert Pool.checked == 2


def test_ceil_div_and_a_timing_cut_to_its_first_tokens():
    assert [ceil_div(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    t = SeqTiming(arrival=0.0)
    for when in (1.0, 2.0, 3.0, 4.0):
        t.token(when)
    first = t.first(2)
    assert (first.arrival, first.first_token, first.finish, first.n_generated) == (0.0, 1.0, 2.0, 2)


# --- step-timed traces and `drive` ----------------------------------------------------------------
def test_traces_are_seeded_and_mix_the_kinds_they_are_asked_for():
    from measure.workload import FIRST_ORDINARY_TOKEN_ID, burst, demand_tokens, stress_trace
    b = burst(500, 6, (3, 9), (2, 5), seed=4)
    assert b == burst(500, 6, (3, 9), (2, 5), seed=4) and b != burst(500, 6, (3, 9), (2, 5), seed=5)
    assert all(3 <= len(r.prompt_ids) <= 9 and 2 <= r.max_new_tokens <= 5 and r.arrival_step == 0 for r in b)
    assert all(FIRST_ORDINARY_TOKEN_ID <= t < 500 for r in b for t in r.prompt_ids)
    assert demand_tokens(b) == sum(len(r.prompt_ids) + r.max_new_tokens for r in b)
    t = stress_trace(500, 40, (1, 5), (1, 5), burst_size=(2, 4), burst_gap=(1, 3), p_samples=0.3, p_beam=0.3,
                     max_n=3, seed=0)
    assert len(t) == 40 and [r.arrival_step for r in t] == sorted(r.arrival_step for r in t)
    assert {r.kind for r in t} == {"plain", "samples", "beam"}
    assert all((r.n == 1) == (r.kind == "plain") and r.n <= 3 for r in t)
    samples = next(r for r in t if r.kind == "samples")
    assert samples.sampling.temperature > 0 and samples.sampling.seed == samples.seed
    assert next(r for r in t if r.kind == "plain").sampling.temperature == 0


class StepEngine:
    """Finishes a request `max_new_tokens` steps after it is added; notes at which step each was added."""

    def __init__(self):
        self.live, self.added, self.n_steps = [], [], 0

    @property
    def has_work(self):
        return bool(self.live)

    def add_group(self, prompt_ids, max_new_tokens, sampling, ignore_eos, n):
        group = SimpleNamespace(left=max_new_tokens, outputs=[[self.n_steps]] * n, kind="group")
        self.live.append(group)
        self.added.append(("group", self.n_steps, n))
        return group

    def add_beam_search(self, prompt_ids, max_new_tokens, beam_width):
        group = SimpleNamespace(left=max_new_tokens, best=[self.n_steps], kind="beam")
        self.live.append(group)
        self.added.append(("beam", self.n_steps, beam_width))
        return group

    def step(self):
        for g in self.live:
            g.left -= 1
        done = [g for g in self.live if g.left == 0]
        self.live = [g for g in self.live if g.left > 0]
        self.n_steps += 1
        return [SimpleNamespace(finished=True) for _ in done]


def test_drive_adds_each_request_at_its_step_and_jumps_idle_gaps():
    from measure.workload import TracedRequest
    trace = [TracedRequest([5, 6], 2, arrival_step=0), TracedRequest([5], 1, arrival_step=10, kind="beam", n=3),
             TracedRequest([7], 1, arrival_step=1, kind="samples", n=2, seed=3)]
    engine, finished = StepEngine(), []
    groups = drive(engine, trace, on_step=lambda outs: finished.append(len(outs)))
    # in arrival order; the idle engine jumps from step 2 to the burst at step 10 (its own step count: 2)
    assert engine.added == [("group", 0, 1), ("group", 1, 2), ("beam", 2, 3)]
    assert [g.kind for g in groups] == ["group", "beam", "group"]            # in trace order
    assert sum(finished) == 3 and not engine.has_work
    assert outputs_of(groups) == [[[0]], [[2]], [[1], [1]]]                   # samples' outputs; a beam's best


# --- the tput sweep ---------------------------------------------------------------------------------
def test_tput_warms_each_cell_once_and_reports_settings(tiny32):
    from measure.tput import run_tput
    cfg = RunConfig(model="tiny", device="cpu", dtype="fp32", _lm=tiny32)
    cfg.options = dict(batch_sizes=[1, 2], new_tokens=4, engines=[], repeats=2)
    calls = []
    report = run_tput(cfg, [recording_runner(calls)], kv_note="how KV is counted")
    # Run 1: warm-up then timed run, per batch size; run 2: timed runs only.
    assert [(len(ids), new[0], bs) for ids, new, bs in calls] == [
        (1, WARMUP_NEW_TOKENS_CPU, 1), (1, 4, 1), (2, WARMUP_NEW_TOKENS_CPU, 2), (2, 4, 2), (1, 4, 1), (2, 4, 2)]
    assert calls[0][0] == calls[1][0] and calls[2][0] == calls[3][0]   # warmed on the prompts it then timed
    kv, speed, per_seq = report.tables
    assert speed.columns == ["batch_size", "rec_tok/s", "rec_ms/step"]
    assert per_seq.columns == ["batch_size", "rec_ms/tok/seq"]
    assert all(r["ms_per_step"] > 0 for r in report.data["rows"])
    assert kv.notes == ["how KV is counted"]
    assert "rec settings at batch 2: max_running=2, knob=x" in speed.notes
    assert any(n.startswith("every engine at every batch size: warmed up") for n in speed.notes)
    assert all(r["settings"]["max_running"] == r["batch_size"] for r in report.data["rows"])


def test_tput_compares_every_engines_outputs_with_the_first(tiny32, tmp_path):
    from measure.tput import plot_tput, run_tput

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


# --- workload_bench -----------------------------------------------------------------------------------
def test_workload_bench_runs_every_named_engine_and_keeps_hf_cbs_best_config(tiny32, monkeypatch):
    import measure.workload_bench as wb
    ran = []

    def fake_cb(config):
        def run(lm, requests, max_running):
            ran.append(config)
            return recording_runner([]).run(lm, requests, max_running)
        return EngineRunner(f"hf_cb[{config}]", "fake generate_batch", run)

    monkeypatch.setattr(wb, "hf_cb_runner", fake_cb)
    cfg = RunConfig(model="tiny", device="cpu", dtype="fp32", _lm=tiny32, quick=True)
    cfg.options = {o.name: o.default(on_gpu=False) for o in wb.workload_options(["a", "hf_cb"], [], ["a", "hf_cb"])}
    profiled = []

    def profile_engine(lm, requests):
        a = torch.randn(32, 32)
        profiled.append(len(requests))
        return SimpleNamespace(lm=lm, running=requests, step=lambda: a @ a)

    report = wb.run_workload_bench(cfg, [recording_runner([], "a")], focus="a",
                                   targets={("equal", "a", "hf_cb"): 1.0, ("mixed", "a", "nope"): 1.0},
                                   profile_engine=profile_engine)
    titles = [t.title for t in report.tables]
    assert titles[0].startswith("equal work") and titles[1].startswith("mixed work")
    assert titles[2].startswith("Ratios") and titles[3] == "Compute roofline" and titles[4].startswith("Where one")
    equal = report.tables[0]
    assert equal.columns[-1] == "a speedup" and [r[0] for r in equal.rows] == ["a", "hf_cb"]
    assert ran == wb.HF_CB_CONFIGS[:1] * 4       # quick: the first config only; warm-up + timed run per workload
    assert len(report.tables[2].rows) == 1                      # a target naming an engine that did not run: no row
    assert profiled == [wb.QUICK["n"]] and report.data["profile"]
    assert set(report.data["results"]) == {"equal", "mixed"} and "outputs" not in report.data["results"]["equal"]["a"]
    cfg.options["engines"] = ["a", "vllm"]
    with pytest.raises(ValueError, match="unknown engine"):
        wb.run_workload_bench(cfg, [recording_runner([], "a")], "a", {}, profile_engine)


def test_targets_without_both_engines_leave_a_note_not_an_empty_table():
    """The CPU's default engines leave out the GPU peers: no target can be measured, and the report says which
    engines the targets need instead of printing a table with no rows. Where some are measured, the table
    names the others."""
    from measure.report import Report
    from measure.workload_bench import targets_table
    targets = {("equal", "graphs", "hf_compiled"): 1.5, ("mixed", "graphs", "hf_compiled"): 3.0}
    report = Report("w", meta={})
    report.table("equal work", ["engine"])
    targets_table(report, {"equal": {"graphs": dict(tok_s=10.0)}, "mixed": {"graphs": dict(tok_s=10.0)}}, targets)
    assert [t.title for t in report.tables] == ["equal work"]
    assert any("no target measured" in n and "graphs and hf_compiled (mixed)" in n for n in report.tables[0].notes)
    targets_table(report, {"mixed": {"graphs": dict(tok_s=30.0), "hf_compiled": dict(tok_s=10.0)}}, targets)
    ratios = report.tables[-1]
    assert ratios.title.startswith("Ratios") and ratios.rows == [
        ["mixed", "graphs / hf_compiled tok/s", "3.00x", ">= 3.0x", True]]
    assert ratios.notes == ["not measured, one of the two engines did not run: graphs and hf_compiled (equal)"]


# --- the kernel-bench sweep -----------------------------------------------------------------------
def test_lengths_for_mixes_lengths_and_is_reproducible():
    from measure.kernel_bench import lengths_for
    lens = lengths_for(100, 8)
    assert lens[0] == 100 and all(50 <= n <= 100 for n in lens) and len(lens) == 8
    assert lengths_for(100, 8) == lens and lengths_for(100, 8, seed=1) != lens


def test_median_ms_warms_up_then_times_every_call():
    from measure.kernel_bench import median_ms
    calls = []
    ms = median_ms(lambda: calls.append(1), "cpu", warmup=2, iters=5)
    assert len(calls) == 7 and ms >= 0


class ClockedEngine:
    """A stand-in engine for decode_step_ms: each step() moves a fake clock on by the next of `costs` (ms)."""

    def __init__(self, clock: list, costs: list[float], overlaps: bool):
        self.clock, self.costs, self.overlaps_steps = clock, iter(costs), overlaps
        self.waiting, self.running, self.n_added = [], [], 0

    def add(self, ids, max_new_tokens, ignore_eos):
        self.n_added += 1

    def step(self):
        self.clock[0] += next(self.costs) / 1e3


@pytest.mark.parametrize("overlaps", [False, True])
def test_decode_step_ms_cuts_the_timed_steps_into_runs_and_reports_the_fastest(monkeypatch, overlaps):
    import measure.step_bench as sb
    clock = [0.0]
    monkeypatch.setattr(sb.time, "perf_counter", lambda: clock[0])
    lm = SimpleNamespace(vocab_size=1000, device="cpu")
    # 3 warm-up steps (not timed), then 10 timed ones in runs of 4, 3, 3: means 2.5, 1.0, 4.0 ms.
    costs = [50.0] * sb.WARMUP_STEPS + [1, 2, 3, 4] + [1, 1, 1] + [4, 4, 4]
    r = sb.decode_step_ms(lambda lm_, n: ClockedEngine(clock, costs, overlaps), lm, 2, 8, 10, runs=3)
    assert r["engine"].n_added == 2
    assert r["best_run_ms"] == pytest.approx(1.0)
    assert r["mean_ms"] == pytest.approx(sum(costs[sb.WARMUP_STEPS:]) / 10)    # every timed step, once
    one = sb.decode_step_ms(lambda lm_, n: ClockedEngine(clock, costs, overlaps), lm, 2, 8, 10)
    assert one["best_run_ms"] == pytest.approx(one["mean_ms"])                  # one run: its mean
    with pytest.raises(ValueError, match="runs must be between 1 and steps"):
        sb.decode_step_ms(lambda lm_, n: ClockedEngine(clock, costs, overlaps), lm, 2, 8, 10, runs=11)


def test_gpu_time_on_cpu_times_each_call_and_says_so():
    from measure.kernel_bench import PER_CALL, gpu_time
    calls = []
    t = gpu_time(lambda: calls.append(1), "cpu", warmup=2, iters=5)
    assert len(calls) == 7 and t.ms >= 0 and t.how == PER_CALL and not t.replayed
    assert isinstance(t.cell(), str) and PER_CALL in t.cell()   # never passed off as graph-replay time


def test_gpu_time_replays_a_captured_graph_or_falls_back_to_per_call(monkeypatch):
    # The decisions, without CUDA: the capture, the replay timer and the per-call timer are stand-ins.
    import measure.kernel_bench as kb
    monkeypatch.setattr(kb, "sync", lambda device=None: None)
    monkeypatch.setattr(kb, "median_ms", lambda fn, device, warmup, iters: 7.0)
    replays = []
    monkeypatch.setattr(kb, "replay_intervals_ms", lambda replay, warmup, iters: replays.append((warmup, iters))
                        or [2.0, 4.0, 3.0])
    captured = []
    t = kb.gpu_time(lambda: None, "cuda", warmup=25, iters=3, calls_per_graph=10,
                    capture=lambda fn, calls: captured.append(calls) or (lambda: None))
    assert captured == [10] and replays == [(3, 3)]            # ceil(25 / 10) warm-up replays, then 3 timed
    assert t.replayed and t.ms == 0.3 and t.cell() == 0.3      # the median replay over the calls in it

    def unsafe(fn, calls):                                     # what torch raises for a .item() under capture
        try:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore text")
        except RuntimeError:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

    t = kb.gpu_time(lambda: None, "cuda", capture=unsafe)
    assert t.ms == 7.0 and not t.replayed
    assert t.how.startswith(kb.PER_CALL) and "not capturable (CUDA error: operation not permitted" in t.how
    assert "7.000" in t.cell() and "not capturable" in t.cell()
    assert kb.gpu_time(lambda: None, "cpu").how == kb.PER_CALL  # a CPU never tries to capture


def test_kernel_sweep_walks_the_grid_and_checks_the_kernel_once_on_cpu(tiny32):
    from measure.kernel_bench import NOT_TIMED_CPU, QUICK, kernel_options, kernel_sweep, timing_cell
    cfg = RunConfig(model="tiny", device="cpu", dtype="fp32", _lm=tiny32, quick=True)
    cfg.options = {o.name: o.default(on_gpu=False) for o in kernel_options()}
    seen = []

    def measure_cell(case):
        seen.append((case.batch_size, case.context, case.check_kernel))
        assert len(case.lens) == case.batch_size and max(case.lens) == case.context
        kernel = case.time_kernel(lambda: None)
        assert case.time_kernel_gpu(lambda: None) is None and timing_cell(None) == NOT_TIMED_CPU
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
    from measure.roofline import measure_matmul_flops, profile_decode_step, roofline_tokens_per_s
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
    from measure import plots
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
        plots.lines(tmp_path / "f.png", [1, 2], {"s": [1, 2]}, "x", "y", logx=True, marker=""),
        plots.bars(tmp_path / "g.png", ["p", "q"], {"s": [1, 2], "t": [3, 4]}, "y", logy=True),
        plots.draw_panels(tmp_path / "h.png", [
            plots.line_panel([4, 8], {"a": [1, 2], "b": [2, 1]}, "x", "y", logx=True, ticks_at_x=True, logy=True,
                             styles={"b": dict(marker="^", ls="--")}, hlines={"ref": 1.5}),
            plots.bar_panel(["p", "q"], {"s": [1, 2]}, "y", title="t", bar_colors=["tab:blue", "tab:orange"],
                            bands={"range": (0.5, 1.5, "tab:blue")}),
        ], title="two panels", panel_size=(4, 3)),
    ]
    assert all(p.stat().st_size > 0 for p in paths)
