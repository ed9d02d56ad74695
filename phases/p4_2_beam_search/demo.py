"""`share_demo`: how much KV memory sharing saves, for parallel sampling (n) and beam search (width k).

The vLLM paper (§6.3, Fig. 15) measures "memory saving" as the blocks saved by
sharing divided by the blocks needed without sharing. We measure the same on
our engines: at every decode pass the demo's engine (`MeteredEngine`, with phase
4.1's `RecordsBlockUsage`) records

    held     = distinct physical blocks the running sequences hold (with sharing)
    unshared = sum over running sequences of their own table lengths
               (what the same sequences would hold if each stored its own K/V)

and the demo reports `1 - sum(held) / sum(unshared)` over the run (the saving
averaged over time, in block-steps) and `1 - max(held) / max(unshared)` (the
pool each way would need at its peak).

Workload: the first `n_prompts` of the interleaved short/long latency prompts
(common/prompts.py, chat template applied), all submitted at once, each as one
request with n samples (temperature 0.8, fixed seed, stop at EOS or the cap) or
one beam search of width k (HF defaults: length_penalty 1, early_stopping False).
"""

from __future__ import annotations

from statistics import mean

from common.prompts import interleaved_latency_prompts
from common.sampling import SamplingParams
from measure.demos import Option, RunConfig, demo
from measure.harness import pool_problems
from measure.progress import progress_bar
from measure.report import Report
from measure.workload import Request
from phases.p3_1_block_allocator.allocator import DEFAULT_BLOCK_SIZE
from phases.p4_1_copy_on_write.demo import RecordsBlockUsage
from phases.p4_1_copy_on_write.engine import worst_case_blocks
from phases.p4_2_beam_search.engine import BeamSearchEngine

SAMPLE_TEMPERATURE = 0.8
SAMPLE_SEED = 0
QUICK = dict(ns=[2], beam_widths=[2], max_new_tokens=4, n_prompts=2)
# vLLM paper, §6.3 / Fig. 15 (OPT-13B): memory saving for n or k = 2, 4, 6
PAPER = {"parallel sampling": {"Alpaca": "6.1-9.8%", "ShareGPT": "16.2-30.5%"},
         "beam search": {"Alpaca": "37.6-55.2%", "ShareGPT": "44.3-66.3%"}}
COLORS = {"parallel sampling": "tab:blue", "beam search": "tab:orange"}


class MeteredEngine(RecordsBlockUsage, BeamSearchEngine):
    """The engine of this phase, recording the blocks held at every decode pass (`usage`)."""


def _measure(lm, prompts: list[str], method: str, width: int, max_new: int, block_size: int) -> dict:
    """Run one configuration to the end; return its block accounting and lengths."""
    ids = [lm.prompt_ids(p) for p in prompts]
    n_prompt = [len(i) for i in ids]
    # everyone runs at once
    pool = sum(worst_case_blocks(Request(prompt_ids=i, max_new_tokens=max_new), width, block_size) for i in ids)
    engine = MeteredEngine(lm, max_running=width * len(prompts), block_size=block_size, n_blocks=pool)
    if method == "parallel sampling":
        sampling = SamplingParams(temperature=SAMPLE_TEMPERATURE, seed=SAMPLE_SEED)
        groups = [engine.add_group(i, max_new, sampling, n=width) for i in ids]
    else:
        groups = [engine.add_beam_search(i, max_new, beam_width=width) for i in ids]
    engine.run()
    assert not pool_problems(engine.allocator), "blocks leaked"
    held = [h for h, _ in engine.usage]
    unshared = [u for _, u in engine.usage]
    if method == "parallel sampling":
        generated = [len(o) for g in groups for o in g.outputs]
    else:  # beams grow together: every live beam has as many tokens as its search has steps
        generated = [g.search.n_generated for g in groups]
    return dict(method=method, width=width, requests=len(prompts), sequences=width * len(prompts),
                mean_prompt=mean(n_prompt), mean_generated=mean(generated), decode_passes=len(held),
                held=held, unshared=unshared, copies=engine.n_copied,
                saving=1 - sum(held) / sum(unshared) if held else 0.0,
                peak_held=max(held, default=0), peak_unshared=max(unshared, default=0))


def plot_share(report: Report, png_path) -> None:
    """Left: saving per configuration vs the paper's Alpaca range. Right: blocks held over the widest beam run."""
    from measure import plots

    runs = report.data["runs"]
    beams = [r for r in runs if r["method"] == "beam search"] or runs
    widest = max(beams, key=lambda r: r["width"])
    bands = {}
    for method in PAPER:
        lo, hi = (float(x) for x in PAPER[method]["Alpaca"].rstrip("%").split("-"))
        bands[f"paper, Alpaca: {method}"] = (lo, hi, COLORS[method])
    plots.draw_panels(png_path, [
        plots.bar_panel([f"{'n' if r['method'] == 'parallel sampling' else 'k'}={r['width']}" for r in runs],
                        {"saving": [100 * r["saving"] for r in runs]}, ylabel="memory saved by sharing (%)",
                        title="Blue: parallel sampling, orange: beam search",
                        bar_colors=[COLORS[r["method"]] for r in runs], bands=bands, legend_fontsize=8),
        plots.line_panel(range(len(widest["held"])), {"without sharing (sum of table lengths)": widest["unshared"],
                                                      "with sharing (distinct blocks)": widest["held"]},
                         xlabel="decode pass", ylabel="KV blocks", title=f"{widest['method']}, width {widest['width']}",
                         marker="", legend_fontsize=8),
    ], title=f"share_demo ({report.meta.get('model', '')}, block size {report.data['block_size']})",
        panel_size=(6, 4.5))


@demo("share_demo", phase="p4_2", help="KV memory saved by block sharing: parallel sampling (n) and beam search (k)",
      options=[Option("ns", int, cpu=[2, 4, 6], gpu=[2, 4, 6], many=True, help="samples per request"),
               Option("beam_widths", int, cpu=[2, 4, 6], gpu=[2, 4, 6], many=True, help="beam widths"),
               Option("max_new_tokens", int, cpu=64, gpu=256, help="cap on generated tokens"),
               Option("n_prompts", int, cpu=8, gpu=8, help="requests (interleaved short/long prompts)"),
               Option("block_size", int, cpu=DEFAULT_BLOCK_SIZE, help="tokens per KV block")],
      plot=plot_share)
def share_demo(cfg: RunConfig) -> Report:
    cfg.use_quick(**QUICK)
    lm = cfg.load()
    report = cfg.new_report("share_demo")
    opts = cfg.options
    all_prompts = interleaved_latency_prompts()
    if not 1 <= opts["n_prompts"] <= len(all_prompts):
        raise ValueError(f"n_prompts must be in 1..{len(all_prompts)}, got {opts['n_prompts']}")
    prompts = all_prompts[:opts["n_prompts"]]
    configs = [("parallel sampling", n) for n in opts["ns"]] + [("beam search", k) for k in opts["beam_widths"]]
    runs = []
    with progress_bar("share_demo", total=len(configs)) as bar:
        for method, width in configs:
            bar.describe(f"{method}, {width}")
            runs.append(_measure(lm, prompts, method, width, opts["max_new_tokens"], cfg.block_size))
            bar.advance()

    t = report.table(f"Memory saved by sharing KV blocks (block size {cfg.block_size}, {len(prompts)} requests, "
                     f"cap {opts['max_new_tokens']} new tokens)",
                     ["method", "n / k", "seqs", "prompt tok", "gen tok", "held (mean)", "unshared (mean)",
                      "saving (run avg)", "saving at peak", "CoW copies"])
    for r in runs:
        peak_saving = 1 - r["peak_held"] / r["peak_unshared"] if r["peak_unshared"] else 0.0
        t.add_row(r["method"], r["width"], r["sequences"], f"{r['mean_prompt']:.1f}", f"{r['mean_generated']:.1f}",
                  f"{mean(r['held']):.1f}", f"{mean(r['unshared']):.1f}", f"{100 * r['saving']:.1f}%",
                  f"{100 * peak_saving:.1f}% ({r['peak_held']}/{r['peak_unshared']})", r["copies"])
    t.notes += [
        "held: distinct blocks the running sequences hold; unshared: the sum of their table lengths (each "
        "sequence storing its own K/V); both sampled at every decode pass",
        "saving (run avg) = 1 - sum(held) / sum(unshared) over the run; at peak = 1 - max(held) / max(unshared): "
        "the pool each way would need (max held / max unshared blocks)",
        "prompt tok: chat-template prompt length; gen tok: tokens per sample (parallel) or beam-search steps",
        f"parallel sampling: temperature {SAMPLE_TEMPERATURE}, seed {SAMPLE_SEED}, stop at EOS or the cap; "
        "beam search: HF rules, length_penalty 1.0, early_stopping False",
    ]
    paper = report.table("Next to the vLLM paper (§6.3, Fig. 15: OPT-13B, n or k = 2..6)",
                         ["method", "ours (this run)", "paper: Alpaca", "paper: ShareGPT"])
    for method in PAPER:
        ours = [100 * r["saving"] for r in runs if r["method"] == method]
        paper.add_row(method, f"{min(ours):.1f}-{max(ours):.1f}%" if ours else "-", PAPER[method]["Alpaca"],
                      PAPER[method]["ShareGPT"])
    paper.notes += ["ShareGPT has 8.4x longer prompts and 5.8x longer outputs than Alpaca on average (paper §6.1): "
                    "longer prompts mean more shared blocks per sample"]
    report.data["runs"] = runs
    report.data["block_size"] = cfg.block_size
    report.data["paper"] = PAPER
    return report
