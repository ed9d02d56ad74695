"""`spec_demo`: how often the target agrees with a proposer, by workload, and what that buys against plain decoding.

Workloads (common/prompts.py, SPEC_WORKLOADS): three that copy much of their
context into the answer (a code edit that rewrites a function, a summary that
quotes its source, output with repeated structure) and open chat. Every run is
greedy, so every engine must produce the plain engine's tokens (checked per run).

acceptance  per workload, a batch of its prompts, run plain and with each
            proposer: tokens proposed and kept, tokens a verification makes on
            average (1 .. k + 1), and target passes against plain decoding.
speed       per workload named in `speed_workloads` and per batch size, output
            tokens per second of plain decoding and of each proposer (prompts
            repeated to fill the batch; every request arrives at t = 0), as
            ratios to plain from the same run. Each engine kind is warmed up first.

On a CPU it runs in fp32 unless --dtype says otherwise: in bf16 a verification
pass (several rows of one sequence) and a decode pass round differently, so a
near-tie can flip a greedy token, and "outputs = plain" would test rounding.
"""

from __future__ import annotations

import torch

from common.clock import now
from common.prompts import SPEC_WORKLOADS
from measure.demos import Option, RunConfig, demo
from measure.harness import run_prompts
from measure.report import Report
from phases.p4_5_speculative_decoding.engine import DEFAULT_NUM_SPECULATIVE_TOKENS, SpeculativeEngine

PROPOSERS = ("ngram", "draft")
QUICK = dict(workloads=["code_edit", "chat"], speed_workloads=["code_edit"], batch_sizes=[1, 2],
             max_new_tokens=8, draft_layers=1)
WARMUP_PROMPTS, WARMUP_NEW_TOKENS = 2, 4


def _engine(lm, proposer: str | None, cfg: RunConfig, batch: int) -> SpeculativeEngine:
    layers = min(cfg.options["draft_layers"], lm.n_layers - 1)
    return SpeculativeEngine(lm, speculative=proposer, num_speculative_tokens=cfg.options["k"],
                             draft_layers=layers, max_running=max(batch, 1), n_blocks=cfg.options["n_blocks"],
                             prefix_caching=False)


def _run(lm, proposer: str | None, cfg: RunConfig, prompts: list, label: str,
         max_new_tokens: int | None = None) -> dict:
    engine = _engine(lm, proposer, cfg, len(prompts))
    t0, seqs = run_prompts(engine, prompts, max_new_tokens or cfg.options["max_new_tokens"], label)
    wall = now(lm.device) - t0
    n_tokens = sum(len(s.output_ids) for s in seqs)
    st = engine.spec_stats
    return dict(outputs=[s.output_ids for s in seqs], wall_s=wall, tok_s=n_tokens / wall, n_tokens=n_tokens,
                target_passes=engine.n_forward_passes, steps=engine.n_steps, proposed=st.proposed,
                accepted=st.accepted, acceptance=st.acceptance_rate, verified=st.n_verified,
                per_verify=st.emitted / st.n_verified if st.n_verified else float("nan"),
                draft_passes=engine.proposer.runner.n_forward_passes if proposer == "draft" else 0)


def plot_spec(report: Report, png_path) -> None:
    """Tokens per verification by workload; speed over plain decoding against batch size."""
    from measure import plots

    acc, speed = report.data["acceptance"], report.data["speed"]
    workloads = list(dict.fromkeys(r["workload"] for r in acc))
    per_verify = {p: [next(r["per_verify"] for r in acc if r["workload"] == w and r["proposer"] == p)
                      for w in workloads] for p in PROPOSERS}
    batches = sorted({r["batch"] for r in speed})
    ratios = {f"{p}, {w}": [next(r[f"{p}_ratio"] for r in speed if r["workload"] == w and r["batch"] == b)
                            for b in batches]
              for w in dict.fromkeys(r["workload"] for r in speed) for p in PROPOSERS}
    m = report.meta
    plots.draw_panels(png_path, [
        plots.bar_panel(workloads, per_verify, ylabel="tokens per verification (1 .. k + 1)",
                        title="what one target pass makes per sequence"),
        plots.line_panel(batches, ratios, xlabel="batch size", ylabel="tok/s over plain decoding", logx=True,
                         ticks_at_x=True, hlines={"plain decoding": 1.0}, title="speed against plain decoding"),
    ], title=f"speculative decoding ({m.get('model')}, {m.get('device_name')}, k = {report.data['k']})",
        panel_size=(5, 4))


@demo("spec_demo", phase="p4_5", plot=plot_spec,
      help="speculative decoding (n-gram, self-draft): acceptance by workload, speed vs plain at batch 1/8/64",
      options=[
          Option("workloads", str, cpu=list(SPEC_WORKLOADS), many=True, choices=tuple(SPEC_WORKLOADS),
                 help="workloads of the acceptance table"),
          Option("speed_workloads", str, cpu=["code_edit", "chat"], many=True, choices=tuple(SPEC_WORKLOADS),
                 help="workloads of the speed table"),
          Option("batch_sizes", int, cpu=[1, 8, 64], many=True, help="requests decoded together, speed table"),
          Option("max_new_tokens", int, cpu=64, gpu=256, help="tokens generated per request at most (greedy, EOS ends)"),
          Option("k", int, cpu=DEFAULT_NUM_SPECULATIVE_TOKENS, help="tokens proposed per sequence and step at most"),
          Option("draft_layers", int, cpu=22, gpu=22,
                 help="layers of the self-draft (the target's first ones, then its head; capped below the model's)"),
          Option("n_blocks", int, cpu=2048, gpu=8192, help="KV pool blocks of the target (the draft's pool: as many)"),
      ])
def spec_demo(cfg: RunConfig) -> Report:
    cfg.use_quick(**QUICK)
    fp32_default = cfg.dtype is None and not cfg.on_gpu
    if fp32_default:
        cfg.dtype = "fp32"     # so a verification pass and a decode pass round alike: greedy outputs stay equal
    lm = cfg.load()
    opts = cfg.options
    if opts["k"] < 1 or opts["max_new_tokens"] < 1 or min(opts["batch_sizes"]) < 1:
        raise ValueError("k, max_new_tokens and every batch size must be >= 1")
    report = cfg.new_report("spec_demo")
    if fp32_default:
        report.meta["dtype_reason"] = "spec_demo's default on a CPU, so verification and decode passes round alike"
    layers = min(opts["draft_layers"], lm.n_layers - 1)
    report.data.update(k=opts["k"], draft_layers=layers, n_layers=lm.n_layers, acceptance=[], speed=[])
    for proposer in (None,) + PROPOSERS:          # every engine kind's first passes pay one-off costs
        _run(lm, proposer, cfg, [SPEC_WORKLOADS["chat"][0]] * WARMUP_PROMPTS, f"warm-up {proposer or 'plain'}",
             WARMUP_NEW_TOKENS)

    acc = report.table(f"Acceptance by workload (k = {opts['k']}, greedy; draft = the first {layers} of "
                       f"{lm.n_layers} layers)",
                       ["workload", "proposer", "proposed", "accepted", "acceptance", "tokens / verification",
                        "target passes (plain -> spec)", "outputs = plain"])
    for name in opts["workloads"]:
        prompts = SPEC_WORKLOADS[name]
        plain = _run(lm, None, cfg, prompts, f"{name}: plain")
        for proposer in PROPOSERS:
            r = _run(lm, proposer, cfg, prompts, f"{name}: {proposer}")
            same = sum(a == b for a, b in zip(r["outputs"], plain["outputs"]))
            acc.add_row(name, proposer, r["proposed"], r["accepted"], _pct(r["acceptance"]),
                        _num(r["per_verify"]), f"{plain['target_passes']} -> {r['target_passes']}",
                        f"{same}/{len(prompts)}")
            report.data["acceptance"].append(dict(_public(r), workload=name, proposer=proposer,
                                                  plain_passes=plain["target_passes"], identical=same,
                                                  n=len(prompts)))

    speed = report.table("Speed against plain decoding (output tok/s; ratios from the same run)",
                         ["workload", "batch", "plain tok/s", "ngram tok/s", "ngram / plain", "draft tok/s",
                          "draft / plain", "ngram acceptance", "outputs = plain"])
    for name in opts["speed_workloads"]:
        for batch in opts["batch_sizes"]:
            prompts = [SPEC_WORKLOADS[name][i % len(SPEC_WORKLOADS[name])] for i in range(batch)]
            runs = {p: _run(lm, p, cfg, prompts, f"{name}, batch {batch}: {p or 'plain'}") for p in (None,) + PROPOSERS}
            plain = runs[None]
            same = min(sum(a == b for a, b in zip(runs[p]["outputs"], plain["outputs"])) for p in PROPOSERS)
            row = dict(workload=name, batch=batch, plain_tok_s=plain["tok_s"], identical=same)
            for p in PROPOSERS:
                row.update({f"{p}_tok_s": runs[p]["tok_s"], f"{p}_ratio": runs[p]["tok_s"] / plain["tok_s"],
                            f"{p}_acceptance": runs[p]["acceptance"], f"{p}_per_verify": runs[p]["per_verify"]})
            report.data["speed"].append(row)
            speed.add_row(name, batch, plain["tok_s"], runs["ngram"]["tok_s"], f"{row['ngram_ratio']:.2f}x",
                          runs["draft"]["tok_s"], f"{row['draft_ratio']:.2f}x", _pct(row["ngram_acceptance"]),
                          f"{same}/{batch}")
    threads = f"CPU threads: {torch.get_num_threads()}" if not cfg.on_gpu else f"GPU: {report.meta.get('device_name')}"
    acc.notes += [
        "acceptance = accepted / proposed; a verification makes its accepted tokens plus one of the target's own",
        "target passes: forward passes of the target model (the draft's own passes are not counted here)",
        f"each workload's {len(SPEC_WORKLOADS['chat'])} prompts run as one batch, greedy, up to "
        f"{opts['max_new_tokens']} new tokens (EOS ends a request)",
    ]
    speed.notes += [threads, "every request arrives at t = 0; prompts repeat to fill the batch; prefix caching off",
                    "outputs = plain: requests (of the batch) whose tokens equal plain decoding's, for both "
                    "proposers"]
    return report


def _public(r: dict) -> dict:
    return {k: v for k, v in r.items() if k != "outputs"}


def _pct(x: float) -> str:
    return "-" if x != x else f"{x:.0%}"


def _num(x: float) -> str:
    return "-" if x != x else f"{x:.2f}"
