"""`preempt_demo` and `stress_demo`: a pool far too small for the traffic, and still no request lost.

preempt_demo  A burst of requests (mixed prompt and output lengths, all at
              t = 0) against a pool holding a fraction of what they would
              need at once. Run with an unlimited pool (the reference), then
              with preemption by recomputation and by swapping: preemptions,
              tokens recomputed, blocks and bytes moved, time spent recovering,
              throughput, every request completed, outputs identical to the
              reference. Then the same workload at block sizes 8..128, the pool
              always holding the same number of tokens (the paper's Fig. 19).
stress_demo   A seeded random trace: bursts of plain requests, n seeded
              samples and beam searches, overflowing the pool many times over.
              Every promise of the scheduler is checked while it runs
              (checks.py): FCFS, latest group preempted, whole groups, every
              sequence finished exactly once, no block leaked (GPU or CPU pool).

The traces (`burst`, `stress_trace`) are common/workload.py's step-timed
traces, fed to the engine by common/harness.py's `drive`.

preempt_demo runs the engine with its prefix cache off by default
(--prefix-caching 1 turns it on): a recomputation then recomputes every token,
as in the paper. stress_demo runs the engine as it is served, cache on.

Both default to fp32 (unless --dtype): greedy outputs are then identical
across different batch compositions, so "identical to the unlimited pool"
tests preemption and not bf16 rounding (in bf16 even a run without any
preemption can differ from another batch shape in a token or two).
"""

from __future__ import annotations

from common.bench import MB, cpu_threads, now
from common.demos import Option, RunConfig, demo
from common.harness import drive, outputs_of
from common.progress import progress_bar
from common.report import Report
from common.workload import burst, demand_tokens, stress_trace
from phases.p3_1_block_allocator.allocator import blocks_for
from phases.p4_1_copy_on_write.engine import worst_case_blocks
from phases.p4_4_preemption.checks import Audited, check_finished
from phases.p4_4_preemption.engine import PREEMPTION_MODES, PreemptingEngine
from phases.p4_4_preemption.swap import SwapSpace

DEMO_DTYPE = "fp32"
MAX_RUNNING = 256  # high enough that the pool, not the slot count, limits the batch
QUICK_PREEMPT = dict(n_requests=5, prompt_len=[4, 12], output_len=[3, 8], block_size=4, block_sizes=[4, 8],
                     micro_seqs=2, micro_len=8, reps=1)
QUICK_STRESS = dict(n_requests=8, prompt_len=[3, 10], output_len=[2, 6], burst_size=[2, 4], burst_gap=[1, 2],
                    block_size=4)
WARMUP_REQUESTS = 2
MICRO_SEED = 1
COLORS = {"swap": "tab:blue", "recompute": "tab:orange"}


class AuditedEngine(Audited, PreemptingEngine):
    """The engine the demos run (samples, beams, prefix caching, preemption), every scheduling decision checked."""


def _start(cfg: RunConfig, name: str, quick: dict):
    """What both demos do first: fp32 unless told otherwise, the quick options under `quick`, the model,
    an empty report (its meta says what ran), the options."""
    if cfg.dtype is None:
        cfg.dtype = DEMO_DTYPE
    cfg.use_quick(**quick)
    return cfg.load(), cfg.new_report(name), cfg.options


def _round_up(x: float, multiple: int) -> int:
    return blocks_for(int(x), multiple) * multiple


def _run(lm, trace, n_blocks: int, block_size: int, mode: str, label: str, prefix_caching: bool) -> dict:
    """Drive `trace` through a fresh audited engine; everything the tables need, JSON-ready."""
    engine = AuditedEngine(lm, preemption_mode=mode, block_size=block_size, n_blocks=n_blocks,
                           max_running=MAX_RUNNING, prefix_caching=prefix_caching)
    with progress_bar(label, total=sum(r.n for r in trace)) as bar:
        start = now(lm.device)
        groups = drive(engine, trace, on_step=lambda outs: bar.advance(sum(o.finished for o in outs)))
        wall = now(lm.device) - start
    generated = sum(s.timing.n_generated for g in groups for s in g.seqs)
    s = engine.summary()
    return dict(s, mode=mode, block_size=block_size, n_blocks=n_blocks, wall_s=wall, tok_s=generated / wall,
                generated=generated, completed=sum(g.done for g in groups), n_requests=len(groups),
                n_seqs=sum(len(g.seqs) for g in groups), problems=check_finished(engine, groups),
                outputs=outputs_of(groups), peak_blocks=engine.peak_blocks_used,
                most_preempted=max([engine.preempted_ids.count(g.request_id) for g in groups] or [0]),
                recovery_us_per_token=_us_per_token(s))


def _us_per_token(s: dict) -> float:
    """Recovery time per token of context brought back (swapped out and in, or recomputed)."""
    tokens = s["tokens_swapped_in"] + s["tokens_recomputed"]
    return s["recovery_s"] * 1e6 / tokens if tokens else float("nan")


def _completed(r: dict) -> str:
    ok = r["completed"] == r["n_requests"] and not r["problems"]
    return f"{r['completed']}/{r['n_requests']} " + ("✓" if ok else "✗")


def _same(r: dict, ref: dict) -> str:
    same = sum(a == b for a, b in zip(r["outputs"], ref["outputs"]))
    return f"{same}/{len(ref['outputs'])} " + ("✓" if same == len(ref["outputs"]) else "✗")


def _warm_up(lm, trace, block_size: int) -> None:
    """The first forward passes pay one-off costs; pay them on a throwaway engine."""
    few = trace[:WARMUP_REQUESTS]
    engine = PreemptingEngine(lm, block_size=block_size, n_blocks=sum(
        worst_case_blocks(r, r.n, block_size) for r in few))
    drive(engine, few)


# --- preempt_demo -----------------------------------------------------------------------
def recovery_microbench(lm, block_sizes: list[int], n_seqs: int, seq_len: int, reps: int) -> list[dict]:
    """What one recovery costs, per block size: the vLLM paper's Fig. 19(a) micro-benchmark.

    The same K/V (`n_seqs` sequences of `seq_len` tokens) brought back each way, at each block size:
    - swap, batched: `SwapSpace.swap_out` then `swap_in` of their blocks, one indexed copy per
      direction (what the engine does);
    - swap, per block: the same with one copy per block (`batched=False`), the way vLLM v0 issued one
      `cudaMemcpyAsync` per block: many small transfers, each paying a fixed cost, which is what made
      the paper's swapping slow at small block sizes;
    - recompute: one prefill pass over all those tokens (what a re-prefill after preemption costs),
      independent of the block size but for the attention's reads from the pool.
    Each number is the fastest of `reps` repetitions (the others wait on the neighbours of a shared machine).
    """
    prompts = [r.prompt_ids for r in burst(lm.vocab_size, n_seqs, (seq_len, seq_len), (1, 1), seed=MICRO_SEED)]
    rows = []
    for bs in block_sizes:
        n_blocks = n_seqs * blocks_for(seq_len + 1, bs)
        recompute = []
        for _ in range(reps):
            # prefix caching off: the pass computes every token, as a recomputation without cached blocks does
            engine = PreemptingEngine(lm, block_size=bs, n_blocks=n_blocks, watermark_blocks=0, prefix_caching=False)
            for p in prompts:
                engine.add(p, 2, ignore_eos=True)
            start = now(lm.device)
            engine.step()  # the prefill pass: all n_seqs x seq_len tokens' K/V computed and written
            recompute.append(now(lm.device) - start)
        tables = [s.kv for s in engine.running]
        row = dict(block_size=bs, n_blocks=len({b for t in tables for b in t.block_ids}), tokens=n_seqs * seq_len,
                   recompute_ms=min(recompute) * 1e3)
        for name, batched in (("swap_ms", True), ("swap_per_block_ms", False)):
            space = SwapSpace(engine.allocator, n_blocks, batched=batched)
            times = []
            for _ in range(reps):
                start = space.out.seconds + space.into.seconds
                space.swap_out(tables)
                space.swap_in(tables)
                times.append(space.out.seconds + space.into.seconds - start)
            row[name] = min(times) * 1e3
        rows.append(row)
    return rows


def plot_preempt(report: Report, png_path) -> None:
    """Left: the micro-benchmark's cost of one recovery; right: end-to-end throughput; both per block size."""
    from common import plots

    rows, micro = report.data["sweep"], report.data["micro"]
    sizes = sorted({r["block_size"] for r in rows})
    by_mode = {mode: {r["block_size"]: r for r in rows if r["mode"] == mode} for mode in PREEMPTION_MODES}
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
        plots.line_panel(sizes, {mode: [by_mode[mode][b]["tok_s"] for b in sizes] for mode in PREEMPTION_MODES},
                         xlabel="block size (tokens)", ylabel="total throughput (tok/s)",
                         title=f"end to end, pool of {report.data['pool_tokens']} tokens", logx=True, ticks_at_x=True,
                         styles={mode: dict(marker=marker, color=COLORS[mode])
                                 for mode, marker in zip(PREEMPTION_MODES, "so")},
                         hlines={"unlimited pool": report.data["unlimited"]["tok_s"]}, legend_fontsize=8),
    ], title=f"preempt_demo: {m.get('model')} on {m.get('device_name', m.get('device'))}, {m.get('dtype')}",
        panel_size=(5.5, 4.2))


@demo("preempt_demo", phase="p4_4",
      help="a burst against a small pool: preemption by recomputation vs swapping, and across block sizes",
      options=[Option("n_requests", int, cpu=12, gpu=256, help="requests, all arriving at t = 0"),
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
                      help="1: the engine's prefix cache on (a recomputation maps still-cached blocks back in)")],
      plot=plot_preempt)
def preempt_demo(cfg: RunConfig) -> Report:
    lm, report, o = _start(cfg, "preempt_demo", QUICK_PREEMPT)
    trace = burst(lm.vocab_size, o["n_requests"], tuple(o["prompt_len"]), tuple(o["output_len"]), o["seed"])
    sizes = sorted(set(o["block_sizes"]) | {o["block_size"]})
    demand = demand_tokens(trace)
    largest = max(len(r.prompt_ids) + r.max_new_tokens for r in trace)
    # The same pool, in tokens, at every block size (a multiple of the largest block size).
    pool_tokens = max(_round_up(demand * o["pool_fraction"], max(sizes)), _round_up(largest, max(sizes)))

    def unlimited_blocks(bs: int) -> int:
        return sum(blocks_for(len(r.prompt_ids) + r.max_new_tokens, bs) for r in trace)

    caching = bool(o["prefix_caching"])
    results: dict[tuple[int, str], dict] = {}
    with cpu_threads(o["threads"]):
        _warm_up(lm, trace, o["block_size"])
        ref = _run(lm, trace, unlimited_blocks(o["block_size"]), o["block_size"], "recompute", "unlimited pool",
                   caching)
        for bs in [o["block_size"]] + [b for b in sizes if b != o["block_size"]]:
            for mode in PREEMPTION_MODES:
                results[bs, mode] = _run(lm, trace, pool_tokens // bs, bs, mode, f"block size {bs}, {mode}", caching)
        with progress_bar("micro-benchmark", total=None):
            micro = recovery_microbench(lm, sizes, o["micro_seqs"], o["micro_len"], o["reps"])

    bs = o["block_size"]
    main = report.table(
        f"{len(trace)} requests at once into a pool of {pool_tokens // bs} blocks x {bs} tokens "
        f"({pool_tokens} tokens, {pool_tokens / demand:.0%} of the burst's {demand})",
        ["recovery", "preemptions", "groups recomputed", "tokens recomputed", "blocks out / in", "MB moved",
         "recovery (s)", "wall (s)", "total tok/s", "completed", "= unlimited"])
    main.add_row("unlimited pool", ref["n_preemptions"], "-", "-", "-", "-", "-", ref["wall_s"], ref["tok_s"],
                 _completed(ref), "reference")
    for mode in PREEMPTION_MODES:
        r = results[bs, mode]
        main.add_row(mode, r["n_preemptions"], r["n_recomputed"], r["tokens_recomputed"],
                     f"{r['blocks_swapped_out']} / {r['blocks_swapped_in']}",
                     round((r["bytes_swapped_out"] + r["bytes_swapped_in"]) / MB, 2), r["recovery_s"], r["wall_s"],
                     r["tok_s"], _completed(r), _same(r, ref))
    main.notes += [
        f"prompts {o['prompt_len'][0]}-{o['prompt_len'][1]} tokens, outputs {o['output_len'][0]}-"
        f"{o['output_len'][1]} (random token ids, EOS ignored, greedy); unlimited pool: "
        f"{unlimited_blocks(bs)} blocks, peak use {ref['peak_blocks']}",
        "recovery: swap = the indexed copies out and back in; recompute = each re-prefill pass's time x the "
        "share of its tokens that were recomputed",
        "completed: every request done, every sequence finished once, FCFS and latest-first preemption held, "
        "no block leaked (GPU and CPU pools)",
        "prefix cache " + ("on: a recomputation maps the blocks still cached back in" if caching else
                           "off: a recomputation recomputes every token, as in the paper"),
        f"CPU threads: {o['threads'] or 'torch default'}" if not cfg.on_gpu else f"GPU: {report.meta.get('device_name')}",
    ]
    sweep = report.table(f"Block size sweep: the same burst, the pool always {pool_tokens} tokens",
                         ["block size", "blocks", "recovery", "preemptions", "tokens recomputed", "blocks moved",
                          "MB moved", "recovery (ms)", "µs / token back", "total tok/s", "completed",
                          "= unlimited"])
    for b in sizes:
        for mode in PREEMPTION_MODES:
            r = results[b, mode]
            sweep.add_row(b, r["n_blocks"], mode, r["n_preemptions"], r["tokens_recomputed"],
                          r["blocks_swapped_out"] + r["blocks_swapped_in"],
                          round((r["bytes_swapped_out"] + r["bytes_swapped_in"]) / MB, 2), r["recovery_s"] * 1e3,
                          r["recovery_us_per_token"], r["tok_s"], _completed(r), _same(r, ref))
    sweep.notes += [
        "µs / token back: recovery time / tokens of context recovered (swapped back in, or recomputed)",
        "larger blocks, same pool: fewer blocks, more of each left empty, fewer requests fit at once, so the "
        "pool runs dry less often (fewer preemptions) but the batch is smaller",
    ]
    mt = report.table(f"Micro-benchmark: bringing back {o['micro_seqs']} x {o['micro_len']} tokens of K/V "
                      f"({micro[0]['tokens']} tokens), fastest of {o['reps']}",
                      ["block size", "blocks", "swap out + in (ms)", "same, one copy per block (ms)",
                       "recompute (ms)", "recompute / swap"])
    for m in micro:
        mt.add_row(m["block_size"], m["n_blocks"], m["swap_ms"], m["swap_per_block_ms"], m["recompute_ms"],
                   f"{m['recompute_ms'] / m['swap_ms']:.0f}x")
    mt.notes += [
        "swap: SwapSpace.swap_out then swap_in (one indexed copy per direction); one copy per block is the "
        "vLLM v0 way (a cudaMemcpyAsync per block), whose fixed cost per copy grows with the number of blocks",
        "recompute: one prefill pass over the same tokens (what a re-prefill after preemption costs)",
    ]
    strip = ("outputs",)
    report.data.update(unlimited={k: v for k, v in ref.items() if k not in strip}, pool_tokens=pool_tokens,
                       demand_tokens=demand, micro=micro,
                       sweep=[{k: v for k, v in r.items() if k not in strip} for r in results.values()])
    return report


# --- stress_demo ---------------------------------------------------------------------------
@demo("stress_demo", phase="p4_4",
      help="a seeded random trace (bursts, samples, beams) overflowing the pool many times; invariants checked",
      options=[Option("n_requests", int, cpu=32, gpu=1000, help="requests in the trace"),
               Option("prompt_len", int, cpu=[4, 24], gpu=[32, 512], many=True, help="min and max prompt tokens"),
               Option("output_len", int, cpu=[8, 32], gpu=[16, 256], many=True, help="min and max new tokens"),
               Option("burst_size", int, cpu=[4, 12], gpu=[16, 64], many=True, help="min and max requests per burst"),
               Option("burst_gap", int, cpu=[1, 6], gpu=[1, 8], many=True, help="min and max steps between bursts"),
               Option("p_samples", float, cpu=0.2, help="share of requests asking for n seeded samples"),
               Option("p_beam", float, cpu=0.15, help="share of requests that are beam searches"),
               Option("max_n", int, cpu=3, gpu=4, help="most samples / beams in one request"),
               Option("pool_fraction", float, cpu=0.1, gpu=0.1,
                      help="pool size, as a fraction of the KV the whole trace would hold at once"),
               Option("block_size", int, cpu=8, gpu=16, help="tokens per KV block"),
               Option("threads", int, cpu=1, gpu=0,
                      help="CPU intra-op threads (0: torch's default); 1 is steadier on a shared CPU"),
               Option("seed", int, cpu=0, help="trace seed"),
               Option("prefix_caching", int, cpu=1, help="0: the engine's prefix cache off")])
def stress_demo(cfg: RunConfig) -> Report:
    lm, report, o = _start(cfg, "stress_demo", QUICK_STRESS)
    trace = stress_trace(lm.vocab_size, o["n_requests"], tuple(o["prompt_len"]), tuple(o["output_len"]),
                         tuple(o["burst_size"]), tuple(o["burst_gap"]), o["p_samples"], o["p_beam"], o["max_n"],
                         o["seed"])
    bs = o["block_size"]
    demand = demand_tokens(trace)
    alone = max(worst_case_blocks(r, r.n, bs) for r in trace)
    n_blocks = max(blocks_for(int(demand * o["pool_fraction"]), bs), alone)  # every request fits alone
    caching = bool(o["prefix_caching"])
    with cpu_threads(o["threads"]):
        _warm_up(lm, trace, bs)
        unlimited = sum(worst_case_blocks(r, r.n, bs) for r in trace)
        ref = _run(lm, trace, unlimited, bs, "recompute", "unlimited pool", caching)
        runs = [_run(lm, trace, n_blocks, bs, mode, mode, caching) for mode in PREEMPTION_MODES]

    kinds = {k: sum(r.kind == k for r in trace) for k in ("plain", "samples", "beam")}
    t = report.table(
        f"Stress: {len(trace)} requests ({kinds['plain']} plain, {kinds['samples']} with n samples, "
        f"{kinds['beam']} beam searches) in bursts, a pool of {n_blocks} blocks x {bs} tokens "
        f"({demand / (n_blocks * bs):.1f}x oversubscribed)",
        ["recovery", "sequences", "preemptions", "swapped out / in", "recomputed", "swap fallbacks",
         "most preempted", "completed", "invariants", "= unlimited", "wall (s)"])
    for r in [ref] + runs:
        t.add_row("unlimited pool" if r is ref else r["mode"], r["n_seqs"], r["n_preemptions"],
                  f"{r['n_swapped_out']} / {r['n_swapped_in']}", r["n_recomputed"], r["n_swap_fallbacks"],
                  r["most_preempted"], _completed(r),
                  "held ✓" if not r["problems"] else f"{len(r['problems'])} broken ✗",
                  "reference" if r is ref else _same(r, ref), r["wall_s"])
    for r in runs:
        t.notes += [f"{r['mode']}: {p}" for p in r["problems"][:5]]
    t.notes += [
        f"trace seed {o['seed']}: prompts {o['prompt_len'][0]}-{o['prompt_len'][1]}, outputs "
        f"{o['output_len'][0]}-{o['output_len'][1]} tokens, bursts of {o['burst_size'][0]}-{o['burst_size'][1]} "
        f"requests every {o['burst_gap'][0]}-{o['burst_gap'][1]} steps; samples at temperature 0.8, seeded",
        "most preempted: preemptions of the single most preempted request",
        "invariants: FCFS admission and swap-in, latest-arrived group preempted, whole groups only, every "
        "sequence finished exactly once, no block leaked in the GPU or the CPU pool",
        "= unlimited: greedy outputs, seeded samples and beam search results identical to the unlimited pool's",
        f"prefix cache {'on' if caching else 'off'}",
        f"CPU threads: {o['threads'] or 'torch default'}" if not cfg.on_gpu else f"GPU: {report.meta.get('device_name')}",
    ]
    report.data.update(demand_tokens=demand, n_blocks=n_blocks, kinds=kinds,
                       runs=[{k: v for k, v in r.items() if k != "outputs"} for r in [ref] + runs])
    return report
