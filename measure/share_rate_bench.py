"""The harness of `share_sweep`: the vLLM paper's Fig. 14, paged allocation against Orca (Oracle) for
requests of several sequences, request rate by request rate.

Each request is a group: n parallel samples of one prompt, or a beam search of width k. Paged allocation
shares the prompt's blocks among the samples (and a beam's common history among its beams); Orca keeps
each sequence in its own contiguous chunk, so it shares nothing and reserves every sequence's whole
length at admission. The paper (§6.3) finds the gain grows with sharing: 1.3x over Orca (Oracle) in basic
sampling to 2.3x in beam search of width 6 (OPT-13B, Alpaca).

The load, the scaling and the measures are `rate_sweep`'s (measure/rate_bench.py): Poisson arrivals of
random-token requests with a dataset's lengths, one engine per policy driven on the wall clock by
`run_once`, the normalized latency of each request (its end-to-end latency over its output tokens, the
longest of its sequences), and the highest rate each policy sustains under a latency bound.

A phase's demo hands in the engines (measure/ imports no phase):

    run_share_sweep(cfg, engines)
      engines  {kind: {policy: (make, add)}}, kind "sampling" or "beam", the paged policy first;
               make(lm, context_limit=, block_size=, n_blocks=, max_running=) -> engine, and
               add(engine, prompt_ids, max_new_tokens, sampling, arrival, width) -> group (its `seqs`)
"""

from __future__ import annotations

import os
from dataclasses import replace
from statistics import mean

from common.clock import SeqTiming
from common.sampling import SamplingParams
from measure.bench import ceil_div, cpu_threads
from measure.demos import Option, RunConfig
from measure.harness import outputs_of
from measure.rate_bench import PAPER_POOL_TOKENS, WARMUP_REQUESTS, run_once, sustained_rate
from measure.report import Report
from measure.workload import DATASET_MEANS, PAPER_CONTEXT_LIMIT, rate_trace

KINDS = ("sampling", "beam")
KIND_LABEL = {"sampling": "parallel sampling, n", "beam": "beam search, width"}
# §6.3's two figures in words (OPT-13B, Alpaca): paged over Orca (Oracle), from basic sampling to width-6 beams.
PAPER_GAIN = {("sampling", 1): "1.3x", ("beam", 6): "2.3x"}
SAMPLE_TEMPERATURE = 1.0    # samples that differ, so nothing but the prompt is shared
QUICK = dict(duration_s=0.5, rates=[8.0, 32.0], widths=[2], scale=1 / 8, pool_tokens=256, block_size=4,
             latency_bound=1.0)


def share_options() -> list[Option]:
    return [
        Option("kinds", str, cpu=list(KINDS), many=True, choices=KINDS, help="parallel sampling, beam search"),
        Option("widths", int, cpu=[2, 4, 6], many=True, help="samples per request, or beams (the paper's 2, 4, 6)"),
        Option("duration_s", float, cpu=6.0, gpu=120.0, help="seconds of arrivals per run: rate x this requests"),
        Option("rates", float, cpu=[1.0, 2.0, 4.0, 6.0, 8.0], gpu=[0.5, 1.0, 2.0, 4.0, 8.0], many=True,
               help="request rates (requests/s) to sweep"),
        Option("dataset", str, cpu="sharegpt", gpu="alpaca",
               help="whose length statistics to draw from (the paper: Alpaca; scaled down, its outputs are a few "
                    "tokens, and a step's fixed cost, not memory, sets the latency)",
               choices=tuple(DATASET_MEANS)),
        Option("scale", float, cpu=1 / 16, gpu=1.0, help="multiplies the paper's mean lengths and context limit"),
        Option("pool_tokens", int, cpu=0,
               help="KV pool in tokens (0: the paper's OPT-13B pool x scale)"),
        Option("block_size", int, cpu=4, gpu=16, help="tokens per KV block"),
        Option("latency_bound", float, cpu=0.3, gpu=0.4,
               help="normalized latency (s/token) under which a rate counts as sustained"),
        Option("stop_factor", float, cpu=2.0,
               help="a policy stops at the first rate whose latency passes stop_factor x the bound"),
        Option("threads", int, cpu=1, gpu=0,
               help="CPU intra-op threads (0: torch's default); 1 is steadier on a shared CPU"),
        Option("seed", int, cpu=0, help="trace seed"),
    ]


class GroupHandle:
    """One request of several sequences, read like a sequence once it is done: its timing runs from its
    arrival to its last sequence's finish, over the longest sequence's tokens; its outputs are the samples',
    or a beam search's best hypothesis."""

    def __init__(self, group):
        self.group = group

    @property
    def timing(self) -> SeqTiming:
        seqs = self.group.seqs
        return SeqTiming(arrival=seqs[0].timing.arrival, finish=max(s.timing.finish for s in seqs),
                         n_generated=max(len(s.output_ids) for s in seqs))

    @property
    def output_ids(self) -> list:
        return outputs_of([self.group])[0]


class GroupRequests:
    """An engine whose `add` queues a request of `width` sequences (through `add_group`) and returns its
    handle: what `run_once` drives. Everything else is the engine's."""

    def __init__(self, engine, add_group, width: int):
        self.engine, self.add_group, self.width = engine, add_group, width

    def add(self, prompt_ids, max_new_tokens, sampling, ignore_eos, arrival) -> GroupHandle:
        return GroupHandle(self.add_group(self.engine, prompt_ids, max_new_tokens, sampling, arrival, self.width))

    def __getattr__(self, name):
        return getattr(self.engine, name)


def grouped(make, add_group, width: int):
    def make_grouped(lm, **engine_kwargs) -> GroupRequests:
        return GroupRequests(make(lm, **engine_kwargs), add_group, width)
    return make_grouped


def run_share_sweep(cfg: RunConfig, engines: dict) -> Report:
    """Every kind, width and policy at every rate (a policy stops past saturation), then the sustained rates."""
    cfg.use_quick(**QUICK)
    o = cfg.options
    lm = cfg.load()
    report = cfg.new_report("share_sweep")
    scale, bs = o["scale"], o["block_size"]
    pool_tokens = o["pool_tokens"] or round(PAPER_POOL_TOKENS * scale)
    n_blocks = ceil_div(pool_tokens, bs)
    rates, widths = sorted(o["rates"]), sorted(o["widths"])
    if min(widths) < 1:
        raise ValueError(f"a request has at least one sequence; got widths {widths}")
    # A request's length is capped so that its widest request, unshared, still fits the pool (Orca must be
    # able to admit it alone): the lognormal's rare long tail, not its mean, meets this cap.
    context_limit = min(max(2, round(PAPER_CONTEXT_LIMIT * scale)), n_blocks // max(widths) * bs)

    def trace(rate: float):
        reqs = rate_trace(lm.vocab_size, max(2, round(rate * o["duration_s"])), rate, o["dataset"], scale,
                          context_limit, o["seed"])
        # each request its own seed: paged and Orca draw the same samples, so their outputs can be compared
        return [replace(r, sampling=SamplingParams(temperature=SAMPLE_TEMPERATURE, seed=i))
                for i, r in enumerate(reqs)]

    if context_limit < 2:
        raise ValueError(f"a pool of {n_blocks} blocks of {bs} cannot hold {max(widths)} unshared sequences")
    traces = {r: trace(r) for r in rates}
    load_before = os.getloadavg()
    runs: dict[tuple[str, int, str], dict[float, dict]] = {}
    with cpu_threads(o["threads"]):
        for kind in o["kinds"]:
            policies = list(engines[kind])
            first_make, first_add = engines[kind][policies[0]]
            warm = [replace(r, arrival_s=0.0) for r in traces[rates[-1]][:WARMUP_REQUESTS]]
            run_once(lm, grouped(first_make, first_add, widths[0]), warm, context_limit, bs, n_blocks, "warm-up")
            for width in widths:
                for p in policies:
                    make, add = engines[kind][p]
                    runs[kind, width, p] = by_rate = {}
                    for r in rates:
                        by_rate[r] = run_once(lm, grouped(make, add, width), traces[r], context_limit, bs, n_blocks,
                                              f"{kind} {width}, {p} at {r:g} req/s")
                        if by_rate[r]["norm_latency"] > o["stop_factor"] * o["latency_bound"]:
                            break   # past saturation: the queue only grows from here
    load_after = os.getloadavg()

    for kind in o["kinds"]:
        policies = list(engines[kind])
        t = report.table(f"{KIND_LABEL[kind].split(',')[0]}: normalized latency (s/token) against request rate",
                         ["rate (req/s)"] + [f"{p}, {w}" for w in widths for p in policies])
        for r in rates:
            t.add_row(f"{r:g}", *[runs[kind, w, p][r]["norm_latency"] if r in runs[kind, w, p] else "-"
                                  for w in widths for p in policies])
    t = report.table(f"Highest rate sustained under {o['latency_bound']:g} s/token: paged over Orca (Oracle)",
                     ["kind", "width", "paged (req/s)", "Orca (Oracle) (req/s)", "paged / Orca", "paper",
                      "batched: paged / Orca"])
    sustained, identical = {}, {}
    for kind in o["kinds"]:
        paged, orca = list(engines[kind])
        for w in widths:
            (rp, xp), (ro, xo) = (sustained_rate([(r, run["norm_latency"]) for r, run in runs[kind, w, p].items()],
                                                 o["latency_bound"]) for p in (paged, orca))
            sustained[f"{kind} {w}"] = dict(paged=rp, paged_crossed=xp, orca=ro, orca_crossed=xo)
            ratio = paged_over(rp, xp, ro, xo)
            common = max(set(runs[kind, w, paged]) & set(runs[kind, w, orca]))
            batched = runs[kind, w, paged][common]["mean_batched"] / runs[kind, w, orca][common]["mean_batched"]
            t.add_row(kind, w, f"{rp:.2f}" if xp else f">= {rp:.2f}", f"{ro:.2f}" if xo else f">= {ro:.2f}",
                      ratio, PAPER_GAIN.get((kind, w), "-"), f"{batched:.2f}x at {common:g} req/s")
            same = [a == b for r in set(runs[kind, w, paged]) & set(runs[kind, w, orca])
                    for a, b in zip(runs[kind, w, paged][r]["outputs"], runs[kind, w, orca][r]["outputs"])]
            identical[f"{kind} {w}"] = [sum(same), len(same)]
    prompt_lens = [len(r.prompt_ids) for r in traces[rates[-1]]]
    out_lens = [r.max_new_tokens for r in traces[rates[-1]]]
    means = DATASET_MEANS[o["dataset"]]
    t.notes += [
        f"lengths: lognormal, the paper's {o['dataset']} means ({means[0]:g} prompt, {means[1]:g} output tokens) "
        f"x {scale:g}; drawn here: prompts mean {mean(prompt_lens):.1f}, outputs mean {mean(out_lens):.1f}; "
        f"random token ids; {o['duration_s']:g} s of Poisson arrivals per rate",
        f"pool: {n_blocks} blocks x {bs} tokens ({pool_tokens} tokens), so it holds about "
        f"{pool_tokens / (mean(prompt_lens) + mean(out_lens)):.0f} single sequences of mean length; a request "
        f"is at most {context_limit} tokens (the paper's 2048 x {scale:g}, or the pool over the widest width)",
        "samples: temperature 1, EOS ignored, each generates its drawn length; beams: the search's own stopping "
        "rule, at most the drawn length; a request's latency runs to its last sequence, over its longest output",
        "paper: §6.3, OPT-13B on Alpaca; it gives 1.3x for basic sampling (n = 1, not run here) and 2.3x for "
        "beam width 6 in words, the other points only as curves",
        "sustained: where normalized latency crosses the bound, interpolated between the rates around it; '>=': "
        "never crossed in the rates run; batched: mean sequences per step while requests arrive, at the highest "
        "rate both ran",
        "outputs identical to paged's, request for request: " + ", ".join(
            f"{k} {v[0]}/{v[1]}" for k, v in identical.items()) + " (in bf16 a different batch can round a step "
        "differently and flip a token)",
        f"CPU threads: {o['threads'] or 'torch default'}; load average before {load_before[0]:.2f}, after "
        f"{load_after[0]:.2f} (1 min)" if not cfg.on_gpu else f"GPU: {report.meta.get('device_name')}",
    ]
    report.data.update(
        kinds=list(o["kinds"]), widths=widths, rates=rates, latency_bound=o["latency_bound"], scale=scale,
        pool_tokens=pool_tokens, block_size=bs, context_limit=context_limit, sustained=sustained,
        policies={k: list(engines[k]) for k in o["kinds"]},
        runs={f"{k} {w} {p}": {str(r): {key: v for key, v in run.items() if key != "outputs"}
                               for r, run in by_rate.items()} for (k, w, p), by_rate in runs.items()},
        identical=identical)
    return report


def paged_over(paged: float, paged_crossed: bool, orca: float, orca_crossed: bool) -> str:
    """Paged's sustained rate over Orca's. A rate that never crossed the bound is a lower bound, so the ratio
    is one too when only paged's did not cross ('>='), and an upper bound when only Orca's did not ('<=');
    '-' when neither crossed (nothing is known) or Orca crossed at the lowest rate (rate 0)."""
    if not orca or not (paged_crossed or orca_crossed):
        return "-"
    sign = "" if paged_crossed == orca_crossed else ("<= " if paged_crossed else ">= ")
    return f"{sign}{paged / orca:.2f}x"


def plot_share_sweep(report: Report, png_path) -> None:
    """One panel per kind (the paper's two rows of Fig. 14): normalized latency against rate, a colour per
    width, paged solid and Orca (Oracle) dashed."""
    from measure import plots

    d = report.data
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"]
    panels = []
    for kind in d["kinds"]:
        paged, orca = d["policies"][kind]
        series, styles = {}, {}
        for i, w in enumerate(d["widths"]):
            for p, ls in ((paged, "-"), (orca, "--")):
                runs = d["runs"][f"{kind} {w} {p}"]
                label = f"{p}, {KIND_LABEL[kind].split(', ')[1]} {w}"
                series[label] = [runs[str(r)]["norm_latency"] if str(r) in runs else float("nan") for r in d["rates"]]
                styles[label] = dict(color=colors[i % len(colors)], ls=ls)
        panels.append(plots.line_panel(d["rates"], series, xlabel="request rate (req/s)",
                                       ylabel="normalized latency (s/token)", title=KIND_LABEL[kind].split(",")[0],
                                       styles=styles, logy=True, legend_fontsize=7,
                                       hlines={f"bound {d['latency_bound']:g}": d["latency_bound"]}))
    m = report.meta
    plots.draw_panels(png_path, panels, title=f"share_sweep (Fig. 14): {m.get('model')} on "
                      f"{m.get('device_name', m.get('device'))}, pool {d['pool_tokens']} tokens",
                      panel_size=(5.5, 4.2))
