"""Phase 2.3 demos: `latency_demo` (static vs continuous batching, per sequence) and `wall`
(the KV memory a StaticCache would reserve vs what per-sequence DynamicCaches really hold).

    python -m common latency_demo [--max-running 4] [--max-new-tokens 128]
    python -m common latency_demo --lengths blog [--length-scale 0.25]
    python -m common wall         [--concurrency 1 2 4 8 16 32] [--max-new-tokens 128]
"""

from __future__ import annotations

from dataclasses import asdict
from statistics import mean

from common.clock import now
from common.prompts import (LATENCY_DEMO_BLOG_STEPS, LATENCY_DEMO_MAX_RUNNING, LATENCY_DEMO_MAX_TOKENS,
                            LATENCY_DEMO_MAX_TOKENS_GPU, SHORT_PROMPTS, STATIC_RESERVATION_TOKENS,
                            interleaved_latency_prompts)
from measure.bench import MB, kv_bytes_per_token
from measure.demos import Option, RunConfig, demo
from measure.harness import run_prompts
from measure.progress import progress_bar
from phases.p2_1_naive_batching.demo import short
from phases.p2_1_naive_batching.generate import generate_batch
from phases.p2_2_scheduler.scheduler import Scheduler
from phases.p2_2_scheduler.trace import CARRIED, PREFILL, Trace
from phases.p2_3_continuous_batching.scheduler import ContinuousScheduler

QUICK_MAX_RUNNING = 2
QUICK_MAX_TOKENS = 4
QUICK_CONCURRENCY = [1, 2, 4]
WALL_CONCURRENCY = [1, 2, 4, 8, 16, 32]
WARMUP_NEW_TOKENS = 2
LATENCY_DEMO_DTYPE = "fp32"
# `--lengths`: "eos" lets the model answer until its EOS (or the cap); "blog" gives each request the
# length the blog's model answered it with (`LATENCY_DEMO_BLOG_STEPS`), EOS ignored, so the workload
# is the blog's whatever the model, random weights included.
LENGTHS = ("eos", "blog")
# The blog's lengths scaled down on a CPU, where a step costs many times a GPU's: a quarter keeps the
# short answers a few steps long (not all rounded to one) and the long ones hundreds, so the ratios
# between the requests, which set the speedups, stay the blog's up to rounding.
BLOG_LENGTH_SCALE_CPU = 0.25
BLOG_LENGTH_SCALE_GPU = 1.0
QUICK_LENGTH_SCALE = 0.002   # one to three steps per request under --quick: the blog trace's code path, in seconds
# The blog's speedup for each prompt (its table beside `LATENCY_DEMO_BLOG_STEPS`), printed as the
# post prints it, so `--lengths blog` sets our figure beside the one it replays.
BLOG_SPEEDUP = {
    "What is the capital of France?": "35.9",
    "Explain in detail how the attention mechanism works in a transformer.": "0.4",
    "Is Python interpreted or compiled? Answer in one sentence.": "14.9",
    "Write a short story about a robot who learns to paint.": "0.9",
    "What is 2 + 2?": "28.6",
    "Describe the history of the Roman Empire in significant detail.": "0.9",
    "Name one fruit.": "26.7",
    "What are the key differences between supervised and unsupervised learning?": "1.2",
}


# --- latency demo ------------------------------------------------------------------------------
def blog_lengths(prompts: list[str], scale: float = 1.0) -> list[int]:
    """New tokens per prompt that replay the blog's step counts, times `scale` (rounded, at least 1 step).

    One more token than steps: the prefill makes the first token, and the blog's `steps`, like ours,
    counts the decode steps after it. Run them with ignore_eos=True.
    """
    if not scale > 0:
        raise ValueError(f"length scale must be > 0, got {scale}")
    unknown = [p for p in prompts if p not in LATENCY_DEMO_BLOG_STEPS]
    if unknown:
        raise ValueError(f"the blog has no length for {unknown}")
    return [max(1, round(LATENCY_DEMO_BLOG_STEPS[p] * scale)) + 1 for p in prompts]


def slot_spans(trace: Trace, t0: float) -> list[dict]:
    """Contiguous stretches of one sequence in one slot doing one kind of work, for the timelines.

    Times are seconds from `t0`. Prefill and decode merge into one "live"
    stretch; carried stretches (static batching's waste) stay separate.
    Returns [{"seq": id, "slot": s, "start": s, "end": s, "carried": bool, "steps": n}].
    """
    out: list[dict] = []
    open_: dict[int, dict] = {}   # slot -> the span being extended
    for r in trace.records:
        for slot, (sid, work) in enumerate(zip(r.slots, r.work)):
            if sid is None:
                open_.pop(slot, None)
                continue
            carried = work == CARRIED
            cur = open_.get(slot)
            if cur is not None and cur["seq"] == sid and cur["carried"] == carried:
                cur["end"], cur["steps"] = r.t_end - t0, cur["steps"] + 1
            else:
                cur = {"seq": sid, "slot": slot, "start": r.t_start - t0, "end": r.t_end - t0,
                       "carried": carried, "steps": 1}
                open_[slot] = cur
                out.append(cur)
    return out


def step_times(sched) -> dict[int, tuple[float, int]]:
    """Mean ms of a decode-only step by the number of sequences in it: {n: (ms, steps)}.

    Steps with a prefill in them are left out (a prompt costs more than a token). Static batching's
    carried rows count: its padded batch still computes them.
    """
    by_n: dict[int, list[float]] = {}
    for r in sched.trace.records:
        if PREFILL not in r.work:
            by_n.setdefault(sum(s is not None for s in r.slots), []).append((r.t_end - r.t_start) * 1e3)
    return {n: (mean(ms), len(ms)) for n, ms in sorted(by_n.items())}


def compare_schedulers(lm, prompts: list[str], max_running: int, cap: int | list[int],
                       ignore_eos: bool = False) -> dict:
    """Run the same requests through the static and the continuous scheduler.

    `cap` is one max_new_tokens for all, or one per prompt (the blog's lengths, with ignore_eos).
    Returns plain data (JSON-ready): per-sequence latencies from the common
    arrival, decode steps, each scheduler's slot timeline and its step time by sequences per step.
    """
    results = {}
    for name, cls in (("static", Scheduler), ("continuous", ContinuousScheduler)):
        sched = cls(lm, max_running=max_running)
        t0, done = run_prompts(sched, prompts, cap, name, ignore_eos=ignore_eos)
        results[name] = (sched, t0, done)
    # static: a batch hands its results back together, when its slowest row is done;
    # continuous: a sequence's result is back the moment it finishes.
    lat = {n: [(s.returned_at[i] - t0) * 1e3 for i in range(len(prompts))] for n, (s, t0, _) in results.items()}
    c_done = results["continuous"][2]
    return dict(
        prompts=list(prompts), is_short=[p in SHORT_PROMPTS for p in prompts], max_running=max_running,
        max_new_tokens=cap, ignore_eos=ignore_eos, static_ms=lat["static"], cont_ms=lat["continuous"],
        steps=[len(q.output_ids) - 1 for q in c_done],       # decode steps after the prefill's token
        speedup=[a / b for a, b in zip(lat["static"], lat["continuous"])],
        same_output=[a.output_ids == b.output_ids for a, b in zip(results["static"][2], c_done)],
        static_wall_s=max(lat["static"]) / 1e3, continuous_wall_s=max(lat["continuous"]) / 1e3,
        steps_per_scheduler={n: s.n_steps for n, (s, _, _) in results.items()},
        step_ms={n: {str(k): v for k, v in step_times(s).items()} for n, (s, _, _) in results.items()},
        timelines={n: slot_spans(s.trace, t0) for n, (s, t0, _) in results.items()},
        slot_trace={n: [dict(r, t_start=r["t_start"] - t0, t_end=r["t_end"] - t0) for r in map(asdict, s.trace.records)]
                    for n, (s, t0, _) in results.items()})


def draw_timelines(d: dict, png_path, title: str = "which sequence holds which slot when") -> None:
    """Gantt chart per scheduler from `compare_schedulers` data: slot on y, seconds on x."""
    from measure.plots import gantt
    panels = {f"{name}: all results back after {d[f'{name}_wall_s']:.1f} s":
              [dict(row=s["slot"], start=s["start"], end=s["end"], color=s["seq"], hatched=s["carried"],
                    label=f"{s['seq']}{'S' if d['is_short'][s['seq']] else 'L'}") for s in spans]
              for name, spans in d["timelines"].items()}
    gantt(png_path, panels, n_rows=d["max_running"], row_name="slot", title=title,
          xlabel="seconds since all requests arrived   (S short / L long prompt; hatched: finished "
                 "but still carried in its static batch)")


def plot_latency(report, png_path) -> None:
    draw_timelines(report.data, png_path, title=f"which sequence holds which slot when "
                                                f"({report.meta.get('model')}, {report.meta.get('device_name')})")


@demo("latency_demo", phase="p2_3",
      help="per sequence: finish time under static vs continuous batching (short + long prompts; fp32 unless --dtype)",
      options=[Option("max_running", int, cpu=LATENCY_DEMO_MAX_RUNNING, help="sequences running at once"),
               Option("max_new_tokens", int, cpu=LATENCY_DEMO_MAX_TOKENS, gpu=LATENCY_DEMO_MAX_TOKENS_GPU,
                      help="cap on new tokens per prompt (GPU: the blog's 2048; unused with --lengths blog)"),
               Option("lengths", str, cpu="eos", choices=LENGTHS,
                      help="eos: answers stop at EOS or the cap; blog: each request runs the blog's length, EOS ignored"),
               Option("length_scale", float, cpu=BLOG_LENGTH_SCALE_CPU, gpu=BLOG_LENGTH_SCALE_GPU,
                      help="with --lengths blog: multiply the blog's lengths by this (at least 1 step each)")],
      plot=plot_latency)
def latency_demo(cfg: RunConfig):
    chose_dtype = cfg.dtype is None
    if chose_dtype:
        # fp32 unless asked otherwise: a padded batch and a lone sequence then pick the
        # same greedy tokens (the tests check it), so the two schedulers do the same
        # work and only the scheduling differs. In bf16 padding changes the rounding,
        # and a short answer can turn into a long one under one scheduler only.
        cfg.dtype = LATENCY_DEMO_DTYPE
    cfg.use_quick(max_running=QUICK_MAX_RUNNING, max_new_tokens=QUICK_MAX_TOKENS, length_scale=QUICK_LENGTH_SCALE)
    running, blog = cfg.max_running, cfg.lengths == "blog"
    prompts = interleaved_latency_prompts()
    cap = blog_lengths(prompts, cfg.length_scale) if blog else cfg.max_new_tokens
    lm = cfg.load()
    report = cfg.new_report("latency_demo")
    if chose_dtype:
        report.meta["dtype_reason"] = "this demo's default, so both schedulers pick the same greedy tokens"
    generate_batch(lm, prompts[:1], WARMUP_NEW_TOKENS)
    d = compare_schedulers(lm, prompts, running, cap, ignore_eos=blog)
    title = (f"{len(prompts)} requests arriving together, at most {running} running, "
             + (f"the blog's lengths x {cfg.length_scale:g} (EOS ignored)" if blog else f"cap {cap} new tokens"))
    table = report.table(title, ["seq", "prompt", "static ms", "cont ms", "steps", "speedup"]
                         + (["blog steps", "blog speedup"] if blog else []))
    for i, p in enumerate(prompts):
        row = [i, short(p), d["static_ms"][i], d["cont_ms"][i], d["steps"][i], d["speedup"][i]]
        table.add_row(*row, *([LATENCY_DEMO_BLOG_STEPS[p], BLOG_SPEEDUP[p]] if blog else []))
    short_ratio = mean(x for x, s in zip(d["speedup"], d["is_short"]) if s)
    long_ratio = mean(x for x, s in zip(d["speedup"], d["is_short"]) if not s)
    table.notes += [
        "static ms: a static batch hands its results back together, when its slowest row is done;",
        "cont ms: the moment the sequence itself finished. Both from the common arrival (t = 0).",
        f"mean speedup: short prompts {short_ratio:.1f}x, long prompts {long_ratio:.1f}x;",
        f"all results back: static {d['static_wall_s']:.1f} s, continuous {d['continuous_wall_s']:.1f} s "
        f"(continuous runs one forward pass per sequence per step: no batched forward pass).",
        f"{sum(d['same_output'])}/{len(prompts)} outputs identical under both schedulers "
        f"({str(lm.dtype).removeprefix('torch.')}; in bf16 padding changes the rounding, so fp32 is the default).",
    ]
    if blog:
        table.notes += [
            f"new tokens per request: {cap} (the blog's steps x {cfg.length_scale:g}, rounded, at least 1, "
            f"+ the prefill's token); blog steps / blog speedup: the blog's table, for comparison.",
        ]
    steps = report.table("ms per decode step, by sequences in the step (steps with a prefill left out)",
                         ["sequences", "static ms/step", "static steps", "cont ms/step", "cont steps"])
    for n in sorted({int(k) for per in d["step_ms"].values() for k in per}):
        s_ms, s_n = d["step_ms"]["static"].get(str(n), (None, 0))
        c_ms, c_n = d["step_ms"]["continuous"].get(str(n), (None, 0))
        steps.add_row(n, s_ms if s_n else "-", s_n, c_ms if c_n else "-", c_n)
    steps.notes += [
        "static: one batched forward pass over the whole padded batch (finished rows still computed);",
        "continuous: one forward pass per running sequence, so its step grows with every sequence added.",
    ]
    report.data.update(d, lengths=cfg.lengths,
                       length_scale=cfg.length_scale if blog else None)
    return report


# --- the wall: KV memory -----------------------------------------------------------------------------
def plot_wall(report, png_path) -> None:
    from measure.plots import bars
    d = report.data
    bars(png_path, [str(c) for c in d["concurrency"]],
         {f"StaticCache reservation ({d['reservation']} tok/seq)": d["static_mb"],
          "DynamicCache, measured": d["dynamic_mb"]},
         ylabel="KV memory (MB)", logy=True,
         title=f"KV memory vs concurrency ({report.meta.get('model')}, {report.meta.get('dtype')})")


@demo("wall", phase="p2_3", help="KV memory: StaticCache worst-case reservation vs DynamicCache's real size",
      options=[Option("concurrency", int, cpu=WALL_CONCURRENCY, many=True, help="sequences held at once"),
               Option("max_new_tokens", int, cpu=LATENCY_DEMO_MAX_TOKENS, gpu=STATIC_RESERVATION_TOKENS,
                      help="cap on new tokens (clamped so prompt + output fit the reservation)"),
               Option("reservation", int, cpu=STATIC_RESERVATION_TOKENS, help="tokens a StaticCache reserves per sequence")],
      plot=plot_wall)
def wall(cfg: RunConfig):
    cfg.use_quick(concurrency=QUICK_CONCURRENCY, max_new_tokens=QUICK_MAX_TOKENS)
    conc, cap, reserve = cfg.concurrency, cfg.max_new_tokens, cfg.reservation
    lm = cfg.load()
    prompts = interleaved_latency_prompts()
    report = cfg.new_report("wall")
    # One continuous run gives each prompt's real length and its cache's real size at the end.
    sched = ContinuousScheduler(lm, max_running=LATENCY_DEMO_MAX_RUNNING)
    t0 = now(lm.device)
    for p in prompts:
        ids = lm.prompt_ids(p)
        sched.add(ids, max(1, min(cap, reserve - len(ids))), arrival=t0)
    with progress_bar("wall", total=len(prompts)) as bar:
        done = sched.run(progress=bar.callback)
    per_tok = kv_bytes_per_token(lm)
    table = report.table(f"KV memory with the latency workload cycled to each concurrency "
                         f"(cap {cap} new tokens, StaticCache reserves {reserve} tokens/seq)",
                         ["concurrency", "static KV (MB)", "dynamic KV (MB)", "avg tokens", "wasted %"])
    cols = {k: [] for k in ("concurrency", "static_mb", "dynamic_mb", "avg_tokens", "wasted_pct")}
    for c in conc:
        picked = [done[i % len(done)] for i in range(c)]
        static_b = c * reserve * per_tok
        dynamic_b = sum(sched.kv_bytes_at_finish[q.seq_id] for q in picked)
        row = (c, static_b / MB, dynamic_b / MB, mean(q.n_tokens for q in picked), 100 * (1 - dynamic_b / static_b))
        table.add_row(*row)
        for k, v in zip(cols, row):
            cols[k].append(v)
    table.notes += [
        f"KV bytes per token: {per_tok:,} (2 x {lm.n_layers} layers x {lm.n_kv_heads} KV heads x {lm.head_dim} "
        f"x {per_tok // (2 * lm.n_layers * lm.n_kv_heads * lm.head_dim)} bytes).",
        "dynamic KV: the K/V tensors each sequence's DynamicCache really held when it finished "
        "(prompt + output - 1 tokens); static KV: the same sequences with a worst-case reservation each.",
        f"wasted %: the share of the reservation never written. Generated lengths: "
        f"{[len(q.output_ids) for q in done]} tokens.",
    ]
    report.data.update(cols, reservation=reserve, kv_bytes_per_token=per_tok, prompts=prompts,
                       n_tokens=[q.n_tokens for q in done], n_generated=[len(q.output_ids) for q in done],
                       kv_bytes_at_finish=[sched.kv_bytes_at_finish[q.seq_id] for q in done])
    return report
