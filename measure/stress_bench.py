"""The harness of `stress_demo`: a seeded random trace overflowing the pool many times over, every promise checked.

    run_stress_demo(cfg, line)    # line: a PreemptionLine (measure/preempt_bench.py), built by the phase's demo

Bursts of plain requests and n seeded samples (measure/workload.py's `stress_trace`)
run through the audited engine with an unlimited pool (the reference), then with a small one per
preemption mode; the audit (FCFS, latest group preempted, whole groups) runs while it steps, and
`check_finished` after (every sequence finished exactly once, no block leaked in either pool).
"""

from __future__ import annotations

from measure.bench import ceil_div, cpu_threads
from measure.demos import Option, RunConfig
from measure.preempt_bench import (PreemptionLine, completed, run_trace, same, start, threads_note, warm_up,
                                  without_outputs)
from measure.report import Report
from measure.workload import TRACE_SAMPLE_TEMPERATURE, demand_tokens, stress_trace

QUICK = dict(n_requests=8, prompt_len=[3, 10], output_len=[4, 12], burst_size=[2, 4], burst_gap=[1, 2], block_size=4)


def stress_options() -> list[Option]:
    return [Option("n_requests", int, cpu=32, gpu=1000, help="requests in the trace"),
            Option("prompt_len", int, cpu=[4, 24], gpu=[32, 512], many=True, help="min and max prompt tokens"),
            Option("output_len", int, cpu=[8, 32], gpu=[16, 256], many=True, help="min and max new tokens"),
            Option("burst_size", int, cpu=[4, 12], gpu=[16, 64], many=True, help="min and max requests per burst"),
            Option("burst_gap", int, cpu=[1, 6], gpu=[1, 8], many=True, help="min and max steps between bursts"),
            Option("p_samples", float, cpu=0.2, help="share of requests asking for n seeded samples"),
            Option("max_n", int, cpu=3, gpu=4, help="most samples in one request"),
            Option("pool_fraction", float, cpu=0.1, gpu=0.1,
                   help="pool size, as a fraction of the KV the whole trace would hold at once"),
            Option("block_size", int, cpu=8, gpu=16, help="tokens per KV block"),
            Option("threads", int, cpu=1, gpu=0,
                   help="CPU intra-op threads (0: torch's default); 1 is steadier on a shared CPU"),
            Option("seed", int, cpu=0, help="trace seed"),
            Option("prefix_caching", int, cpu=1, help="0: the engine's prefix cache off")]


def run_stress_demo(cfg: RunConfig, line: PreemptionLine) -> Report:
    lm, report, o = start(cfg, "stress_demo", QUICK)
    trace = stress_trace(lm.vocab_size, o["n_requests"], tuple(o["prompt_len"]), tuple(o["output_len"]),
                         tuple(o["burst_size"]), tuple(o["burst_gap"]), o["p_samples"], 0.0, o["max_n"],
                         o["seed"])
    bs = o["block_size"]
    demand = demand_tokens(trace)
    alone = max(line.worst_case_blocks(r, r.n, bs) for r in trace)
    n_blocks = max(ceil_div(int(demand * o["pool_fraction"]), bs), alone)  # every request fits alone
    caching = bool(o["prefix_caching"])
    with cpu_threads(o["threads"]):
        warm_up(lm, line, trace, bs)
        unlimited = sum(line.worst_case_blocks(r, r.n, bs) for r in trace)
        ref = run_trace(lm, line, trace, unlimited, bs, "recompute", "unlimited pool", caching)
        runs = [run_trace(lm, line, trace, n_blocks, bs, mode, mode, caching) for mode in line.modes]

    kinds = {k: sum(r.kind == k for r in trace) for k in ("plain", "samples")}
    t = report.table(
        f"Stress: {len(trace)} requests ({kinds['plain']} plain, {kinds['samples']} with n samples) in bursts, "
        f"a pool of {n_blocks} blocks x {bs} tokens "
        f"({demand / (n_blocks * bs):.1f}x oversubscribed)",
        ["recovery", "sequences", "preemptions", "swapped out / in", "recomputed", "swap fallbacks",
         "most preempted", "completed", "invariants", "= unlimited", "wall (s)"])
    for r in [ref] + runs:
        t.add_row("unlimited pool" if r is ref else r["mode"], r["n_seqs"], r["n_preemptions"],
                  f"{r['n_swapped_out']} / {r['n_swapped_in']}", r["n_recomputed"], r["n_swap_fallbacks"],
                  r["most_preempted"], completed(r),
                  "held ✓" if not r["problems"] else f"{len(r['problems'])} broken ✗",
                  "reference" if r is ref else same(r, ref), r["wall_s"])
    for r in runs:
        t.notes += [f"{r['mode']}: {p}" for p in r["problems"][:5]]
    t.notes += [
        f"trace seed {o['seed']}: prompts {o['prompt_len'][0]}-{o['prompt_len'][1]}, outputs "
        f"{o['output_len'][0]}-{o['output_len'][1]} tokens, bursts of {o['burst_size'][0]}-{o['burst_size'][1]} "
        f"requests every {o['burst_gap'][0]}-{o['burst_gap'][1]} steps; samples at temperature "
        f"{TRACE_SAMPLE_TEMPERATURE:g}, seeded",
        "most preempted: preemptions of the single most preempted request",
        "invariants: FCFS admission and swap-in, latest-arrived group preempted, whole groups only, every "
        "sequence finished exactly once, no block leaked in the GPU or the CPU pool",
        "= unlimited: greedy outputs and seeded samples identical to the unlimited pool's",
        f"prefix cache {'on' if caching else 'off'}",
        threads_note(cfg, o, report),
    ]
    report.data.update(demand_tokens=demand, n_blocks=n_blocks, kinds=kinds,
                       runs=[without_outputs(r) for r in [ref] + runs])
    return report
