"""Workloads that overflow a small pool, and the loop that feeds them to an engine.

- `burst`: n greedy requests that all arrive at once, prompt and output
  lengths drawn uniformly (random token ids, EOS ignored, so every engine does
  the same work and greedy outputs can be compared token for token);
- `stress_trace`: a seeded mix of plain requests, n seeded samples and beam
  searches, arriving in bursts every few engine steps;
- `drive(engine, trace)`: adds each request at its arrival step and steps the
  engine until every request has finished, like a server's engine loop.

Arrival is measured in engine steps, not seconds, so a trace means the same
thing on a fast GPU and a slow CPU, and two runs of it are comparable.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from common.sampling import GREEDY, SamplingParams
from common.workload import FIRST_ORDINARY_TOKEN_ID
from phases.p4_1_copy_on_write.engine import SequenceGroup

SAMPLE_TEMPERATURE = 0.8  # the stress trace's sampled requests


@dataclass
class TracedRequest:
    prompt_ids: list[int]
    max_new_tokens: int
    arrival_step: int = 0
    kind: str = "plain"        # "plain" (greedy), "samples" (n seeded samples), "beam" (beam search, width n)
    n: int = 1
    seed: int | None = None    # samples: the request's seed (sample i draws with seed + i)

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=SAMPLE_TEMPERATURE, seed=self.seed) if self.kind == "samples" else GREEDY


def _prompt(rng: np.random.Generator, length: int, vocab_size: int) -> list[int]:
    return [int(t) for t in rng.integers(FIRST_ORDINARY_TOKEN_ID, vocab_size, size=length)]


def burst(vocab_size: int, n: int, prompt_len: tuple[int, int], output_len: tuple[int, int],
          seed: int = 0) -> list[TracedRequest]:
    """n greedy requests arriving together; lengths uniform in the given [lo, hi] ranges."""
    rng = np.random.default_rng(seed)
    return [TracedRequest(_prompt(rng, int(rng.integers(prompt_len[0], prompt_len[1] + 1)), vocab_size),
                          int(rng.integers(output_len[0], output_len[1] + 1))) for _ in range(n)]


def stress_trace(vocab_size: int, n_requests: int, prompt_len: tuple[int, int], output_len: tuple[int, int],
                 burst_size: tuple[int, int], burst_gap: tuple[int, int], p_samples: float, p_beam: float,
                 max_n: int, seed: int = 0) -> list[TracedRequest]:
    """Bursts of requests (sizes and gaps in steps drawn uniformly); each is plain, n samples or a beam search."""
    rng = np.random.default_rng(seed)
    trace, step = [], 0
    while len(trace) < n_requests:
        for _ in range(min(int(rng.integers(burst_size[0], burst_size[1] + 1)), n_requests - len(trace))):
            kind = rng.choice(["samples", "beam", "plain"], p=[p_samples, p_beam, 1 - p_samples - p_beam])
            trace.append(TracedRequest(
                _prompt(rng, int(rng.integers(prompt_len[0], prompt_len[1] + 1)), vocab_size),
                int(rng.integers(output_len[0], output_len[1] + 1)), arrival_step=step, kind=str(kind),
                n=1 if kind == "plain" else int(rng.integers(2, max_n + 1)), seed=len(trace)))
        step += int(rng.integers(burst_gap[0], burst_gap[1] + 1))
    return trace


def demand_tokens(trace: list[TracedRequest]) -> int:
    """KV tokens the trace would hold if every request ran to max_new_tokens at once, nothing shared."""
    return sum(r.n * (len(r.prompt_ids) + r.max_new_tokens) for r in trace)


def add(engine, r: TracedRequest) -> SequenceGroup:
    if r.kind == "beam":
        return engine.add_beam_search(r.prompt_ids, r.max_new_tokens, beam_width=r.n)
    return engine.add_group(r.prompt_ids, r.max_new_tokens, r.sampling, ignore_eos=True, n=r.n)


def drive(engine, trace: list[TracedRequest], on_step=None) -> list[SequenceGroup]:
    """Add each request at its arrival step, step until all are done; returns the groups in trace order."""
    order = sorted(range(len(trace)), key=lambda i: trace[i].arrival_step)
    groups: list[SequenceGroup | None] = [None] * len(trace)
    step, k = 0, 0
    while k < len(order) or engine.has_work:
        if not engine.has_work:
            step = max(step, trace[order[k]].arrival_step)  # idle: jump to the next burst
        while k < len(order) and trace[order[k]].arrival_step <= step:
            groups[order[k]] = add(engine, trace[order[k]])
            k += 1
        outputs = engine.step()
        if on_step is not None:
            on_step(outputs)
        step += 1
    return groups


def outputs_of(groups: list[SequenceGroup]) -> list[list[list[int]]]:
    """Each request's token ids: its samples' outputs, or a beam search's best hypothesis."""
    return [[g.best] if hasattr(g, "best") else g.outputs for g in groups]
