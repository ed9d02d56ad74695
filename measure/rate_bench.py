"""The harness of `rate_sweep`: paged allocation against Orca's reservations, request rate by request rate.

The vLLM paper's Fig. 12 and 13 (§6.1) in small: requests with lengths like ShareGPT's (or Alpaca's) arrive
as a Poisson process (measure/workload.py's `rate_trace`) and are served in-process on the wall clock
(measure/harness.py's `drive_timed`) by one engine per policy, the same requests for each. Per policy and
rate: the normalized latency (the mean over requests of end-to-end latency / output tokens, s/token, as in
the paper), and the mean number of requests batched per step (`run_once`). Each rate runs for the same time
(`duration_s` of arrivals, rate x that many requests), as the paper's hour-long traces do. Then the highest
rate each policy sustains under one latency bound (`sustained_rate`) and the ratios of paged allocation over
each reservation, beside the paper's.

A phase's demo hands in the engines (measure/ imports no phase):

    run_rate_sweep(cfg, engines)
      engines  {policy: make(lm, context_limit=, block_size=, n_blocks=, max_running=) -> engine}, the
               paged engine first; an engine has `add`, `step`, `has_work`, `running`, `allocator` and,
               when it can preempt, `stats.n_preemptions`

The paper's setup (OPT-13B on one A100-40GB) is scaled down by `--scale` (`run_rate_sweep`), so the pool
holds as many requests as the paper's did and memory binds the same way, while a small model on a CPU
finishes.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch
from statistics import mean

from common.clock import now
from measure.bench import ceil_div, cpu_threads
from measure.demos import Option, RunConfig
from measure.harness import drive_timed
from measure.progress import progress_bar
from measure.report import Report
from measure.workload import DATASET_MEANS, PAPER_CONTEXT_LIMIT, rate_trace

PAPER_POOL_TOKENS = 15_700   # OPT-13B on an A100-40GB: the paper's Table 1 (12 GB / 800 KB per token)
MAX_RUNNING = 1024           # far above what the pool holds: memory, not the slot count, limits the batch
WARMUP_REQUESTS = 4
# What the paper reports on ShareGPT (§6.1), paged over each Orca variant: rates sustained at similar latency
# (OPT-13B, 66B and 175B) and requests batched at once (OPT-13B, Fig. 13a). It quotes no Pow2 figure.
PAPER_RATE_RATIO = {"oracle": "1.7-2.7x", "max": "2.7-8x"}
PAPER_BATCH_RATIO = {"oracle": "2.2x", "max": "4.3x"}
QUICK = dict(duration_s=0.5, rates=[8.0, 32.0], scale=1 / 64, block_size=4, latency_bound=1.0)
LABELS = {"paged": "paged (vLLM)", "oracle": "Orca (Oracle)", "pow2": "Orca (Pow2)", "max": "Orca (Max)"}
STYLES = {"paged": dict(color="tab:red", marker="o"), "oracle": dict(color="tab:blue", marker="s"),
          "pow2": dict(color="tab:green", marker="^"), "max": dict(color="tab:purple", marker="D")}


def rate_options(policies: tuple[str, ...]) -> list[Option]:
    return [
        Option("duration_s", float, cpu=12.0, gpu=120.0,
               help="seconds of arrivals per run (the paper's traces last an hour): rate x this requests"),
        Option("rates", float, cpu=[2.0, 4.0, 6.0, 8.0, 12.0, 16.0], gpu=[0.5, 1.0, 1.5, 2.0, 2.5, 3.0],
               many=True, help="request rates (requests/s) to sweep"),
        Option("dataset", str, cpu="sharegpt", help="whose length statistics to draw from",
               choices=tuple(DATASET_MEANS)),
        Option("scale", float, cpu=1 / 16, gpu=1.0,
               help="multiplies the paper's mean lengths, context limit (2048) and pool (15.7K tokens)"),
        Option("pool_tokens", int, cpu=0, help="KV pool in tokens (0: the paper's OPT-13B pool x scale)"),
        Option("block_size", int, cpu=4, gpu=16, help="tokens per KV block"),
        Option("latency_bound", float, cpu=0.3, gpu=0.4,
               help="normalized latency (s/token) under which a rate counts as sustained"),
        Option("stop_factor", float, cpu=3.0,
               help="a policy stops at the first rate whose latency passes stop_factor x the bound"),
        Option("policies", str, cpu=list(policies), many=True, choices=policies,
               help="from: " + " ".join(policies)),
        Option("threads", int, cpu=1, gpu=0,
               help="CPU intra-op threads (0: torch's default); 1 is steadier on a shared CPU"),
        Option("seed", int, cpu=0, help="trace seed"),
    ]


def run_once(lm, make, requests, context_limit: int, block_size: int, n_blocks: int, label: str) -> dict:
    """One policy at one rate: the trace driven on the wall clock; what the tables need. The batch is averaged
    over the steps while requests still arrive, since a short trace's drain (its longest requests finishing
    alone) is not the load's batch."""
    engine = make(lm, context_limit=context_limit, block_size=block_size, n_blocks=n_blocks,
                  max_running=MAX_RUNNING)
    batched: list[int] = []
    last_arrival = max(r.arrival_s for r in requests)

    with progress_bar(label, total=len(requests)) as bar:
        def on_step(outputs) -> None:
            done = sum(o.finished for o in outputs)
            if now(lm.device) - t0 <= last_arrival:   # the drain after the last arrival is not the load's batch
                batched.append(len(engine.running) + done)   # every request in this step's batch
            bar.advance(done)
        t0 = now(lm.device)
        seqs = drive_timed(engine, lm, requests, on_step)
        wall = now(lm.device) - t0
    latency = [(s.timing.finish - s.timing.arrival) / s.timing.n_generated for s in seqs]
    stats = getattr(engine, "stats", None)
    batched = batched or [0]
    return dict(n_requests=len(requests), norm_latency=mean(latency), mean_batched=mean(batched),
                max_batched=max(batched),
                n_steps=len(batched), wall_s=wall, tok_s=sum(s.timing.n_generated for s in seqs) / wall,
                n_preemptions=stats.n_preemptions if stats else 0, peak_blocks=engine.peak_blocks_used,
                outputs=[list(s.output_ids) for s in seqs])


def sustained_rate(points: list[tuple[float, float]], bound: float) -> tuple[float, bool]:
    """(rate, exact): where normalized latency crosses `bound`, interpolated linearly between the two rates
    around the crossing; (highest rate run, False) if it never crossed; (0, True) if even the lowest did."""
    below = None
    for rate, lat in sorted(points):
        if lat > bound:
            if below is None:
                return 0.0, True
            r0, l0 = below
            return r0 + (rate - r0) * (bound - l0) / (lat - l0), True
        below = (rate, lat)
    return max(r for r, _ in points), False


def run_rate_sweep(cfg: RunConfig, engines: dict) -> Report:
    """Every policy at every rate, then the sustained rates and their ratios.

    Scaled from the paper's setup (OPT-13B on one A100-40GB): its KV pool holds about 15.7K tokens (a third of
    40 GB, 12 GB, at 800 KB per token), requests average 161 + 338 tokens (ShareGPT) and Orca (Max) reserves
    2048. `--scale s` multiplies all three by s."""
    cfg.use_quick(**QUICK)
    o = cfg.options
    lm = cfg.load()
    report = cfg.new_report("rate_sweep")
    policies = [p for p in engines if p in o["policies"]]
    scale, bs = o["scale"], o["block_size"]
    context_limit = max(2, round(PAPER_CONTEXT_LIMIT * scale))
    pool_tokens = o["pool_tokens"] or round(PAPER_POOL_TOKENS * scale)
    n_blocks = ceil_div(pool_tokens, bs)
    if n_blocks < ceil_div(context_limit, bs):
        raise ValueError(f"a pool of {pool_tokens} tokens cannot hold one request of the context limit "
                         f"({context_limit}), which Orca (Max) reserves")
    rates = sorted(o["rates"])
    trace = {r: rate_trace(lm.vocab_size, max(2, round(r * o["duration_s"])), r, o["dataset"], scale,
                           context_limit, o["seed"]) for r in rates}
    requests = trace[rates[-1]]
    prompt_lens = [len(r.prompt_ids) for r in requests]
    out_lens = [r.max_new_tokens for r in requests]
    load_before = os.getloadavg()

    runs: dict[str, dict[float, dict]] = {p: {} for p in policies}
    with cpu_threads(o["threads"]):
        warm = [replace(r, arrival_s=0.0) for r in requests[:WARMUP_REQUESTS]]
        run_once(lm, engines[policies[0]], warm, context_limit, bs, n_blocks, "warm-up")
        for p in policies:
            for r in rates:
                runs[p][r] = run_once(lm, engines[p], trace[r], context_limit, bs, n_blocks,
                                      f"{LABELS.get(p, p)} at {r:g} req/s")
                if runs[p][r]["norm_latency"] > o["stop_factor"] * o["latency_bound"]:
                    break   # past saturation: the queue only grows from here
    load_after = os.getloadavg()

    ref = policies[0]
    compared = {p: [(a == b) for r, run in runs[p].items() if r in runs[ref]
                    for a, b in zip(run["outputs"], runs[ref][r]["outputs"])] for p in policies[1:]}
    identical = {p: all(c) for p, c in compared.items()}
    latency_table(report, policies, rates, runs, "norm_latency",
                  f"Normalized latency (s/token) against request rate: {o['duration_s']:g} s of Poisson arrivals of "
                  f"{o['dataset']}-like requests, a pool of {n_blocks} blocks x {bs} tokens")
    latency_table(report, policies, rates, runs, "mean_batched",
                  "Mean requests batched per step, while requests arrive")
    sustained = {p: sustained_rate([(r, run["norm_latency"]) for r, run in runs[p].items()], o["latency_bound"])
                 for p in policies}
    ratio_table(report, policies, runs, sustained, o["latency_bound"], o["dataset"])

    means = DATASET_MEANS[o["dataset"]]
    notes = report.tables[0].notes
    notes += [
        f"{sum(len(trace[r]) for r in rates)} requests in all, rate x {o['duration_s']:g} s per rate; "
        f"lengths: lognormal, the paper's {o['dataset']} means ({means[0]:g} prompt, {means[1]:g} output tokens, "
        f"its Fig. 11) x {scale:g}; drawn here: prompts mean {mean(prompt_lens):.1f} (max {max(prompt_lens)}), "
        f"outputs mean {mean(out_lens):.1f} (max {max(out_lens)}); random token ids, EOS ignored, greedy",
        f"scaled from the paper's OPT-13B on an A100-40GB: pool {PAPER_POOL_TOKENS} tokens x {scale:g} = "
        f"{pool_tokens}, context limit {PAPER_CONTEXT_LIMIT} x {scale:g} = {context_limit} (what Orca (Max) "
        f"reserves), so the pool holds {pool_tokens / (mean(prompt_lens) + mean(out_lens)):.0f} whole requests "
        f"of mean length, or {pool_tokens // context_limit} Max reservations",
        "normalized latency: mean over requests of (finish - arrival) / output tokens; '-': not run (the policy "
        f"passed {o['stop_factor']:g}x the bound at a lower rate)",
        "paged: the preempting engine as it is (optimistic admission, the latest request preempted when the pool "
        "runs dry, recomputed); Orca: each request claims its whole reservation at admission and holds it to the "
        "end; prefix caching off in every engine (random prompts share nothing)",
        "outputs identical to paged's, token for token: " + ", ".join(
            f"{p} {sum(c)}/{len(c)}" for p, c in compared.items()) + (
            "" if all(identical.values()) or lm.dtype == torch.float32 else
            f" ({str(lm.dtype).removeprefix('torch.')}: two batches of different shapes can round a step "
            "differently and flip a greedy token; the fp32 tests assert equality)"),
        f"CPU threads: {o['threads'] or 'torch default'}; load average before {load_before[0]:.2f}, after "
        f"{load_after[0]:.2f} (1 min)" if not cfg.on_gpu else f"GPU: {report.meta.get('device_name')}",
    ]
    report.data.update(
        rates=rates, policies=policies, latency_bound=o["latency_bound"], scale=scale, pool_tokens=pool_tokens,
        n_blocks=n_blocks, block_size=bs, context_limit=context_limit, load_avg=[load_before, load_after],
        sustained={p: dict(rate=v[0], crossed=v[1]) for p, v in sustained.items()}, identical=identical,
        prompt_lens=prompt_lens, output_lens=out_lens,
        runs={p: {str(r): {k: v for k, v in run.items() if k != "outputs"} for r, run in by_rate.items()}
              for p, by_rate in runs.items()})
    return report


def latency_table(report: Report, policies: list[str], rates: list[float], runs: dict, key: str, title: str) -> None:
    """One row per rate, one column per policy ('-' where a policy was not run at that rate)."""
    t = report.table(title, ["rate (req/s)"] + [LABELS.get(p, p) for p in policies])
    for r in rates:
        t.add_row(f"{r:g}", *[runs[p][r][key] if r in runs[p] else "-" for p in policies])


def ratio_table(report: Report, policies: list[str], runs: dict, sustained: dict, bound: float,
                dataset: str = "sharegpt") -> None:
    """The highest rate each policy sustains under `bound`, and paged over each reservation beside the paper
    (whose figures in words are for ShareGPT only: for another dataset its columns say '-')."""
    ref = policies[0]
    paper_rate, paper_batch = (PAPER_RATE_RATIO, PAPER_BATCH_RATIO) if dataset == "sharegpt" else ({}, {})
    t = report.table(f"Highest rate sustained under {bound:g} s/token, and paged over each reservation",
                     ["policy", "sustained rate (req/s)", "rate: paged / this", "paper: rate",
                      "batched at (req/s)", "batched: paged / this", "paper: batched"])
    top, exact_top = sustained[ref]
    for p in policies:
        rate, exact = sustained[p]
        shown = f"{rate:.2f}" if exact else f">= {rate:.2f}"
        if p == ref:
            t.add_row(LABELS.get(p, p), shown, "-", "-", "-", "-", "-")
            continue
        if not rate:
            ratio = "- (over the bound at every rate)"
        else:
            # an uncrossed curve's rate is a lower bound: of the ratio when it is paged's, and the other way round
            sign = "" if exact == exact_top else (">= " if exact else "<= ")
            ratio = f"{sign}{top / rate:.2f}x" if exact or exact_top else f"~ {top / rate:.2f}x (neither crossed)"
        common = max(set(runs[p]) & set(runs[ref]))   # the highest rate both ran: the reservation most bound
        batched = runs[ref][common]["mean_batched"] / runs[p][common]["mean_batched"]
        t.add_row(LABELS.get(p, p), shown, ratio, paper_rate.get(p, "-"),
                  f"{common:g}", f"{batched:.2f}x", paper_batch.get(p, "-"))
    t.notes += [
        "sustained rate: where the policy's normalized latency crosses the bound, interpolated linearly between "
        "the two rates around the crossing; '>=': it never crossed in the rates run",
        "batched: mean requests per step while requests arrive, at the highest rate both policies ran",
        "paper: vLLM paper §6.1 on ShareGPT, rates across OPT-13B, 66B and 175B (Fig. 12, first row), batched "
        "requests for OPT-13B on one A100 (Fig. 13a); it quotes no Pow2 figure",
    ]


def plot_rate_sweep(report: Report, png_path) -> None:
    """Left: normalized latency against rate, one line per policy (the paper's Fig. 12); right: requests
    batched per step (its Fig. 13)."""
    from measure import plots

    d = report.data
    rates, policies = d["rates"], d["policies"]

    def series(key: str) -> dict[str, list[float]]:
        return {LABELS.get(p, p): [d["runs"][p][str(r)][key] if str(r) in d["runs"][p] else float("nan")
                                   for r in rates] for p in policies}

    styles = {LABELS.get(p, p): STYLES.get(p, {}) for p in policies}
    m = report.meta
    plots.draw_panels(png_path, [
        plots.line_panel(rates, series("norm_latency"), xlabel="request rate (req/s)",
                         ylabel="normalized latency (s/token)", title="latency against load (Fig. 12)",
                         styles=styles, hlines={f"bound {d['latency_bound']:g} s/token": d["latency_bound"]},
                         logy=True, legend_fontsize=8),
        plots.line_panel(rates, series("mean_batched"), xlabel="request rate (req/s)",
                         ylabel="mean requests batched per step", title="batch size (Fig. 13)", styles=styles,
                         from_zero=True, legend_fontsize=8),
    ], title=f"rate_sweep: {m.get('model')} on {m.get('device_name', m.get('device'))}, pool {d['pool_tokens']} "
             f"tokens, scale {d['scale']:g}", panel_size=(5.5, 4.2))
