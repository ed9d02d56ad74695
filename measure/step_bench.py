"""Time one engine's decode step at a given batch size: wall time per step, and (for a graph) its GPU time.

    decode_step_ms(make_engine, lm, batch, prompt_len, steps) -> {"ms": median wall ms per step, "mean_ms", ...}

The engine is built by `make_engine(lm, max_running)`, given `batch` requests of
`prompt_len` random tokens (EOS ignored), stepped until every request decodes
(the prefill passes, not timed), then `WARMUP_STEPS` decode steps (a graph engine
captures its graphs there), then `steps` timed ones, each ended by a device
synchronise (an engine with `overlaps_steps`, whose step() launches one step and
reads the one before, is timed over the run of steps instead, its mean per step).
With `runs` > 1 the timed steps are cut into that many consecutive runs, and
"best_run_ms" is the fastest run's mean per step: on a shared machine, where
other work steals the CPU now and then, the fastest run is the closest reading
of the step's own cost. ms per step is the blog's ms/tok: the time of one decode step, in
which every sequence makes one token. tok/s = batch / that time.

`replay_ms(graph)` times a captured CUDA graph's replay with CUDA events: the
GPU's own time for the step, with no host work in it. A step's wall time over
that is the host overhead the graph did not hide.
"""

from __future__ import annotations

import statistics
import time
from itertools import accumulate
from typing import Callable

import torch

from common.clock import sync

WARMUP_STEPS = 3
PROMPT_SEED = 0
FIRST_TOKEN_ID = 100     # random prompt ids start here (clear of special tokens)


def random_prompts(vocab: int, batch: int, prompt_len: int | tuple[int, int],
                   seed: int = PROMPT_SEED) -> list[list[int]]:
    """`batch` prompts of random ids: all `prompt_len` long, or each of a length drawn from (lo, hi)."""
    gen = torch.Generator().manual_seed(seed)
    if isinstance(prompt_len, tuple):
        lengths = torch.randint(prompt_len[0], prompt_len[1] + 1, (batch,), generator=gen).tolist()
    else:
        lengths = [prompt_len] * batch
    return [torch.randint(FIRST_TOKEN_ID, vocab, (n,), generator=gen).tolist() for n in lengths]


def prefill_everything(engine) -> None:
    """Step `engine` until every request is admitted and prefilled: its next step is a decode-only step."""
    while engine.waiting or any(s.status.name == "PREFILLING" for s in engine.running):
        engine.step()


def decode_step_ms(make_engine: Callable, lm, batch: int, prompt_len: int | tuple[int, int], steps: int,
                   runs: int = 1) -> dict:
    """Median (and p90) wall ms of one decode step of `batch` sequences, after warm-up. prompt_len: one length
    for every prompt, or (lo, hi) for lengths drawn in that range (the same draw for every engine). runs: cut
    the timed steps into this many runs; best_run_ms is the fastest run's mean per step."""
    if not 1 <= runs <= steps:
        raise ValueError(f"runs must be between 1 and steps ({steps}), got {runs}")
    engine = make_engine(lm, batch)
    for ids in random_prompts(lm.vocab_size, batch, prompt_len):
        engine.add(ids, WARMUP_STEPS + steps + 2, ignore_eos=True)
    prefill_everything(engine)
    for _ in range(WARMUP_STEPS):
        engine.step()
    run_lengths = [steps // runs + (i < steps % runs) for i in range(runs)]   # as equal as they can be
    run_means = []
    if getattr(engine, "overlaps_steps", False):
        # Each step() launches one step and reads the one before: a synchronise after each would undo the
        # overlap it is measured for. Time each run of steps as a whole; ms per step is its mean.
        for n in run_lengths:
            sync(lm.device)
            start = time.perf_counter()
            for _ in range(n):
                engine.step()
            sync(lm.device)
            run_means.append((time.perf_counter() - start) * 1e3 / n)
        times = run_means
        mean_ms = sum(m * n for m, n in zip(run_means, run_lengths)) / steps
    else:
        times = []
        for _ in range(steps):
            sync(lm.device)
            start = time.perf_counter()
            engine.step()
            sync(lm.device)
            times.append((time.perf_counter() - start) * 1e3)
        run_means = [statistics.fmean(times[end - n:end]) for end, n in zip(accumulate(run_lengths), run_lengths)]
        mean_ms = statistics.fmean(times)
    ms = statistics.median(times)
    return dict(batch=batch, ms=ms, p90_ms=sorted(times)[int(0.9 * (len(times) - 1))], tok_s=batch / ms * 1e3,
                mean_ms=mean_ms, best_run_ms=min(run_means), engine=engine)


def replay_ms(graph: torch.cuda.CUDAGraph, iters: int = 20) -> float:
    """Median GPU ms of one replay of `graph` (CUDA events around each replay)."""
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
