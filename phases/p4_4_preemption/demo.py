"""`preempt_demo`, `stress_demo` and `rate_sweep`: a pool far too small for the traffic, and still no request lost.

preempt_demo  A burst of requests (mixed prompt and output lengths, all at t = 0) against a pool holding a
              fraction of what they would need at once: no preemption (an unlimited pool, the reference),
              then recomputation and swapping, outputs identical to the reference; then block sizes
              8..128 (the paper's Fig. 19) and what one recovery costs per block size.
stress_demo   A seeded random trace: bursts of plain requests and n seeded samples,
              overflowing the pool many times over, every promise of the scheduler checked as it runs.
rate_sweep    Poisson arrivals at rising rates: paged allocation against Orca's three reservations (reservation.py).
block_sweep   Poisson arrivals at one rate, block sizes 1..16, recomputing or swapping (the paper's Fig. 18b, 19b).
share_sweep   rate_sweep for n samples or k beams: paged, sharing, against Orca (Oracle), sharing nothing (Fig. 14).

The harness is in measure/ (it imports no phase; this file hands it this phase's engine line):
measure/preempt_bench.py (runs, tables, plot of preempt_demo), measure/recovery_bench.py (the
micro-benchmark), measure/stress_bench.py, measure/rate_bench.py (rate_sweep),
measure/block_rate_bench.py (block_sweep), measure/share_rate_bench.py (share_sweep). The traces (`burst`,
`stress_trace`) are measure/workload.py's step-timed traces, fed to the engine by measure/harness.py's
`drive`.

preempt_demo and stress_demo default to fp32 (unless --dtype): greedy outputs are then identical across
different batch compositions, so "identical to the unlimited pool" tests preemption and not bf16 rounding
(in bf16 even a run without any preemption can differ from another batch shape in a token or two).
"""

from __future__ import annotations

from measure.demos import RunConfig, demo
from measure.block_rate_bench import block_options, plot_block_sweep, run_block_sweep
from measure.preempt_bench import PreemptionLine, plot_preempt, preempt_options, run_preempt_demo
from measure.rate_bench import plot_rate_sweep, rate_options, run_rate_sweep
from measure.report import Report
from measure.share_rate_bench import plot_share_sweep, run_share_sweep, share_options
from measure.stress_bench import run_stress_demo, stress_options
from phases.p4_1_copy_on_write.engine import worst_case_blocks
from measure.preempt_checks import Audited, check_finished
from phases.p4_4_preemption.engine import PREEMPTION_MODES, PreemptingEngine
from phases.p4_2_beam_search.engine import BeamSearchEngine
from extras.p4_4_preemption.reservation import PAGED, RESERVATION_POLICIES, ReservingEngine, UnsharedReservingEngine
from phases.p4_4_preemption.swap import SwapSpace


class AuditedEngine(Audited, PreemptingEngine):
    """The engine the demos run (samples, prefix caching, preemption), every scheduling decision checked."""


# The plain engine warms up and runs the micro-benchmark (no audit inside its timings); the audited one runs
# every trace.
LINE = PreemptionLine(engine=PreemptingEngine, audited=AuditedEngine, swap_space=SwapSpace,
                      check_finished=check_finished, worst_case_blocks=worst_case_blocks, modes=PREEMPTION_MODES)


@demo("preempt_demo", phase="p4_4", options=preempt_options(), plot=plot_preempt,
      help="a burst against a small pool: preemption by recomputation vs swapping, and across block sizes")
def preempt_demo(cfg: RunConfig) -> Report:
    """The burst with an unlimited pool (the reference), then with preemption by recomputation and by swapping:
    preemptions, tokens recomputed, blocks and bytes moved, time spent recovering, throughput, every request
    completed, outputs identical to the reference. Then the same workload at block sizes 8..128, the pool
    always holding the same number of tokens (the paper's Fig. 19), and what one recovery costs per block size:
    swap out + in (batched, and one copy per block as vLLM v0 did) against one prefill pass (the paper's
    Fig. 19a micro-benchmark). The prefix cache is off by default (--prefix-caching 1 turns it on): a
    recomputation then recomputes every token, as in the paper."""
    return run_preempt_demo(cfg, LINE)


@demo("stress_demo", phase="p4_4", options=stress_options(),
      help="a seeded random trace (bursts, plain requests, samples) overflowing the pool many times; invariants checked")
def stress_demo(cfg: RunConfig) -> Report:
    """The seeded trace on the engine as it is served (prefix cache on), every promise of the scheduler checked
    while it runs (checks.py): FCFS, latest group preempted, whole groups, every sequence finished exactly once,
    no block leaked (GPU or CPU pool)."""
    return run_stress_demo(cfg, LINE)


def paged_engine(lm, context_limit: int, **engine_kwargs) -> PreemptingEngine:
    """vLLM's policy: the preempting engine as it is (no prefix cache: the sweep's random prompts share nothing)."""
    return PreemptingEngine(lm, prefix_caching=False, **engine_kwargs)


def reserving(policy: str):
    def make(lm, context_limit: int, **engine_kwargs) -> ReservingEngine:
        return ReservingEngine(lm, policy, context_limit=context_limit, **engine_kwargs)
    return make


# The paper's legend order: vLLM, then Orca from the best guess of a request's length to the worst.
RATE_ENGINES = {PAGED: paged_engine} | {p: reserving(p) for p in RESERVATION_POLICIES}


@demo("rate_sweep", phase="p4_4", options=rate_options(tuple(RATE_ENGINES)), plot=plot_rate_sweep,
      help="Poisson arrivals at rising rates: paged allocation vs Orca's Max / Pow2 / Oracle reservations")
def rate_sweep(cfg: RunConfig) -> Report:
    return run_rate_sweep(cfg, RATE_ENGINES)


def preempting(mode: str):
    def make(lm, context_limit: int, **engine_kwargs) -> PreemptingEngine:
        return PreemptingEngine(lm, preemption_mode=mode, prefix_caching=False, **engine_kwargs)
    return make


@demo("block_sweep", phase="p4_4", options=block_options(), plot=plot_block_sweep,
      help="Poisson arrivals at one rate, block sizes 1..16: recompute vs swap, ShareGPT- and Alpaca-like (Fig. 18b, 19b)")
def block_sweep(cfg: RunConfig) -> Report:
    """Paged allocation at one request rate across block sizes, the pool's size in tokens fixed, recovering by
    recomputation or by swapping, on ShareGPT-like and Alpaca-like lengths: normalized latency by block size."""
    return run_block_sweep(cfg, {mode: preempting(mode) for mode in PREEMPTION_MODES})


def add_samples(engine, prompt_ids, max_new_tokens, sampling, arrival, width: int):
    return engine.add_group(prompt_ids, max_new_tokens, sampling, ignore_eos=True, arrival=arrival, n=width)


def add_beams(engine, prompt_ids, max_new_tokens, sampling, arrival, width: int):
    return engine.add_beam_search(prompt_ids, max_new_tokens, beam_width=width, arrival=arrival)


def beam_engine(lm, context_limit: int, **engine_kwargs) -> BeamSearchEngine:
    """Phase 4.2's engine: beams share their history; it admits a search on its worst case, beams counted
    with their shared blocks once (it has no preemption)."""
    return BeamSearchEngine(lm, **engine_kwargs)


def unshared(lm, context_limit: int, **engine_kwargs) -> UnsharedReservingEngine:
    return UnsharedReservingEngine(lm, **engine_kwargs)


# Per kind of request, paged first: how each policy's engine is built, and how it queues one request.
SHARE_ENGINES = {"sampling": {PAGED: (paged_engine, add_samples), "Orca (Oracle)": (unshared, add_samples)},
                 "beam": {PAGED: (beam_engine, add_beams), "Orca (Oracle)": (unshared, add_beams)}}


@demo("share_sweep", phase="p4_4", options=share_options(), plot=plot_share_sweep,
      help="Poisson arrivals of n-sample and beam-search requests: paged sharing vs Orca (Oracle), Fig. 14")
def share_sweep(cfg: RunConfig) -> Report:
    """Parallel sampling (n = 2, 4, 6) and beam search (width 2, 4, 6) at rising rates: paged allocation, which
    shares the prompt among samples and the common history among beams, against Orca (Oracle), which reserves
    every sequence's own copy; normalized latency against rate, and the highest rate each sustains."""
    return run_share_sweep(cfg, SHARE_ENGINES)
