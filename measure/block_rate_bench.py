"""The harness of `block_sweep`: the vLLM paper's Fig. 18b and 19b in small, normalized latency at one request
rate against the block size.

Fig. 18b: paged allocation (recovering by recomputation) on ShareGPT-like and Alpaca-like lengths. Small blocks
read K/V in many small pieces; large ones leave more of each request's last block empty, so fewer requests fit
the pool, and once a block outgrows a whole request (Alpaca's are short) most of every block is waste. The paper
finds 16-128 best on ShareGPT, 16-32 on Alpaca. Fig. 19b: the same with recovery by recomputation against
swapping; the paper finds swapping worse at small blocks (many small PCIe transfers) and the two close at 16-64.

The load, the scaling and the measure are `rate_sweep`'s (measure/rate_bench.py): Poisson arrivals of random-token
requests with a dataset's lengths, the paper's pool and lengths times `--scale`, one engine per run driven on the
wall clock by `run_once`, and the mean over requests of end-to-end latency over output tokens. The pool holds the
same number of tokens at every block size.

A phase's demo hands in the engines (measure/ imports no phase):

    run_block_sweep(cfg, engines)
      engines  {mode: make(lm, context_limit=, block_size=, n_blocks=, max_running=) -> engine}
"""

from __future__ import annotations

import os
from dataclasses import replace

from measure.bench import ceil_div, cpu_threads
from measure.demos import Option, RunConfig
from measure.rate_bench import MAX_RUNNING, PAPER_POOL_TOKENS, WARMUP_REQUESTS, run_once
from measure.report import Report
from measure.workload import DATASET_MEANS, PAPER_CONTEXT_LIMIT, rate_trace

QUICK = dict(duration_s=0.5, block_sizes=[2, 8], datasets=["sharegpt"], swap_datasets=["sharegpt"], rates=[8.0],
             scale=1 / 64)
# What the paper reports in words (§7.2, §7.3); the rest of its figures are curves.
PAPER_BEST = {"sharegpt": (16, 128), "alpaca": (16, 32)}
STYLES = {"recompute": "-", "swap": "--"}


def block_options() -> list[Option]:
    return [
        Option("block_sizes", int, cpu=[1, 2, 4, 8, 16], gpu=[1, 2, 4, 8, 16, 32, 64, 128, 256], many=True,
               help="tokens per KV block (the paper: 1 to 256)"),
        Option("datasets", str, cpu=list(DATASET_MEANS), many=True, choices=tuple(DATASET_MEANS),
               help="whose length statistics to draw from, recovering by recomputation (Fig. 18b)"),
        Option("swap_datasets", str, cpu=["sharegpt"], many=True, choices=tuple(DATASET_MEANS),
               help="those also run recovering by swapping (Fig. 19b)"),
        # Rates at which the pool fills: ShareGPT's is rate_sweep's highest, past paged allocation's knee; Alpaca's
        # requests are a few tokens long, so it takes many more of them at once to fill a pool of large blocks.
        Option("rates", float, cpu=[16.0, 64.0], gpu=[2.0, 8.0], many=True,
               help="the fixed request rate (requests/s) of each dataset, in --datasets order"),
        Option("duration_s", float, cpu=8.0, gpu=120.0, help="seconds of arrivals per run"),
        Option("scale", float, cpu=1 / 16, gpu=1.0,
               help="multiplies the paper's mean lengths, context limit (2048) and pool (15.7K tokens)"),
        Option("threads", int, cpu=1, gpu=0,
               help="CPU intra-op threads (0: torch's default); 1 is steadier on a shared CPU"),
        Option("seed", int, cpu=0, help="trace seed"),
    ]


def run_block_sweep(cfg: RunConfig, engines: dict) -> Report:
    """Every dataset, recovery mode and block size at one rate, the pool's size in tokens fixed."""
    cfg.use_quick(**QUICK)
    o = cfg.options
    lm = cfg.load()
    report = cfg.new_report("block_sweep")
    scale, sizes = o["scale"], sorted(o["block_sizes"])
    context_limit = max(2, round(PAPER_CONTEXT_LIMIT * scale))
    pool_tokens = round(PAPER_POOL_TOKENS * scale)
    if min(sizes) < 1 or max(sizes) > pool_tokens:
        raise ValueError(f"block sizes must be 1 to the pool's {pool_tokens} tokens; got {sizes}")
    if len(o["rates"]) != len(o["datasets"]):
        raise ValueError(f"one rate per dataset: {len(o['datasets'])} datasets, {len(o['rates'])} rates")
    rate = dict(zip(o["datasets"], o["rates"]))
    if not set(o["swap_datasets"]) <= set(rate):
        raise ValueError(f"--swap-datasets {o['swap_datasets']} must be among --datasets {o['datasets']}")
    traces = {d: rate_trace(lm.vocab_size, max(2, round(r * o["duration_s"])), r, d, scale, context_limit,
                            o["seed"]) for d, r in rate.items()}
    plan = [(d, "recompute") for d in o["datasets"]] + [(d, "swap") for d in o["swap_datasets"]]
    load_before = os.getloadavg()
    runs: dict[str, dict[int, dict]] = {}
    with cpu_threads(o["threads"]):
        first = traces[o["datasets"][0]][:WARMUP_REQUESTS]
        run_once(lm, engines["recompute"], [replace(r, arrival_s=0.0) for r in first],
                 context_limit, sizes[0], ceil_div(pool_tokens, sizes[0]), "warm-up")
        for d, m in plan:
            runs[f"{d} {m}"] = {bs: run_once(lm, engines[m], traces[d], context_limit, bs,
                                             ceil_div(pool_tokens, bs), f"{d}, {m}, block {bs}")
                                for bs in sizes}
    load_after = os.getloadavg()

    t = report.table("Normalized latency (s/token) at a fixed rate against block size ("
                     + ", ".join(f"{d}: {r:g} req/s" for d, r in rate.items()) + ")", ["block size"] + list(runs))
    for bs in sizes:
        t.add_row(bs, *[runs[k][bs]["norm_latency"] for k in runs])
    p = report.table("Preemptions, requests batched per step, and the pool's peak use, by block size",
                     ["block size"] + [f"{k}: {what}" for k in runs for what in ("preempted", "batched", "peak")])
    for bs in sizes:
        n_blocks = ceil_div(pool_tokens, bs)
        p.add_row(bs, *[v for k in runs for v in (runs[k][bs]["n_preemptions"], runs[k][bs]["mean_batched"],
                                                   f"{runs[k][bs]['peak_blocks'] / n_blocks:.0%}")])
    p.notes.append("peak: the most blocks in use at once, as a share of the pool; block size matters to "
                   "latency only where the pool fills")
    best = report.table("Best block size, beside the paper's",
                        ["dataset", "mode", "best block (ours)", "within 10% of it", "paper: best"])
    for k, by_size in runs.items():
        d, m = k.split(" ")
        top = min(by_size.values(), key=lambda r: r["norm_latency"])["norm_latency"]
        near = [bs for bs in sizes if by_size[bs]["norm_latency"] <= 1.1 * top]
        best.add_row(d, m, min(sizes, key=lambda bs: by_size[bs]["norm_latency"]),
                     f"{min(near)}-{max(near)}", paper_best(d, scale) if m == "recompute" else "-")
    t.notes += [
        f"{o['duration_s']:g} s of Poisson arrivals per run; lengths: lognormal, the paper's means x {scale:g} "
        + "; ".join(f"{d}: {DATASET_MEANS[d][0]:g} + {DATASET_MEANS[d][1]:g} tokens" for d in o["datasets"]),
        f"pool: {pool_tokens} tokens at every block size (the paper's {PAPER_POOL_TOKENS} x {scale:g}), so the "
        f"number of blocks is {pool_tokens} / block size, rounded up; context limit {context_limit}",
        f"block sizes scale with the lengths: with requests {1 / scale:g}x shorter than the paper's, our block "
        f"of b tokens holds as much of a request as the paper's block of {1 / scale:g}b",
        "paged allocation as `rate_sweep` runs it (optimistic admission, the latest request preempted), "
        "recovering by recomputation or by swapping to a CPU pool as large as the GPU pool",
        f"CPU threads: {o['threads'] or 'torch default'}; load average before {load_before[0]:.2f}, after "
        f"{load_after[0]:.2f} (1 min)" if not cfg.on_gpu else f"GPU: {report.meta.get('device_name')}",
    ]
    best.notes.append("paper: §7.2 on Fig. 18b (basic sampling, a fixed rate); for Fig. 19b (§7.3) it says "
                      "recomputation and swapping are close from 16 to 64 and swapping is worse below")
    report.data.update(block_sizes=sizes, rates=rate, scale=scale, pool_tokens=pool_tokens,
                       runs={k: {str(bs): {key: v for key, v in r.items() if key != "outputs"}
                                 for bs, r in by_size.items()} for k, by_size in runs.items()},
                       max_running=MAX_RUNNING, load_avg=[load_before, load_after])
    return report


def paper_best(dataset: str, scale: float) -> str:
    """The paper's best block sizes, and what they hold of a request scaled by `scale`, in our blocks."""
    lo, hi = PAPER_BEST[dataset]
    return f"{lo}-{hi} (x {scale:g}: {lo * scale:g}-{hi * scale:g})"


def plot_block_sweep(report: Report, png_path) -> None:
    """Left: recomputation on each dataset (the paper's Fig. 18b); right: recomputation against swapping on each
    (its Fig. 19b). Log-2 block sizes."""
    from measure import plots

    d = report.data
    sizes = d["block_sizes"]

    def series(keep) -> tuple[dict, dict]:
        out, styles = {}, {}
        for i, (k, by_size) in enumerate(d["runs"].items()):
            if keep(k):
                out[k] = [by_size[str(bs)]["norm_latency"] for bs in sizes]
                styles[k] = dict(ls=STYLES.get(k.split(" ")[1], "-"))
        return out, styles

    rec, rec_styles = series(lambda k: k.endswith("recompute"))
    swapped = {k.split(" ")[0] for k in d["runs"] if k.endswith("swap")}
    both, both_styles = series(lambda k: k.split(" ")[0] in swapped)
    m = report.meta
    plots.draw_panels(png_path, [
        plots.line_panel(sizes, rec, xlabel="block size (tokens)", ylabel="normalized latency (s/token)",
                         title="block size (Fig. 18b)", logx=True, ticks_at_x=True, styles=rec_styles),
        plots.line_panel(sizes, both, xlabel="block size (tokens)", ylabel="normalized latency (s/token)",
                         title="recompute vs swap (Fig. 19b)", logx=True, ticks_at_x=True, styles=both_styles),
    ], title=f"block_sweep: {m.get('model')} on {m.get('device_name', m.get('device'))}, pool {d['pool_tokens']} "
             "tokens, " + ", ".join(f"{k} at {v:g} req/s" for k, v in d["rates"].items()), panel_size=(5.5, 4.2))
