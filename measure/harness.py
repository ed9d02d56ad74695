"""The engine-comparison harness: any engine, the same requests, one row of numbers each.

An engine enters as an `EngineRunner(name, label, run)`; measure/ never imports a phase, a phase's demo
builds its engine and hands it over. `run(lm, requests, max_running) -> EngineRun` serves every request
(all arriving at once), at most `max_running` sequences together, and returns each request's new tokens
and timing, the most KV bytes held at once, and the settings that reproduce the row.

`measure(lm, runner, requests, max_running)` warms the engine up on the workload's own shapes (`warm_up`),
then times one run and returns a row dict. `pick_engines` chooses engines by name (the demos'
`--engines`). The batch-size sweep built on this is measure/tput.py.

Helpers for the phases' runners, written against the engines' shared shape (`add(prompt, max_new_tokens,
...)`, `run(progress)`, `running`, `step()`, `has_work`; `add_group` and `add_beam_search` from phase 4):

- `PeakKV` (the most KV bytes held at once), `submit` (queue requests), `run_prompts` (queue prompts with
  one arrival time, run under a progress bar), `workload_pool_blocks` (a pool that never makes anyone
  wait), `pool_problems` (a pool's invariants and leaks);
- for the step-timed traces of measure/workload.py: `drive` (feed a trace to an engine step by step, as a
  server's engine loop would) and `outputs_of` (each request's tokens); for a trace timed in seconds
  (`Request.arrival_s`), `drive_timed` does the same on the wall clock.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field, replace
from typing import Callable

from common.clock import SeqTiming, now
from measure.bench import MB, ceil_div, summarize
from measure.progress import progress_bar
from measure.workload import Request, TracedRequest

WARMUP_NEW_TOKENS_CPU = 2   # a CPU warm-up runs the workload's prompts with only this many new tokens each


# --- the runner interface -----------------------------------------------------------------
@dataclass
class EngineRun:
    outputs: list[list[int]]          # new token ids per request, in request order
    timings: list[SeqTiming]          # one per request
    kv_peak_bytes: int                # most KV bytes held at once during the run
    note: str = ""                    # optional line for the table notes
    settings: dict = field(default_factory=dict)   # what it ran with, JSON-ready: enough to reproduce the row

    @classmethod
    def from_sequences(cls, seqs: list, kv_peak_bytes: int, note: str = "", settings: dict | None = None) -> "EngineRun":
        """From an engine's finished sequences: anything with `seq_id`, `output_ids` and `timing` (a SeqTiming),
        numbered in request order."""
        seqs = sorted(seqs, key=lambda s: s.seq_id)
        return cls([list(s.output_ids) for s in seqs], [s.timing for s in seqs], kv_peak_bytes, note,
                   settings or {})


@dataclass
class EngineRunner:
    """An engine as the harness sees it.

    name   short column prefix ("dyn", "paged", ...)
    label  one line saying what it is (printed under the tables)
    run    run(lm, requests, max_running) -> EngineRun, where `requests` is a list[measure.workload.Request],
           all arriving at once, and `max_running` how many sequences the engine may run together
    """
    name: str
    label: str
    run: Callable[..., EngineRun] = field(repr=False)   # run(lm, requests, max_running) -> EngineRun


class PeakKV:
    """Mixin for a scheduler: remembers the most KV bytes its running sequences held at once.

    Works with any scheduler that has `running` (its sequences), `kv_bytes(seq)`
    (the bytes one holds), `free_kv(seq)` (called as one finishes) and `step()`,
    as phase 2.3's `ContinuousScheduler` and everything built on it do:
    `class Measured(PeakKV, ContinuousScheduler): pass`. Sampled after the
    forward passes of every step, just before the first finished sequence of
    that step gives its KV back (the moment of most KV).
    """

    peak_kv_bytes = 0

    def held_kv_bytes(self) -> int:
        return sum(self.kv_bytes(s) for s in self.running)

    def sample_peak(self) -> None:
        self.peak_kv_bytes = max(self.peak_kv_bytes, self.held_kv_bytes())

    def free_kv(self, seq):
        self.sample_peak()
        super().free_kv(seq)

    def step(self):
        finished = super().step()
        self.sample_peak()
        return finished


def submit(engine, lm, requests: list[Request]) -> None:
    """Queue every request on an engine with the schedulers' `add(prompt_ids, max_new_tokens, ...)`."""
    for r in requests:
        engine.add(r.ids(lm), r.max_new_tokens, sampling=r.sampling, ignore_eos=r.ignore_eos)


def run_prompts(engine, prompts: list, max_new_tokens: int | list[int], label: str,
                **add_options) -> tuple[float, list]:
    """Queue every prompt (text or ids) on a scheduler with one common arrival time t0 (and `add_options`,
    e.g. ignore_eos=True), run it to the end under a progress bar; returns (t0, the finished sequences in
    seq_id order). `max_new_tokens` is one cap for all, or one per prompt."""
    caps = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(prompts)
    if len(caps) != len(prompts):
        raise ValueError(f"{len(caps)} max_new_tokens for {len(prompts)} prompts")
    t0 = now(engine.lm.device)
    for p, cap in zip(prompts, caps):
        engine.add(p, cap, arrival=t0, **add_options)
    with progress_bar(label, total=len(prompts)) as bar:
        return t0, engine.run(progress=bar.callback)


def workload_pool_blocks(lm, requests: list[Request], block_size: int) -> int:
    """A pool with room for every request's worst case at once, so the pool never makes anyone wait:
    each request stores at most prompt + new tokens - 1 positions (the last token is never fed back),
    in whole blocks (rounded up)."""
    return sum(ceil_div(len(r.ids(lm)) + r.max_new_tokens - 1, block_size) for r in requests)


def pool_problems(pool, name: str = "pool") -> list[str]:
    """A block pool after a run: its own invariants checked (`check_invariants()` raises if broken), then
    every block back on the free list? [] when all is well, else one line naming the leak."""
    pool.check_invariants()
    return [] if pool.n_free == pool.n_blocks else [f"{name}: {pool.n_used} blocks leaked"]


# --- step-timed traces (measure/workload.py's TracedRequest) ----------------------------------
def submit_traced(engine, r: TracedRequest):
    """Queue one traced request: a beam search, or a group of r.n samples (a plain request is a group of one)."""
    if r.kind == "beam":
        return engine.add_beam_search(r.prompt_ids, r.max_new_tokens, beam_width=r.n)
    return engine.add_group(r.prompt_ids, r.max_new_tokens, r.sampling, ignore_eos=True, n=r.n)


def drive(engine, trace: list[TracedRequest], on_step: Callable | None = None) -> list:
    """Add each request at its arrival step and step the engine until every request is done, like a
    server's engine loop; `on_step(step_outputs)` after every step. Returns the groups in trace order."""
    order = sorted(range(len(trace)), key=lambda i: trace[i].arrival_step)
    groups: list = [None] * len(trace)
    step, k = 0, 0
    while k < len(order) or engine.has_work:
        if not engine.has_work:
            step = max(step, trace[order[k]].arrival_step)  # idle: jump to the next burst
        while k < len(order) and trace[order[k]].arrival_step <= step:
            groups[order[k]] = submit_traced(engine, trace[order[k]])
            k += 1
        outputs = engine.step()
        if on_step is not None:
            on_step(outputs)
        step += 1
    return groups


def drive_timed(engine, lm, requests: list[Request], on_step: Callable | None = None) -> list:
    """Add each request once its arrival time (`arrival_s` after the start) has passed on the wall clock, and
    step while there is work, like a server's engine loop; idle, sleep until the next arrival. A request's
    latency counts from its arrival, not from the step that picked it up. `on_step(step_outputs)` after every
    step. Returns the sequences in request order."""
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
    seqs: list = [None] * len(requests)
    t0 = now(lm.device)
    k = 0
    while k < len(order) or engine.has_work:
        if not engine.has_work:
            time.sleep(max(0.0, requests[order[k]].arrival_s - (now(lm.device) - t0)))
        while k < len(order) and requests[order[k]].arrival_s <= now(lm.device) - t0:
            r = requests[order[k]]
            seqs[order[k]] = engine.add(r.ids(lm), r.max_new_tokens, sampling=r.sampling, ignore_eos=r.ignore_eos,
                                        arrival=t0 + r.arrival_s)
            k += 1
        if engine.has_work:
            outputs = engine.step()
            if on_step is not None:
                on_step(outputs)
    return seqs


def outputs_of(groups: list) -> list[list[list[int]]]:
    """Each request's token ids: its samples' outputs, or a beam search's best hypothesis."""
    return [[g.best] if hasattr(g, "best") else g.outputs for g in groups]


# --- measuring -----------------------------------------------------------------------------
def _on_cuda(device) -> bool:
    return str(device).startswith("cuda")


def warmup_requests(lm, requests: list[Request]) -> list[Request]:
    """What an engine runs, untimed, before its timed run on `requests`.

    CUDA: the very same requests. Compiled code (HF's static-cache `generate` with
    CUDA graphs, kernel autotuning) is built per shape: batch size, prompt lengths,
    cache length. Only the same requests are sure to give the same shapes, and a
    first call that compiles can take 4x as long as a warm one, or longer.
    CPU: nothing compiles. The same prompts (same batch size and prompt lengths)
    with only WARMUP_NEW_TOKENS_CPU new tokens each warm what there is to warm
    (allocator, lazy initialisation, kernel choice per shape) at a fraction of
    the cost of running everything twice.
    """
    if _on_cuda(lm.device):
        return list(requests)
    return [replace(r, max_new_tokens=min(r.max_new_tokens, WARMUP_NEW_TOKENS_CPU)) for r in requests]


def warmup_rule(device) -> str:
    """One line for the report: how `warm_up` warms an engine on `device`."""
    if _on_cuda(device):
        return "warmed up by one untimed run of the same requests (the shapes compiled code is built for)"
    return (f"warmed up by one untimed run of the same prompts with {WARMUP_NEW_TOKENS_CPU} new tokens each "
            "(CPU: nothing compiles; that covers the prefill's and a decode step's shapes)")


def warm_up(lm, runner: EngineRunner, requests: list[Request], max_running: int) -> None:
    """Run `runner` untimed, with `max_running`, on the workload's own shapes (see `warmup_requests`)."""
    runner.run(lm, warmup_requests(lm, requests), max_running)


def measure(lm, runner: EngineRunner, requests: list[Request], max_running: int, warm: bool = True) -> dict:
    """Warm the engine up on these requests' shapes (`warm_up`; skipped with `warm=False` when it has
    just run them), then run `requests` through it, timed; one row of numbers (JSON-serialisable)."""
    # An engine that an earlier run left in a reference cycle still holds its KV pool (sized to a whole
    # workload, it can be most of a GPU's memory) until the collector runs: run it before this one builds its own.
    gc.collect()
    if warm:
        warm_up(lm, runner, requests, max_running)
        gc.collect()
    warmup = warmup_rule(lm.device) if warm else "warm: an earlier timed run of the same requests"
    start = now(lm.device)
    result = runner.run(lm, requests, max_running)
    wall_s = now(lm.device) - start
    m = summarize(result.timings, wall_s)
    return dict(engine=runner.name, batch_size=max_running, n_seqs=m.n_seqs, total_tokens=m.total_tokens,
                wall_s=wall_s, tok_s=m.total_tok_s, ms_per_tok=m.mean_ms_per_token, ms_per_step=m.ms_per_step,
                ttft_ms=m.mean_ttft_ms,
                kv_peak_bytes=result.kv_peak_bytes, kv_peak_mb=result.kv_peak_bytes / MB,
                outputs=result.outputs, note=result.note, settings=result.settings, warmup=warmup)


def format_settings(settings: dict) -> str:
    """`k=v, k=v`: one engine's settings on one line of table notes."""
    return ", ".join(f"{k}={v}" for k, v in settings.items())


def pick_engines(engines: list[EngineRunner], names: list[str] | None,
                 on_request: list[EngineRunner] = ()) -> list[EngineRunner]:
    """The engines named in `names` (all of `engines` when `names` is empty), in the order of
    `engines` then `on_request`. An engine in `on_request` runs only when named."""
    if not names:
        return list(engines)
    known = list(engines) + [e for e in on_request if e.name not in {k.name for k in engines}]
    unknown = set(names) - {e.name for e in known}
    if unknown:
        raise ValueError(f"unknown engine(s) {sorted(unknown)}; this demo has {[e.name for e in known]}")
    return [e for e in known if e.name in names]
