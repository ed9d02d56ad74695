"""The `prefill_bench` harness: a packed prefill timed per layer and per model pass, streams' ITL, workloads.

A phase's demo hands in what it measures (measure/ imports no phase):

    run_prefill_bench(cfg, attention=build, prefill_engines=[old, new], latency_engines=fn, runners=[old, new])

  attention        build(lm, seg_lens, prefix, block_size) -> AttentionPack: one layer's attention over
                   a packed prefill two ways, against no paging (measure/prefill_attention.py)
  prefill_engines  two `Contender`s, before and after: make(lm, budget=, max_running=, block_size=,
                   n_blocks=) -> an engine that prefills `budget` prompt tokens in one pass and can hold
                   one computed prefix (`engine.kv.hold(seq)`, `engine.kv.drop()`) that later prompts map in
  latency_engines  latency_engines(cfg) -> {row name: make(lm, max_running=, block_size=, n_blocks=)}:
                   a long prompt arriving next to decoding streams (measure/stream_latency.py)
  runners          two `EngineRunner`s (measure/harness.py), before and after, on workload_bench's work

Each section (`--sections`, in SECTIONS order) is one table; packs are `NxL` or `NxA-B` (`pack_lengths`).
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass
from typing import Callable

import torch

from common.clock import now
from measure.bench import ceil_div
from measure.demos import Option, RunConfig
from measure.harness import EngineRunner, measure, pool_problems
from measure.prefill_attention import PACK_SEED, AttentionPack, attention_table, pack_lengths
from measure.progress import progress_bar
from measure.report import Report
from measure.stream_latency import latency_table, random_ids
from measure.workload import EQUAL_WORK_N, equal_work, mixed_work

SECTIONS = ["attention", "engine", "latency", "workload"]
QUICK = dict(packs=["1x24", "3x4-12"], engine_packs=["1x24", "3x4-12"], prefix=[0, 8], block_size=4, warmup=1,
             iters=1, engine_repeats=1, n_streams=2, stream_prompt=4, long_prompt=24, budget=8, steps_before=2,
             n_requests=3, sections=SECTIONS)

# On this project's CPUs a bf16 matmul has no hardware path: a 256-token prefill of SmolLM2 took 5.7 s in
# bf16 and 0.86 s in fp32 (one thread). Decode (memory-bound) gains from bf16, prefill (compute-bound)
# loses, so on a CPU this bench runs fp32 unless --dtype says otherwise.
CPU_DEFAULT_DTYPE = "fp32"


def prefill_options(block_size: int) -> list[Option]:
    """The demo's options; `block_size` is the engines' default block size."""
    return [
        Option("sections", str, cpu=["attention", "engine", "latency"], gpu=SECTIONS, many=True,
               help="from: " + " ".join(SECTIONS), choices=tuple(SECTIONS)),
        Option("packs", str, cpu=["1x1024", "8x128", "32x16-128"], gpu=["1x4096", "16x256", "256x16-128"],
               many=True, help="packed prefills: NxL or NxA-B segments"),
        Option("engine_packs", str, cpu=["1x512", "16x8-64"], gpu=["1x4096", "16x256", "256x16-128"],
               many=True, help="packs for the whole-model prefill (a CPU prefills ~1k tokens/s: fewer)"),
        Option("prefix", int, cpu=[0, 256], gpu=[0, 1024], many=True,
               help="tokens cached before each segment (0: fresh prompts)"),
        Option("block_size", int, cpu=block_size, help="tokens per KV block"),
        Option("warmup", int, cpu=2, gpu=5, help="untimed attention calls before timing"),
        Option("iters", int, cpu=5, gpu=20, help="timed attention calls (median reported)"),
        Option("engine_repeats", int, cpu=1, gpu=3, help="timed prefill passes per engine (median reported)"),
        Option("n_streams", int, cpu=4, gpu=32, help="latency: sequences decoding when the long prompt arrives"),
        Option("stream_prompt", int, cpu=32, gpu=128, help="latency: the streams' prompt tokens"),
        Option("long_prompt", int, cpu=512, gpu=8192, help="latency: the arriving prompt's tokens"),
        Option("budget", int, cpu=64, gpu=512, help="latency: max_num_batched_tokens of the chunked engine"),
        Option("steps_before", int, cpu=3, gpu=8, help="latency: steps the streams decode before it arrives"),
        Option("n_requests", int, cpu=EQUAL_WORK_N, gpu=256, help="workload: requests per workload"),
    ]


# --- section 2: the whole model's prefill pass ------------------------------------------------------
@dataclass
class Contender:
    name: str     # column prefix
    label: str    # what it is, for the notes
    make: Callable[..., object]   # make(lm, budget=, max_running=, block_size=, n_blocks=) -> engine


def prefill_once(lm, make: Callable, prompts: list[list[int]], prefix_ids: list[int],
                 block_size: int) -> tuple[float, int]:
    """One packed prefill of `prompts` through a fresh engine, every prompt admitted in one step and
    prefilled in one pass: (seconds of that step, prompt tokens it computed)."""
    n_blocks = sum(ceil_div(len(p) + 1, block_size) for p in prompts) + ceil_div(len(prefix_ids) + 1, block_size)
    engine = make(lm, budget=sum(map(len, prompts)), max_running=len(prompts) + 1, block_size=block_size,
                  n_blocks=n_blocks)
    if prefix_ids:
        donor = engine.add(prefix_ids, 2, ignore_eos=True)
        engine.step()                                  # the prefix's prefill, then it is held and the donor goes
        engine.kv.hold(donor)
        engine.abort(donor)
    for p in prompts:
        engine.add(p, 1, ignore_eos=True)
    before = engine.n_prefill_tokens
    start = now(lm.device)
    engine.step()                                      # admit all, ONE prefill pass, each emits its only token
    seconds = now(lm.device) - start
    assert not engine.running and not engine.waiting, "the pack did not go through in one step"
    engine.kv.drop()
    assert not pool_problems(engine.allocator), "blocks leaked"
    return seconds, engine.n_prefill_tokens - before


def engine_section(cfg: RunConfig, report: Report, lm, engines: list[Contender]) -> None:
    a, b = (e.name for e in engines)
    t = report.table("The model's whole prefill pass of each pack (one step, every prompt admitted at once)",
                     ["pack", "prefix", "tokens computed", f"{a} s", f"{b} s", f"{a} tok/s", f"{b} tok/s",
                      f"{b} / {a}"])
    gen = torch.Generator().manual_seed(PACK_SEED)
    rows = []
    cases = [(spec, prefix) for spec in cfg.engine_packs for prefix in cfg.prefix]
    with progress_bar("prefill_bench: engine", total=len(cases) * len(engines)) as bar:
        for spec, prefix in cases:
            held = prefix // cfg.block_size * cfg.block_size     # whole blocks: what a prefix cache can map in
            # The donor computes the prefix; its one extra token is computed too (a prefill keeps >= 1 token).
            prefix_ids = random_ids(held + 1, gen) if held else []
            prompts = [prefix_ids[:held] + random_ids(n, gen) for n in pack_lengths(spec)]
            row = dict(pack=spec, prefix=held)
            for e in engines:
                prefill_once(lm, e.make, prompts, prefix_ids, cfg.block_size)      # warm-up: same shapes
                runs = [prefill_once(lm, e.make, prompts, prefix_ids, cfg.block_size)
                        for _ in range(cfg.engine_repeats)]
                row[e.name] = statistics.median(s for s, _ in runs)
                row["tokens"] = runs[0][1]
                bar.advance()
            rows.append(row)
            t.add_row(spec, held, row["tokens"], row[a], row[b], row["tokens"] / row[a], row["tokens"] / row[b],
                      f"{row[a] / row[b]:.2f}x")
    report.data["engine"] = rows
    t.notes += [
        "Median seconds of the step that prefills the pack (admission, one forward pass, sampling one token "
        f"each), of {cfg.engine_repeats} after one warm-up run on the same prompts. prefix: the prompts start with "
        "the same prefix, its full blocks held by the engine and mapped into every prompt's table (what a "
        "prefix-cache hit does), so only the rest is computed.",
        " ".join(f"{e.name}: {e.label}." for e in engines),
    ]


# --- section 4: workload_bench's work, before and after ------------------------------------------------
def workload_section(cfg: RunConfig, report: Report, lm, runners: list[EngineRunner]) -> None:
    old, new = runners
    n = cfg.n_requests
    work = {"equal": equal_work(lm.vocab_size, n, (16, 128), 64),
            "mixed": mixed_work(lm.vocab_size, n, (16, 128), (16, 256))}
    if cfg.quick:
        work = {"equal": equal_work(lm.vocab_size, n, (4, 12), 4),
                "mixed": mixed_work(lm.vocab_size, n, (4, 12), (2, 6))}
    prompts = [len(r.prompt_ids) for r in work["equal"]]
    outs = [r.max_new_tokens for r in work["mixed"]]
    t = report.table(f"workload_bench's work: {n} requests, prompts {min(prompts)}-{max(prompts)} tokens (equal: "
                     f"{work['equal'][0].max_new_tokens} new tokens each; mixed: {min(outs)}-{max(outs)}), EOS ignored",
                     ["work", "engine", "total tok/s", "mean TTFT ms", "mean ms/tok", "wall s",
                      f"{new.name} / {old.name}"])
    rows = {}
    with progress_bar("prefill_bench: workload", total=2 * len(work)) as bar:
        for wname, requests in work.items():
            rows[wname] = {}
            for runner in runners:
                rows[wname][runner.name] = measure(lm, runner, requests, len(requests))
                bar.advance()
            b, c = rows[wname][old.name], rows[wname][new.name]
            for r in (b, c):
                t.add_row(wname, r["engine"], r["tok_s"], r["ttft_ms"], r["ms_per_tok"], r["wall_s"],
                          f"{c['tok_s'] / b['tok_s']:.2f}x" if r is c else "")
            same = sum(x == y for x, y in zip(b["outputs"], c["outputs"]))
            t.notes.append(f"{wname}: {same}/{len(requests)} outputs identical; {old.name}: {b['note']}; "
                           f"{new.name}: {c['note']}")
    report.data["workload"] = {w: {e: {k: v for k, v in r.items() if k != "outputs"} for e, r in by_engine.items()}
                               for w, by_engine in rows.items()}
    t.notes.append(f"every engine: {b['warmup']}")


# --- the bench --------------------------------------------------------------------------------------
def run_prefill_bench(cfg: RunConfig, attention: Callable[..., AttentionPack], prefill_engines: list[Contender],
                      latency_engines: Callable[[RunConfig], dict[str, Callable]],
                      runners: list[EngineRunner]) -> Report:
    """The sections `cfg.sections` names, in SECTIONS order, each one table (see the module docstring)."""
    cfg.use_quick(**QUICK)
    unknown = set(cfg.sections) - set(SECTIONS)
    if unknown:
        raise ValueError(f"unknown section(s) {sorted(unknown)}; choose from {SECTIONS}")
    for spec in cfg.packs + cfg.engine_packs:
        pack_lengths(spec)                              # a bad pack fails now, not after minutes of timing
    if cfg.dtype is None and not cfg.on_gpu:
        cfg.dtype = CPU_DEFAULT_DTYPE
    lm = cfg.load()
    report = cfg.new_report("prefill_bench")
    if not cfg.on_gpu:   # other work on a shared CPU skews timings: record how busy it was
        report.meta["load_avg_1m"] = round(os.getloadavg()[0], 2)
    if "attention" in cfg.sections:
        report.data["attention"] = attention_table(report, lm, attention, cfg.packs, cfg.prefix, cfg.block_size,
                                                   cfg.warmup, cfg.iters)
    if "engine" in cfg.sections:
        engine_section(cfg, report, lm, prefill_engines)
    if "latency" in cfg.sections:
        report.data["latency"] = latency_table(report, lm, latency_engines(cfg), cfg.n_streams, cfg.stream_prompt,
                                               cfg.long_prompt, cfg.budget, cfg.steps_before, cfg.block_size)
    if "workload" in cfg.sections:
        workload_section(cfg, report, lm, runners)
    if not cfg.on_gpu:
        report.tables[0].notes.append("CPU: the Triton kernel only runs in Triton's interpreter here, so the "
                                      "varlen path is the CPU one; GPU figures: modal run modal_run.py::prefill_bench. "
                                      f"Default dtype on a CPU: {CPU_DEFAULT_DTYPE} (prefill in bf16 has no fast "
                                      "CPU path here)")
    return report


def plot_prefill(report: Report, png_path) -> None:
    """Prefill tok/s per pack (attention and whole pass), and the streams' ITL per engine."""
    from measure import plots
    panels = []
    if "attention" in report.data:
        rows = report.data["attention"]
        labels = [f"{r['pack']}\nprefix {r['prefix']}" for r in rows]
        panels.append(plots.bar_panel(labels, {k: [r["tok_s"][k] for r in rows] for k in ("loop", "varlen", "bound")},
                                      ylabel="tok/s (one layer)", title="attention", logy=True, slanted=True))
    if "engine" in report.data:
        rows = report.data["engine"]
        labels = [f"{r['pack']}\nprefix {r['prefix']}" for r in rows]
        engines = [k for k in rows[0] if k not in ("pack", "prefix", "tokens")]
        panels.append(plots.bar_panel(labels, {e: [r["tokens"] / r[e] for r in rows] for e in engines},
                                      ylabel="prompt tok/s", title="whole prefill pass", logy=True, slanted=True))
    if "latency" in report.data:
        rows = report.data["latency"]
        panels.append(plots.bar_panel([n.replace(" (", "\n(") for n in rows],
                                      {q: [r[q] for r in rows.values()] for q in ("p50", "p99")},
                                      ylabel="ms", title="streams' inter-token latency", slanted=True))
    if panels:
        m = report.meta
        plots.draw_panels(png_path, panels, title=f"prefill_bench ({m.get('model')}, {m.get('device_name')})")
