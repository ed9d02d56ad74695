"""The harness of `bench_serve`: a server in this process under Poisson load, measured from the client side.

A phase's demo hands in its server (measure/ imports no phase):

    run_bench_serve(cfg, ServingStack(create_app=create_app, serve=BackgroundServer, engine_of=...))

  create_app  create_app(lm, max_running=, max_waiting=, prefix_caching=, block_size=, n_blocks=) -> an
              app serving OpenAI-compatible streaming chat completions and Prometheus /metrics
  serve       `with serve(app) as server:` runs it in this process; `server.url` is its root (for
              /metrics), `server.base_url` its /v1
  engine_of   engine_of(app) -> the engine behind it (`max_running`, `prefix_caching`,
              `preemption_mode`, `allocator` with `n_blocks` and `block_size`), for the notes

measure/load_gen.py sends the load (`load_at_rates`: a warm-up, then the same requests at each rate)
and reads /metrics (`scrape_metrics`). One table per run of `--workload` (WORKLOADS).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from common.prompts import translation_input, translation_system_prompt
from measure.bench import ceil_div
from measure.demos import Option, RunConfig
from measure.load_gen import chat_payloads, load_at_rates, scrape_metrics
from measure.report import Report

WORKLOADS = ("chat", "fewshot", "undersized")
KNEE_FACTOR = 2.0          # latency "climbs" where median TTFT passes this multiple of the lowest rate's
FEWSHOT_SHOTS = 5          # the shared system prompt: instruction + 5 worked examples
UNDERSIZED_BLOCK_SIZE = 16
QUICK = dict(rates=[8.0], n_requests=3, max_tokens=4)
METRICS = ["req_per_s", "output_tok_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "e2e_p50_ms"]


@dataclass
class ServingStack:
    """What the bench needs of a phase's server (see the module docstring)."""
    create_app: Callable
    serve: Callable
    engine_of: Callable


def bench_serve_options() -> list[Option]:
    return [
        Option("rates", float, cpu=[0.5, 1.0, 2.0, 4.0, 8.0], gpu=[1.0, 2.0, 4.0, 8.0, 16.0, 32.0], many=True,
               help="request rates to offer (requests/s, Poisson arrivals)"),
        Option("n_requests", int, cpu=24, gpu=200, help="requests per rate"),
        Option("max_tokens", int, cpu=32, gpu=256, help="max_tokens of each request (short answers stop at EOS)"),
        Option("max_running", int, cpu=8, gpu=64,
               help="the engine's running-batch cap (below n_requests, so a burst has to queue)"),
        Option("seed", int, cpu=0, help="seed of the arrival times"),
        Option("workload", str, cpu="chat", help=f"one of {', '.join(WORKLOADS)}", choices=WORKLOADS),
        Option("pool_fraction", float, cpu=0.5,
               help="undersized: the KV pool as a fraction of what max_running requests need at once"),
    ]


def run_bench_serve(cfg: RunConfig, stack: ServingStack) -> Report:
    """Check the options, then run the workload `cfg.workload` names."""
    opts = dict(QUICK) if cfg.quick else {"rates": list(cfg.rates), "n_requests": cfg.n_requests,
                                          "max_tokens": cfg.max_tokens}
    rates, n, max_tokens = sorted(opts["rates"]), opts["n_requests"], opts["max_tokens"]
    if not rates or min(rates) <= 0 or n < 1 or max_tokens < 1:
        raise ValueError("bench_serve needs rates > 0, n_requests >= 1 and max_tokens >= 1")
    if cfg.workload not in WORKLOADS:
        raise ValueError(f"bench_serve: unknown workload '{cfg.workload}'; choose one of {', '.join(WORKLOADS)}")
    if not 0 < cfg.pool_fraction <= 1:
        raise ValueError(f"bench_serve: pool_fraction must be in (0, 1], got {cfg.pool_fraction}")
    run = {"chat": chat, "fewshot": fewshot, "undersized": undersized}[cfg.workload]
    return run(cfg, stack, rates, n, max_tokens)


def knee_rate(rates: list[float], ttft_p50_ms: list[float]) -> float | None:
    """The first rate whose median TTFT exceeds KNEE_FACTOR x the lowest rate's, or None."""
    pairs = sorted(zip(rates, ttft_p50_ms))
    base = pairs[0][1] if pairs else float("nan")
    for rate, ttft in pairs[1:]:
        if ttft > KNEE_FACTOR * base:
            return rate
    return None


def engine_note(stack: ServingStack, app) -> str:
    engine = stack.engine_of(app)
    pool = engine.allocator
    return (f"server in this process (uvicorn thread + engine thread), client in the main thread; engine "
            f"{type(engine).__name__} (prefix caching {'on' if engine.prefix_caching else 'off'}, preemption by "
            f"{engine.preemption_mode}), max_running {engine.max_running}, KV pool {pool.n_blocks} blocks x "
            f"{pool.block_size} tokens")


# --- chat: latency against the offered rate ------------------------------------------------
def chat(cfg: RunConfig, stack: ServingStack, rates: list[float], n: int, max_tokens: int) -> Report:
    lm = cfg.load()
    report = cfg.new_report("bench_serve")
    # Every request may wait: the bench measures queueing, so nothing is turned away with a 503.
    app = stack.create_app(lm, max_running=cfg.max_running, max_waiting=n)
    with stack.serve(app) as server:
        rows = load_at_rates(server.base_url, chat_payloads(lm.name, n, max_tokens), rates, cfg.seed, "bench_serve")

    table = report.table(f"streaming chat requests, {n} per rate, max_tokens {max_tokens}",
                         ["rate (req/s)", "done", "req/s", "output tok/s", "TTFT p50 (ms)", "TTFT p99 (ms)",
                          "ITL p50 (ms)", "ITL p99 (ms)", "e2e p50 (ms)"])
    for rate, s, _ in rows:
        table.add_row(rate, f"{s['completed']}/{n}", s["req_per_s"], s["output_tok_per_s"], s["ttft_p50_ms"],
                      s["ttft_p99_ms"], s["itl_p50_ms"], s["itl_p99_ms"], s["e2e_p50_ms"])
    report.data = {"workload": "chat", "rates": rates, "n_requests": n, "max_tokens": max_tokens,
                   **{k: [s[k] for _, s, _ in rows] for k in METRICS},
                   "completed": [s["completed"] for _, s, _ in rows], "errors": [s["errors"] for _, s, _ in rows]}
    knee = knee_rate(rates, report.data["ttft_p50_ms"])
    report.data["knee_rate"] = knee
    table.notes += [
        f"latency starts to climb at {knee:g} req/s (median TTFT > {KNEE_FACTOR:g}x that at {rates[0]:g} req/s)"
        if knee else f"latency did not climb over these rates (median TTFT stayed under {KNEE_FACTOR:g}x "
                     f"that at {rates[0]:g} req/s): offer higher rates to find the knee",
        engine_note(stack, app),
        "prompts: the blog's short/long chat prompts in turn, greedy; short answers stop at EOS, long ones at "
        "max_tokens. TTFT = request sent -> first text chunk; ITL = gap between text chunks (client side).",
    ]
    best_rate, best, _ = max(rows, key=lambda r: r[1]["req_per_s"])
    table.notes.append(f"most completed: {best['req_per_s']:.2f} req/s ({best['output_tok_per_s']:.1f} output tok/s), "
                       f"at {best_rate:g} req/s offered (req/s = completed / wall time, drain included)")
    failed = [(rate, s["errors"]) for rate, s, _ in rows if s["failed"]]
    if failed:
        table.notes.append(f"failed requests: {failed}")
    return report


# --- fewshot: one shared 5-shot system prompt, prefix caching on vs off ----------------------
def fewshot(cfg: RunConfig, stack: ServingStack, rates: list[float], n: int, max_tokens: int) -> Report:
    lm = cfg.load()
    report = cfg.new_report("bench_serve_fewshot")
    system = translation_system_prompt(FEWSHOT_SHOTS)
    # Fixed-length answers (EOS ignored): both servers decode the same tokens and differ only in prefill.
    payloads = chat_payloads(lm.name, n, max_tokens, prompts=[translation_input(i) for i in range(n)],
                             ignore_eos=True, system=system)
    queried, hit = "engine_prefix_cache_queried_blocks_total", "engine_prefix_cache_hit_blocks_total"
    rows = []
    for caching in (False, True):
        app = stack.create_app(lm, max_running=cfg.max_running, max_waiting=n, prefix_caching=caching)
        with stack.serve(app) as server:
            before = scrape_metrics(server.url)
            for rate, s, _ in load_at_rates(server.base_url, payloads, rates, cfg.seed,
                                            f"prefix caching {'on' if caching else 'off'}"):
                after = scrape_metrics(server.url)
                n_queried, n_hit = after[queried] - before[queried], after[hit] - before[hit]
                rows.append((caching, rate, s, n_hit / n_queried if n_queried else float("nan")))
                before = after
            note = engine_note(stack, app)

    n_system = len(lm.tokenizer(system, add_special_tokens=False)["input_ids"])
    table = report.table(f"{n} streaming chat requests behind one {FEWSHOT_SHOTS}-shot system prompt "
                         f"(~{n_system} tokens), max_tokens {max_tokens}",
                         ["prefix caching", "rate (req/s)", "done", "hit rate", "TTFT p50 (ms)", "TTFT p99 (ms)",
                          "e2e p50 (ms)", "output tok/s"])
    for caching, rate, s, hit_rate in rows:
        table.add_row("on" if caching else "off", rate, f"{s['completed']}/{n}", hit_rate, s["ttft_p50_ms"],
                      s["ttft_p99_ms"], s["e2e_p50_ms"], s["output_tok_per_s"])
    report.data = {"workload": "fewshot", "rates": rates, "n_requests": n, "max_tokens": max_tokens,
                   "shots": FEWSHOT_SHOTS, "system_tokens": n_system,
                   "runs": [{"prefix_caching": c, "rate": r, "hit_rate": h, **s} for c, r, s, h in rows]}
    for rate in rates:
        off, on = (next(s for c, r, s, _ in rows if c is caching and r == rate) for caching in (False, True))
        table.notes.append(f"{rate:g} req/s: median TTFT {off['ttft_p50_ms']:.0f} ms -> {on['ttft_p50_ms']:.0f} ms "
                           f"with prefix caching ({off['ttft_p50_ms'] / on['ttft_p50_ms']:.2f}x)")
    table.notes += [
        note.replace("prefix caching on", "prefix caching on/off"),
        "hit rate = prompt blocks found in the prefix cache / full prompt blocks looked up, during the timed run, "
        "from the server's /metrics. The warm-up requests share no prefix with the timed ones.",
        "requests admitted in the same step cannot use each other's blocks (phase 4.3's known limit): the first "
        "wave computes the system prompt, later ones hit it.",
    ]
    return report


# --- undersized: a pool smaller than the offered load ---------------------------------------
def undersized(cfg: RunConfig, stack: ServingStack, rates: list[float], n: int, max_tokens: int) -> Report:
    lm = cfg.load()
    report = cfg.new_report("bench_serve_undersized")
    # Greedy and fixed-length: both pools must produce exactly the same text.
    payloads = chat_payloads(lm.name, n, max_tokens, ignore_eos=True)
    block_size = UNDERSIZED_BLOCK_SIZE
    tok = lm.tokenizer  # the prompt as the server sees it: the chat template around the messages
    lengths = [len(tok(tok.apply_chat_template(p["messages"], tokenize=False, add_generation_prompt=True),
                       add_special_tokens=False)["input_ids"]) + max_tokens for p in payloads]
    concurrent = sorted(lengths, reverse=True)[:cfg.max_running]
    demand = sum(ceil_div(t, block_size) for t in concurrent)   # blocks max_running requests hold at their end
    pool = max(ceil_div(max(lengths), block_size) + 1, int(cfg.pool_fraction * demand))
    runs = {}
    for label, n_blocks in (("unconstrained", None), ("undersized", pool)):
        app = stack.create_app(lm, max_running=cfg.max_running, max_waiting=n, block_size=block_size,
                               n_blocks=n_blocks)
        with stack.serve(app) as server:
            rows = load_at_rates(server.base_url, payloads, rates, cfg.seed, label)
            metrics = scrape_metrics(server.url)
            runs[label] = (stack.engine_of(app).allocator.n_blocks, rows, metrics, engine_note(stack, app))

    table = report.table(f"{n} streaming chat requests, greedy, {max_tokens} tokens each (EOS ignored), "
                         f"max_running {cfg.max_running}: an undersized KV pool against an unconstrained one",
                         ["pool", "blocks", "rate (req/s)", "done", "5xx", "preemptions", "outputs equal",
                          "TTFT p50 (ms)", "e2e p50 (ms)", "output tok/s"])
    reference = {rate: res for rate, _, res in runs["unconstrained"][1]}
    report.data = {"workload": "undersized", "rates": rates, "n_requests": n, "max_tokens": max_tokens,
                   "demand_blocks": demand, "runs": []}
    for label, (blocks, rows, metrics, _) in runs.items():
        for rate, s, results in rows:
            equal = sum(r.ok and r.text == ref.text for r, ref in zip(results, reference[rate]))
            table.add_row(label, blocks, rate, f"{s['completed']}/{n}", s["server_errors"],
                          int(metrics["engine_preemptions_total"]), f"{equal}/{n}", s["ttft_p50_ms"],
                          s["e2e_p50_ms"], s["output_tok_per_s"])
            report.data["runs"].append({"pool": label, "blocks": blocks, "rate": rate, "outputs_equal": equal,
                                        "preemptions": metrics["engine_preemptions_total"], **s})
    table.notes += [
        f"the {cfg.max_running} longest requests hold {demand} blocks of {block_size} tokens at their end; the "
        f"undersized pool has {pool} ({cfg.pool_fraction:g} of that, at least one request's worth + 1)",
        "preemptions: the server's engine_preemptions_total (/metrics), over every rate; outputs equal: the "
        "request's streamed text equals the unconstrained run's, request by request",
        runs["undersized"][3],
    ]
    if lm.dtype.is_floating_point and str(lm.dtype) != "torch.float32":
        table.notes.append(f"{str(lm.dtype).removeprefix('torch.')}: a recomputed prefill may round differently "
                           "from the decode passes it replaces; token-for-token equality is the fp32 claim")
    return report


def plot_bench_serve(report: Report, png_path) -> None:
    """chat: TTFT, inter-token latency and output throughput against the offered rate; fewshot: TTFT with the
    prefix cache off and on; undersized: median TTFT and end-to-end latency per pool."""
    from measure import plots

    d, m = report.data, report.meta
    where = f"{m.get('model')} on {m.get('device_name', m.get('device'))}, {m.get('dtype')}"
    if d.get("workload") == "fewshot":
        runs = d["runs"]
        labels = [f"{r:g} req/s" for r in d["rates"]]
        series = {f"prefix cache {'on' if c else 'off'} ({q})": [next(x[f"ttft_{q}_ms"] for x in runs
                                                                    if x["prefix_caching"] is c and x["rate"] == r)
                                                               for r in d["rates"]]
                  for c in (False, True) for q in ("p50", "p99")}
        plots.draw_panels(png_path, [plots.bar_panel(labels, series, ylabel="TTFT (ms)")],
                          title=f"bench_serve fewshot: {d['shots']}-shot system prompt, {where}", panel_size=(7, 4.5))
        return
    if d.get("workload") == "undersized":
        labels = [f"{x['pool']} ({x['blocks']} blocks), {x['rate']:g} req/s" for x in d["runs"]]
        series = {k: [x[f"{k}_p50_ms"] for x in d["runs"]] for k in ("ttft", "e2e")}
        plots.draw_panels(png_path, [plots.bar_panel(labels, {f"{k} p50 (ms)": v for k, v in series.items()},
                                                     ylabel="ms", slanted=True)],
                          title=f"bench_serve undersized: preemption under load, {where}", panel_size=(8, 4.5))
        return
    rates = d["rates"]
    panel = dict(xlabel="offered rate (requests/s)", logx=True, ticks_at_x=True)
    plots.draw_panels(png_path, [
        plots.line_panel(rates, {"p50": d["ttft_p50_ms"], "p99": d["ttft_p99_ms"]}, ylabel="TTFT (ms)", **panel),
        plots.line_panel(rates, {"p50": d["itl_p50_ms"], "p99": d["itl_p99_ms"]},
                         ylabel="inter-token latency (ms)", **panel),
        plots.line_panel(rates, {"output tok/s": d["output_tok_per_s"]}, ylabel="output tok/s", **panel),
    ], title=f"bench_serve: {where}" + (f" - latency climbs at {d['knee_rate']:g} req/s" if d.get("knee_rate") else ""))
