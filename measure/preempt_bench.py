"""The harness of `preempt_demo`: a burst against a small pool, recompute vs swap, across block sizes.

A phase's demo hands in its engine line (measure/ imports no phase):

    run_preempt_demo(cfg, PreemptionLine(engine=PreemptingEngine, audited=AuditedEngine, swap_space=SwapSpace,
                                         check_finished=check_finished, worst_case_blocks=worst_case_blocks,
                                         modes=PREEMPTION_MODES))

  engine             engine(lm, block_size=, n_blocks=, preemption_mode=, max_running=, prefix_caching=,
                     watermark_blocks=): a preempting engine with the engine line's `add`, `add_group`,
                     `step`, `has_work`, `running`, `allocator`, `summary()`,
                     `peak_blocks_used` and `preempted_ids`
  audited            the same engine, every scheduling decision checked as it is made
  swap_space         swap_space(gpu_allocator, n_blocks, batched=): the CPU pool, `swap_out` / `swap_in`
  check_finished     check_finished(engine, groups) -> problems once a run is over ([]: all is well)
  worst_case_blocks  worst_case_blocks(request, n, block_size): the most blocks its n sequences hold at once
  modes              the preemption modes, in table order

A trace (measure/workload.py) runs through a fresh audited engine (`run_trace`, fed by
measure/harness.py's `drive`): once with an unlimited pool (the reference), then per mode and block
size with a pool of the same number of tokens; then what one recovery costs (measure/recovery_bench.py).
The engine counts the tokens it recomputes; their time is measured here, around its steps (`timing_recomputation`).
`run_trace` and the cells are shared with `stress_demo` (measure/stress_bench.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from common.clock import now
from measure.bench import MB, ceil_div, cpu_threads
from measure.demos import Option, RunConfig
from measure.harness import drive, outputs_of
from measure.progress import progress_bar
from measure.recovery_bench import recovery_microbench, recovery_table
from measure.report import Report
from measure.workload import burst, demand_tokens

# Both demos default to fp32: greedy outputs are then identical across batch compositions, so "identical to
# the unlimited pool" tests preemption, not bf16 rounding (in bf16 two batch shapes can flip a token).
DEMO_DTYPE = "fp32"
MAX_RUNNING = 256  # high enough that the pool, not the slot count, limits the batch
QUICK = dict(n_requests=5, prompt_len=[4, 12], output_len=[3, 8], block_size=4, block_sizes=[4, 8],
             micro_seqs=2, micro_len=8, reps=1)
WARMUP_REQUESTS = 2
COLORS = {"swap": "tab:blue", "recompute": "tab:orange"}


@dataclass
class PreemptionLine:
    """What the demos need of phase 4.4 (see the module docstring)."""
    engine: Callable
    audited: Callable
    swap_space: Callable
    check_finished: Callable
    worst_case_blocks: Callable
    modes: tuple[str, ...]


def start(cfg: RunConfig, name: str, quick: dict):
    """What both demos do first: fp32 unless told otherwise, the quick options under `quick`, the model,
    an empty report (its meta says what ran), the options."""
    if cfg.dtype is None:
        cfg.dtype = DEMO_DTYPE
    cfg.use_quick(**quick)
    return cfg.load(), cfg.new_report(name), cfg.options


def timing_recomputation(engine_class):
    """`engine_class` with a clock around each step: a step that recomputed tokens (the engine counts them in
    `stats.tokens_recomputed`) adds its time x their share of its prefill tokens to `recompute_s`."""

    class Timed(engine_class):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.recompute_s = 0.0

        def step(self):
            recomputed, prefilled, t0 = self.stats.tokens_recomputed, self.n_prefill_tokens, now(self.lm.device)
            outputs = super().step()
            recomputed = self.stats.tokens_recomputed - recomputed
            if recomputed:
                share = recomputed / max(recomputed, self.n_prefill_tokens - prefilled)
                self.recompute_s += (now(self.lm.device) - t0) * share
            return outputs

    return Timed


def run_trace(lm, line: PreemptionLine, trace, n_blocks: int, block_size: int, mode: str, label: str,
              prefix_caching: bool) -> dict:
    """Drive `trace` through a fresh audited engine; everything the tables need, JSON-ready."""
    engine = timing_recomputation(line.audited)(lm, preemption_mode=mode, block_size=block_size, n_blocks=n_blocks,
                                                max_running=MAX_RUNNING, prefix_caching=prefix_caching)
    with progress_bar(label, total=sum(r.n for r in trace)) as bar:
        t0 = now(lm.device)
        groups = drive(engine, trace, on_step=lambda outs: bar.advance(sum(o.finished for o in outs)))
        wall = now(lm.device) - t0
    generated = sum(s.timing.n_generated for g in groups for s in g.seqs)
    s = dict(engine.summary(), recompute_s=engine.recompute_s)
    s["recovery_s"] = s["swap_s"] + s["recompute_s"]    # swap copies both ways, and recomputation
    return dict(s, mode=mode, block_size=block_size, n_blocks=n_blocks, wall_s=wall, tok_s=generated / wall,
                generated=generated, completed=sum(g.done for g in groups), n_requests=len(groups),
                n_seqs=sum(len(g.seqs) for g in groups), problems=line.check_finished(engine, groups),
                outputs=outputs_of(groups), peak_blocks=engine.peak_blocks_used,
                most_preempted=max([engine.preempted_ids.count(g.request_id) for g in groups] or [0]),
                recovery_us_per_token=us_per_token(s))


def us_per_token(s: dict) -> float:
    """Recovery time per token of context brought back (swapped out and in, or recomputed)."""
    tokens = s["tokens_swapped_in"] + s["tokens_recomputed"]
    return s["recovery_s"] * 1e6 / tokens if tokens else float("nan")


def completed(r: dict) -> str:
    ok = r["completed"] == r["n_requests"] and not r["problems"]
    return f"{r['completed']}/{r['n_requests']} " + ("✓" if ok else "✗")


def same(r: dict, ref: dict) -> str:
    n_same = sum(a == b for a, b in zip(r["outputs"], ref["outputs"]))
    return f"{n_same}/{len(ref['outputs'])} " + ("✓" if n_same == len(ref["outputs"]) else "✗")


def without_outputs(r: dict) -> dict:
    return {k: v for k, v in r.items() if k != "outputs"}


def threads_note(cfg: RunConfig, o: dict, report: Report) -> str:
    return f"CPU threads: {o['threads'] or 'torch default'}" if not cfg.on_gpu else \
        f"GPU: {report.meta.get('device_name')}"


def warm_up(lm, line: PreemptionLine, trace, block_size: int) -> None:
    """The first forward passes pay one-off costs; pay them on a throwaway engine."""
    few = trace[:WARMUP_REQUESTS]
    engine = line.engine(lm, block_size=block_size, n_blocks=sum(
        line.worst_case_blocks(r, r.n, block_size) for r in few))
    drive(engine, few)


def preempt_options() -> list[Option]:
    return [Option("n_requests", int, cpu=12, gpu=256, help="requests, all arriving at t = 0"),
            Option("prompt_len", int, cpu=[8, 48], gpu=[64, 1024], many=True, help="min and max prompt tokens"),
            Option("output_len", int, cpu=[16, 40], gpu=[64, 512], many=True,
                   help="min and max new tokens (EOS ignored)"),
            Option("pool_fraction", float, cpu=0.4, gpu=0.25,
                   help="pool size, as a fraction of the KV the burst would hold if all ran at once"),
            Option("block_size", int, cpu=16, help="block size of the recompute vs swap table"),
            Option("block_sizes", int, cpu=[8, 16, 32, 64, 128], many=True, help="block sizes of the sweep"),
            Option("threads", int, cpu=1, gpu=0,
                   help="CPU intra-op threads (0: torch's default); 1 is steadier on a shared CPU"),
            Option("micro_seqs", int, cpu=4, gpu=32, help="micro-benchmark: sequences recovered at once"),
            Option("micro_len", int, cpu=128, gpu=1024, help="micro-benchmark: tokens per sequence"),
            Option("reps", int, cpu=3, help="micro-benchmark: repetitions (the fastest is kept)"),
            Option("seed", int, cpu=0, help="workload seed"),
            Option("prefix_caching", int, cpu=0,
                   help="1: the engine's prefix cache on (a recomputation maps still-cached blocks back in)")]


def run_preempt_demo(cfg: RunConfig, line: PreemptionLine) -> Report:
    lm, report, o = start(cfg, "preempt_demo", QUICK)
    trace = burst(lm.vocab_size, o["n_requests"], tuple(o["prompt_len"]), tuple(o["output_len"]), o["seed"])
    sizes = sorted(set(o["block_sizes"]) | {o["block_size"]})
    demand = demand_tokens(trace)
    largest = max(len(r.prompt_ids) + r.max_new_tokens for r in trace)
    # The same pool, in tokens, at every block size: a multiple of the largest block size.
    top = max(sizes)
    pool_tokens = top * max(ceil_div(int(demand * o["pool_fraction"]), top), ceil_div(largest, top))

    def unlimited_blocks(bs: int) -> int:
        return sum(ceil_div(len(r.prompt_ids) + r.max_new_tokens, bs) for r in trace)

    caching = bool(o["prefix_caching"])
    results: dict[tuple[int, str], dict] = {}
    with cpu_threads(o["threads"]):
        warm_up(lm, line, trace, o["block_size"])
        # An unlimited pool never preempts, so its mode does not matter: recompute needs no CPU pool.
        ref = run_trace(lm, line, trace, unlimited_blocks(o["block_size"]), o["block_size"], "recompute",
                        "unlimited pool", caching)
        for bs in [o["block_size"]] + [b for b in sizes if b != o["block_size"]]:
            for mode in line.modes:
                results[bs, mode] = run_trace(lm, line, trace, pool_tokens // bs, bs, mode,
                                              f"block size {bs}, {mode}", caching)
        with progress_bar("micro-benchmark", total=None):
            micro = recovery_microbench(lm, line.engine, line.swap_space, sizes, o["micro_seqs"], o["micro_len"],
                                        o["reps"])

    bs = o["block_size"]
    main = report.table(
        f"{len(trace)} requests at once into a pool of {pool_tokens // bs} blocks x {bs} tokens "
        f"({pool_tokens} tokens, {pool_tokens / demand:.0%} of the burst's {demand})",
        ["recovery", "preemptions", "groups recomputed", "tokens recomputed", "blocks out / in", "MB moved",
         "recovery (s)", "wall (s)", "total tok/s", "completed", "= unlimited"])
    main.add_row("unlimited pool", ref["n_preemptions"], "-", "-", "-", "-", "-", ref["wall_s"], ref["tok_s"],
                 completed(ref), "reference")
    for mode in line.modes:
        r = results[bs, mode]
        main.add_row(mode, r["n_preemptions"], r["n_recomputed"], r["tokens_recomputed"],
                     f"{r['blocks_swapped_out']} / {r['blocks_swapped_in']}",
                     round((r["bytes_swapped_out"] + r["bytes_swapped_in"]) / MB, 2), r["recovery_s"], r["wall_s"],
                     r["tok_s"], completed(r), same(r, ref))
    main.notes += [
        f"prompts {o['prompt_len'][0]}-{o['prompt_len'][1]} tokens, outputs {o['output_len'][0]}-"
        f"{o['output_len'][1]} (random token ids, EOS ignored, greedy); unlimited pool: "
        f"{unlimited_blocks(bs)} blocks, peak use {ref['peak_blocks']}",
        "recovery: swap = the indexed copies out and back in; recompute = each step's time x the share of its "
        "prefill tokens that were recomputed (measured around the engine's steps)",
        "completed: every request done, every sequence finished once, FCFS and latest-first preemption held, "
        "no block leaked (GPU and CPU pools)",
        "prefix cache " + ("on: a recomputation maps the blocks still cached back in" if caching else
                           "off: a recomputation recomputes every token, as in the paper"),
        threads_note(cfg, o, report),
    ]
    sweep = report.table(f"Block size sweep: the same burst, the pool always {pool_tokens} tokens",
                         ["block size", "blocks", "recovery", "preemptions", "tokens recomputed", "blocks moved",
                          "MB moved", "recovery (ms)", "µs / token back", "total tok/s", "completed",
                          "= unlimited"])
    for b in sizes:
        for mode in line.modes:
            r = results[b, mode]
            sweep.add_row(b, r["n_blocks"], mode, r["n_preemptions"], r["tokens_recomputed"],
                          r["blocks_swapped_out"] + r["blocks_swapped_in"],
                          round((r["bytes_swapped_out"] + r["bytes_swapped_in"]) / MB, 2), r["recovery_s"] * 1e3,
                          r["recovery_us_per_token"], r["tok_s"], completed(r), same(r, ref))
    sweep.notes += [
        "µs / token back: recovery time / tokens of context recovered (swapped back in, or recomputed)",
        "larger blocks, same pool: fewer blocks, more of each left empty, fewer requests fit at once, so the "
        "pool runs dry less often (fewer preemptions) but the batch is smaller",
    ]
    recovery_table(report, micro, o["micro_seqs"], o["micro_len"], o["reps"])
    report.data.update(unlimited=without_outputs(ref), pool_tokens=pool_tokens, demand_tokens=demand, micro=micro,
                       sweep=[without_outputs(r) for r in results.values()])
    return report


def plot_preempt(report: Report, png_path) -> None:
    """Left: the micro-benchmark's cost of one recovery; right: end-to-end throughput; both per block size."""
    from measure import plots

    rows, micro = report.data["sweep"], report.data["micro"]
    sizes = sorted({r["block_size"] for r in rows})
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    by_mode = {mode: {r["block_size"]: r for r in rows if r["mode"] == mode} for mode in modes}
    swap, per_block, recompute = ("swap out + in, one indexed copy each way", "swap, one copy per block",
                                  "recompute (one prefill pass)")
    m = report.meta
    plots.draw_panels(png_path, [
        plots.line_panel([r["block_size"] for r in micro],
                         {swap: [r["swap_ms"] for r in micro], per_block: [r["swap_per_block_ms"] for r in micro],
                          recompute: [r["recompute_ms"] for r in micro]},
                         xlabel="block size (tokens)", ylabel=f"ms to bring back {micro[0]['tokens']} tokens",
                         title="cost of one recovery (micro-benchmark)", logx=True, ticks_at_x=True, logy=True,
                         styles={swap: dict(color=COLORS["swap"]),
                                 per_block: dict(marker="^", ls="--", color=COLORS["swap"]),
                                 recompute: dict(marker="s", color=COLORS["recompute"])}, legend_fontsize=8),
        plots.line_panel(sizes, {mode: [by_mode[mode][b]["tok_s"] for b in sizes] for mode in modes},
                         xlabel="block size (tokens)", ylabel="total throughput (tok/s)",
                         title=f"end to end, pool of {report.data['pool_tokens']} tokens", logx=True, ticks_at_x=True,
                         styles={mode: dict(marker=marker, color=COLORS[mode]) for mode, marker in zip(modes, "so")},
                         hlines={"unlimited pool": report.data["unlimited"]["tok_s"]}, legend_fontsize=8),
    ], title=f"preempt_demo: {m.get('model')} on {m.get('device_name', m.get('device'))}, {m.get('dtype')}",
        panel_size=(5.5, 4.2))
