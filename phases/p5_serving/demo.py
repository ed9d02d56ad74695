"""`bench_serve`: the server under Poisson load - throughput and latency against the request rate.

The server runs in this process (uvicorn in a thread on a free 127.0.0.1
port); the load generator (load_gen.py) sends `n_requests` streaming chat
requests at each rate, the same requests in the same order at every rate,
and measures from the client side, as vLLM's serving benchmark does.

Below the engine's capacity, TTFT is about one prefill and ITL about one
decode step of a small batch. As the rate approaches capacity the batch
grows (ITL rises with it), then requests start to queue for a slot and TTFT
climbs steeply: that knee is the rate this server can sustain.
"""

from __future__ import annotations

import asyncio

from common.demos import Option, RunConfig, demo
from common.report import Report
from common.workload import poisson_arrivals
from phases.p5_serving.launch import BackgroundServer
from phases.p5_serving.load_gen import chat_payloads, run_load, summarize
from phases.p5_serving.server import create_app

KNEE_FACTOR = 2.0          # latency "climbs" where median TTFT passes this multiple of the lowest rate's
WARMUP_REQUESTS = 2        # sent before timing: first passes pay for lazy init and allocator growth
WARMUP_MAX_TOKENS = 4
QUICK = dict(rates=[8.0], n_requests=3, max_tokens=4)
METRICS = ["req_per_s", "output_tok_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "e2e_p50_ms"]


def knee_rate(rates: list[float], ttft_p50_ms: list[float]) -> float | None:
    """The first rate whose median TTFT exceeds KNEE_FACTOR x the lowest rate's, or None."""
    pairs = sorted(zip(rates, ttft_p50_ms))
    base = pairs[0][1] if pairs else float("nan")
    for rate, ttft in pairs[1:]:
        if ttft > KNEE_FACTOR * base:
            return rate
    return None


def plot_bench_serve(report: Report, png_path) -> None:
    """TTFT, inter-token latency and output throughput against the offered request rate."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = report.data
    rates = d["rates"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, key, label in [(axes[0], "ttft", "TTFT (ms)"), (axes[1], "itl", "inter-token latency (ms)")]:
        ax.plot(rates, d[f"{key}_p50_ms"], marker="o", label="p50")
        ax.plot(rates, d[f"{key}_p99_ms"], marker="s", label="p99")
        ax.set_ylabel(label)
    axes[2].plot(rates, d["output_tok_per_s"], marker="o", color="tab:green")
    axes[2].set_ylabel("output tok/s")
    for ax in axes:
        ax.set_xlabel("offered rate (requests/s)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(rates, [f"{r:g}" for r in rates])
        ax.grid(alpha=0.3)
        if d.get("knee_rate"):
            ax.axvline(d["knee_rate"], color="gray", linestyle="--", linewidth=1)
    axes[0].legend()
    axes[1].legend()
    m = report.meta
    fig.suptitle(f"bench_serve: {m.get('model')} on {m.get('device_name', m.get('device'))}, {m.get('dtype')}"
                 + (f" - latency climbs at {d['knee_rate']:g} req/s" if d.get("knee_rate") else ""))
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


@demo("bench_serve", phase="p5",
      help="OpenAI-compatible server under Poisson load: req/s, output tok/s, TTFT and ITL p50/p99 per request rate",
      options=[
          Option("rates", float, cpu=[0.5, 1.0, 2.0, 4.0, 8.0], gpu=[1.0, 2.0, 4.0, 8.0, 16.0, 32.0], many=True,
                 help="request rates to offer (requests/s, Poisson arrivals)"),
          Option("n_requests", int, cpu=24, gpu=200, help="requests per rate"),
          Option("max_tokens", int, cpu=32, gpu=256, help="max_tokens of each request (short answers stop at EOS)"),
          Option("max_running", int, cpu=8, gpu=64,
                 help="the engine's running-batch cap (below n_requests, so a burst has to queue)"),
          Option("seed", int, cpu=0, help="seed of the arrival times"),
      ],
      plot=plot_bench_serve)
def bench_serve(cfg: RunConfig) -> Report:
    from rich.progress import Progress

    opts = dict(QUICK) if cfg.quick else {"rates": list(cfg.rates), "n_requests": cfg.n_requests,
                                          "max_tokens": cfg.max_tokens}
    rates, n, max_tokens = sorted(opts["rates"]), opts["n_requests"], opts["max_tokens"]
    if not rates or min(rates) <= 0 or n < 1 or max_tokens < 1:
        raise ValueError("bench_serve needs rates > 0, n_requests >= 1 and max_tokens >= 1")
    lm = cfg.load()
    report = cfg.new_report("bench_serve")
    # Every request may wait: the bench measures queueing, so nothing is turned away with a 503.
    app = create_app(lm, max_running=cfg.max_running, max_waiting=n)
    payloads = chat_payloads(lm.name, n, max_tokens)
    rows = []
    with BackgroundServer(app) as server, Progress(transient=True) as progress:
        warm = chat_payloads(lm.name, WARMUP_REQUESTS, WARMUP_MAX_TOKENS)
        asyncio.run(run_load(server.base_url, warm, [0.0] * WARMUP_REQUESTS))
        task = progress.add_task("bench_serve", total=n * len(rates))
        for rate in rates:
            progress.update(task, description=f"{rate:g} req/s")
            results, wall = asyncio.run(run_load(server.base_url, payloads, poisson_arrivals(n, rate, cfg.seed),
                                                 on_done=lambda _: progress.advance(task)))
            rows.append((rate, summarize(results, wall)))
        pool = app.state.engine.engine.allocator

    table = report.table(f"streaming chat requests, {n} per rate, max_tokens {max_tokens}",
                         ["rate (req/s)", "done", "req/s", "output tok/s", "TTFT p50 (ms)", "TTFT p99 (ms)",
                          "ITL p50 (ms)", "ITL p99 (ms)", "e2e p50 (ms)"])
    for rate, s in rows:
        table.add_row(rate, f"{s['completed']}/{n}", s["req_per_s"], s["output_tok_per_s"], s["ttft_p50_ms"],
                      s["ttft_p99_ms"], s["itl_p50_ms"], s["itl_p99_ms"], s["e2e_p50_ms"])
    report.data = {"rates": rates, "n_requests": n, "max_tokens": max_tokens,
                   **{k: [s[k] for _, s in rows] for k in METRICS},
                   "completed": [s["completed"] for _, s in rows], "errors": [s["errors"] for _, s in rows]}
    knee = knee_rate(rates, report.data["ttft_p50_ms"])
    report.data["knee_rate"] = knee
    table.notes += [
        f"latency starts to climb at {knee:g} req/s (median TTFT > {KNEE_FACTOR:g}x that at {rates[0]:g} req/s)"
        if knee else f"latency did not climb over these rates (median TTFT stayed under {KNEE_FACTOR:g}x "
                     f"that at {rates[0]:g} req/s): offer higher rates to find the knee",
        f"server in this process (uvicorn thread + engine thread), client in the main thread; engine "
        f"{type(app.state.engine.engine).__name__} (phase 4.4's: prefix caching on, preemption by recompute), "
        f"max_running {cfg.max_running}, KV pool {pool.n_blocks} blocks x {pool.block_size} tokens",
        "prompts: the blog's short/long chat prompts in turn, greedy; short answers stop at EOS, long ones at "
        "max_tokens. TTFT = request sent -> first text chunk; ITL = gap between text chunks (client side).",
    ]
    best_rate, best = max(rows, key=lambda r: r[1]["req_per_s"])
    table.notes.append(f"most completed: {best['req_per_s']:.2f} req/s ({best['output_tok_per_s']:.1f} output tok/s), "
                       f"at {best_rate:g} req/s offered (req/s = completed / wall time, drain included)")
    failed = [(rate, s["errors"]) for rate, s in rows if s["failed"]]
    if failed:
        table.notes.append(f"failed requests: {failed}")
    return report
