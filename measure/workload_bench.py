"""The `workload_bench` harness: engines on vLLM-style equal and mixed work, ratios against targets, the roofline.

The trace is the kind vLLM's benchmarks use (measure/workload.py): N requests
with random-token prompts of 16-128 tokens and fixed per-request output
lengths, EOS ignored, so every engine does exactly the same work.
  equal: every request wants the same number of tokens (64);
  mixed: the same prompts, output lengths spread over 16-256 - a static
         batch must carry every row to the longest, continuous engines don't;
  nano_vllm (only when named): nano-vllm's bench.py, 256 requests with prompts
         and outputs of 100-1024 tokens, the work small engines publish tok/s on.
Then: how close the `focus` engine gets to this machine's compute roofline,
and a profile of one full-batch decode step of it (where the time goes).

A phase's demo hands its engines over as `EngineRunner`s (measure/harness.py)
and says which one the speedups, the roofline and the profile are about:

    run_workload_bench(cfg, engines, focus="batched", targets={...}, profile_engine=...)

Fair peers: every engine is warmed up on the workload's own shapes right
before its timed run (`measure`: on CUDA the same requests, since compiled
code is built per shape), and each row's settings (cache, compile, page/block
size, pool, max_running) are in the table notes and in `report.data`, so a
reader can rerun any row. `hf_cb` runs at every `--hf-cb-configs` setting and
keeps its best.
"""

from __future__ import annotations

import gc
from typing import Callable

from measure.demos import Option, RunConfig
from measure.harness import EngineRunner, format_settings, measure, warmup_rule
from measure.hf_peers import hf_cb_runner
from measure.progress import progress_bar
from measure.report import Report
from measure.roofline import MATMUL_N, measure_matmul_flops, profile_decode_step, roofline_tokens_per_s
from measure.workload import EQUAL_WORK_N, Request, equal_work, mixed_work, nano_vllm_work

# (page_size, max_batch_tokens) tried for generate_batch; the table keeps its best.
HF_CB_CONFIGS = ["16:256", "16:1024", "32:512"]
HF_CB_NAME = "hf_cb"   # the engine name that runs every --hf-cb-configs setting
QUICK = dict(n=4, prompt_len=(4, 12), output_len=4, mixed_output=(2, 6))
WORKLOADS = ("equal", "mixed", "nano_vllm")
QUICK_MATMUL_N = 512   # the roofline's matmul under `quick` (measure/roofline.py's MATMUL_N otherwise)

# (workload, faster engine, slower engine) -> the ratio a phase aims for
Targets = dict[tuple[str, str, str], float]


def workload_options(engines_cpu: list[str], engines_gpu: list[str], engine_names: list[str]) -> list[Option]:
    """The demo's options; `engines_cpu` / `engines_gpu` run by default, any of `engine_names` when named."""
    return [
        Option("n_requests", int, cpu=EQUAL_WORK_N, gpu=256, help="requests per workload"),
        Option("prompt_min", int, cpu=16, help="shortest prompt (tokens)"),
        Option("prompt_max", int, cpu=128, help="longest prompt (tokens)"),
        Option("output_len", int, cpu=64, help="new tokens per request, equal workload"),
        Option("mixed_min", int, cpu=16, help="shortest output, mixed workload"),
        Option("mixed_max", int, cpu=256, help="longest output, mixed workload"),
        Option("workloads", str, cpu=["equal", "mixed"], many=True, help="from: " + " ".join(WORKLOADS),
               choices=WORKLOADS),
        Option("engines", str, cpu=engines_cpu, gpu=engines_gpu, many=True,
               help="from: " + " ".join(engine_names), choices=tuple(engine_names)),
        Option("hf_cb_configs", str, cpu=HF_CB_CONFIGS, many=True, help="page_size:max_batch_tokens for hf_cb"),
    ]


def workloads(cfg: RunConfig, vocab: int) -> dict[str, list[Request]]:
    """The equal and mixed traces the options ask for (the quick ones under `quick`)."""
    n, plen, out, mixed = cfg.n_requests, (cfg.prompt_min, cfg.prompt_max), cfg.output_len, (cfg.mixed_min, cfg.mixed_max)
    if cfg.quick:
        n, plen, out, mixed = QUICK["n"], QUICK["prompt_len"], QUICK["output_len"], QUICK["mixed_output"]
    # nano-vllm's workload is fixed by its bench.py; under `quick` it takes the quick sizes too.
    make = {"equal": lambda: equal_work(vocab, n, plen, out), "mixed": lambda: mixed_work(vocab, n, plen, mixed),
            "nano_vllm": lambda: nano_vllm_work(vocab, n, plen, mixed) if cfg.quick else nano_vllm_work(vocab)}
    return {k: make[k]() for k in cfg.workloads}


def run_workload_bench(cfg: RunConfig, engines: list[EngineRunner], focus: str, targets: Targets,
                       profile_engine: Callable[[object, list[Request]], object],
                       name: str = "workload_bench") -> Report:
    """Every engine `cfg.engines` names, on every workload; then the targets, the roofline and a step profile.

    engines         every runner the demo offers, by name (`hf_cb` is added here: the harness's own peer)
    focus           the engine the speedup column, the roofline and the profile are about
    profile_engine  profile_engine(lm, requests) -> that engine with every request admitted and
                    prefilled, so its next `step()` is one full-batch decode step
    name            the report's name (the demo running it)
    """
    lm = cfg.load()
    report = cfg.new_report(name)
    traces = workloads(cfg, lm.vocab_size)
    hf_cb_configs = cfg.hf_cb_configs[:1] if cfg.quick else cfg.hf_cb_configs
    by_name = {e.name: [e] for e in engines} | {HF_CB_NAME: [hf_cb_runner(c) for c in hf_cb_configs]}
    unknown = set(cfg.engines) - set(by_name)
    if unknown:
        raise ValueError(f"unknown engine(s) {sorted(unknown)}; choose from {sorted(by_name)}")
    max_running = max(len(r) for r in traces.values())

    results: dict[str, dict[str, dict]] = {}
    n_runs = len(traces) * sum(len(by_name[name]) for name in cfg.engines)
    with progress_bar("workload_bench", total=n_runs) as bar:
        for wname, requests in traces.items():
            results[wname] = {}
            for name in cfg.engines:
                rows = []
                for runner in by_name[name]:
                    bar.describe(f"{wname}: {runner.name}")
                    rows.append(measure(lm, runner, requests, max_running))   # warms up on these requests first
                    bar.advance()
                best = max(rows, key=lambda r: r["tok_s"])
                if len(rows) > 1:
                    best["note"] = (f"best of {len(rows)} configs: " +
                                    ", ".join(f"{r['engine']} {r['tok_s']:.1f} tok/s" for r in rows))
                best["engine"] = name
                results[wname][name] = best
    # The speedup column and the roofline are about `focus`; a run without it is about the first engine it ran.
    focus = focus if focus in cfg.engines else cfg.engines[0]
    workload_tables(report, traces, results, focus, warmup_rule(lm.device))
    targets_table(report, results, targets)
    roofline_table(report, lm, results, focus, cfg.quick)
    requests = next(iter(traces.values()))
    gc.collect()   # the last timed engine's pool, if a reference cycle holds it, before the profile builds one
    profile_table(report, profile_engine(lm, requests))
    report.data["results"] = {w: {e: {k: v for k, v in row.items() if k != "outputs"} for e, row in rows.items()}
                              for w, rows in results.items()}
    return report


def workload_tables(report: Report, traces: dict, results: dict, focus: str, warmup: str) -> None:
    """One table per workload: every engine's numbers, and how much faster `focus` is."""
    for wname, rows in results.items():
        reqs = traces[wname]
        outs = [r.max_new_tokens for r in reqs]
        t = report.table(f"{wname} work: {len(reqs)} requests, prompts {min(len(r.prompt_ids) for r in reqs)}-"
                         f"{max(len(r.prompt_ids) for r in reqs)} tokens, outputs {min(outs)}-{max(outs)} tokens "
                         f"(EOS ignored)",
                         ["engine", "total tok/s", "mean ms/tok", "mean TTFT (ms)", "KV MB", "wall s"]
                         + ([f"{focus} speedup"] if focus in rows else []))
        base = rows.get(focus)   # absent when the focus engine did not run: no speedup column, rather than nan
        for name, row in rows.items():
            speedup = [f"{base['tok_s'] / row['tok_s']:.2f}x" if row["tok_s"] else "-"] if base else []
            t.add_row(name, row["tok_s"], row["ms_per_tok"], row["ttft_ms"], row["kv_peak_mb"], row["wall_s"],
                      *speedup)
        ref = next(iter(rows.values()))
        for name, row in rows.items():
            same = sum(a == b for a, b in zip(row["outputs"], ref["outputs"]))
            t.notes.append(f"{name}: {same}/{len(reqs)} outputs identical to {ref['engine']}'s"
                           + (f"; {row['note']}" if row.get("note") else ""))
        t.notes.append("Greedy outputs can differ in bf16 (different batch shapes round differently); "
                       "the fp32 tests assert token-for-token equality with HF generate.")
        t.notes.append(f"every engine: {warmup}")
        if any(name in rows for name in ("hf_static", "hf_compiled")):
            t.notes.append("hf_static, hf_compiled: every row's token i is timed when step i+1's logits are "
                           "ready (CUDA events on a GPU: no synchronize per step), so TTFT runs to the end of the "
                           "first decode step and ms/tok is the mean step time of the one padded batch")
        for name, row in rows.items():
            if row.get("settings"):
                t.notes.append(f"{name} settings: {format_settings(row['settings'])}")


def targets_table(report: Report, results: dict, targets: Targets) -> None:
    """The targets whose two engines both ran, as a table, and a note naming the others. With none measured (the
    CPU's default engines leave out the GPU peers), the note goes on the last workload table, not an empty table."""
    measured, missing = [], []
    for (wname, fast, slow), target in targets.items():
        rows = results.get(wname, {})
        if fast in rows and slow in rows and rows[slow]["tok_s"]:
            ratio = rows[fast]["tok_s"] / rows[slow]["tok_s"]
            measured.append((wname, f"{fast} / {slow} tok/s", f"{ratio:.2f}x", f">= {target:.1f}x", ratio >= target))
        else:
            missing.append(f"{fast} and {slow} ({wname})")
    missing.sort()
    if not measured:
        if missing and report.tables:
            report.tables[-1].notes.append("no target measured: each compares two engines on one workload, "
                                           "and this run had no such pair; they need " + "; ".join(missing))
        return
    t = report.table("Ratios the phase aims for (same requests, one run)",
                     ["workload", "comparison", "measured", "target", "met"])
    for row in measured:
        t.add_row(*row)
    if missing:
        t.notes.append("not measured, one of the two engines did not run: " + "; ".join(missing))


def roofline_table(report: Report, lm, results: dict, focus: str, quick: bool) -> None:
    """The `focus` engine's tok/s as a share of what this machine's matmul FLOP/s allow."""
    flops = measure_matmul_flops(lm.dtype, lm.device, n=QUICK_MATMUL_N if quick else MATMUL_N)
    ceiling = roofline_tokens_per_s(flops, lm.n_params)
    t = report.table("Compute roofline", ["workload", "matmul GFLOP/s", "params (M)", "ceiling tok/s",
                                          f"{focus} tok/s", "share of ceiling"])
    for wname, rows in results.items():
        if focus in rows:
            got = rows[focus]["tok_s"]
            t.add_row(wname, flops / 1e9, lm.n_params / 1e6, ceiling, got, f"{100 * got / ceiling:.1f}%")
    t.notes.append(f"ceiling = measured {str(lm.dtype).removeprefix('torch.')} matmul FLOP/s / (2 x parameters): "
                   "every parameter costs a multiply and an add per token")
    report.data["roofline"] = dict(matmul_flops=flops, ceiling_tok_s=ceiling, n_params=lm.n_params)


def profile_table(report: Report, engine) -> None:
    """Where one decode step of `engine` (every sequence running) spends its time."""
    ops = profile_decode_step(engine)
    p = report.table(f"Where one decode step's time goes ({len(engine.running)} sequences, torch.profiler self time)",
                     ["op", "self ms", "share"])
    for op in ops:
        p.add_row(op["op"], op["self_ms"], f"{100 * op['share']:.1f}%")
    report.data["profile"] = ops
