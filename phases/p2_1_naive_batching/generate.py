"""`generate_batch`: greedy decoding of a list of prompts with naive (static) batching.

Phase 1's `generate(lm, prompt)` took one prompt; this takes a list. All rows
are prefilled together, then decoded in lock-step until EVERY row has hit EOS
or the cap. A row that finished early keeps riding along (fed PAD, computed,
ignored) until the slowest row is done. `BatchResult` records, per row, how
many decode steps it needed and how many it was carried for nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from common.clock import SeqTiming, now
from phases.p2_1_naive_batching.batch import PaddedBatch, cache_bytes
from phases.p2_1_naive_batching.validate import tokenize_batch


@dataclass
class BatchResult:
    prompts: list[str]
    prompt_ids: list[list[int]]
    output_ids: list[list[int]]      # per row, up to and including its EOS (or the cap)
    texts: list[str]
    finish_reasons: list[str]        # "eos" or "length"
    timings: list[SeqTiming]         # arrival = the call; first token = after prefill
    n_decode_steps: int              # decode steps the whole batch ran (the slowest row's count)
    n_pad: list[int]                 # PAD tokens in front of each row
    wall_s: float
    kv_bytes: int = 0                # the shared DynamicCache's K/V bytes at the end
    step_times: list[float] = field(default_factory=list)  # clock after prefill, then after each decode step

    @property
    def steps_needed(self) -> list[int]:
        """Decode steps each row needed: its tokens after the first (prefill gives the first)."""
        return [len(o) - 1 for o in self.output_ids]

    @property
    def steps_wasted(self) -> list[int]:
        """Decode steps each row was carried after it had finished."""
        return [self.n_decode_steps - n for n in self.steps_needed]

    @property
    def waste_pct(self) -> list[float]:
        if self.n_decode_steps == 0:
            return [0.0] * len(self.output_ids)
        return [100.0 * w / self.n_decode_steps for w in self.steps_wasted]

    @property
    def total_tokens(self) -> int:
        return sum(len(o) for o in self.output_ids)


def _finished(token: int, n_out: int, max_new_tokens: int, eos_ids: set[int], ignore_eos: bool) -> str | None:
    """The reason a row stops after emitting `token` as its n_out-th token, or None."""
    if not ignore_eos and token in eos_ids:
        return "eos"
    if n_out >= max_new_tokens:
        return "length"
    return None


def generate_batch(lm, prompts: list[str], max_new_tokens: int = 64, ignore_eos: bool = False,
                   on_step: Callable[[int, int], None] | None = None) -> BatchResult:
    """Greedy-decode `prompts` as one left-padded batch over a shared DynamicCache.

    ignore_eos=True makes every row produce exactly `max_new_tokens` (benchmarks).
    on_step(step, n_live) is called after every forward pass (progress bars).
    """
    rows = tokenize_batch(lm, prompts, max_new_tokens)   # raises before any work on bad input
    B, dev = len(rows), lm.device
    t0 = now(dev)
    timings = [SeqTiming(arrival=t0) for _ in rows]
    outputs: list[list[int]] = [[] for _ in rows]
    reasons: list[str | None] = [None] * B

    def record(next_ids: torch.Tensor, t: float) -> None:
        for i, tok in enumerate(next_ids.tolist()):
            if reasons[i] is not None:
                continue  # finished earlier: this row's token is carried work, not output
            outputs[i].append(tok)
            timings[i].token(t)
            reasons[i] = _finished(tok, len(outputs[i]), max_new_tokens, lm.eos_token_ids, ignore_eos)

    batch = PaddedBatch(lm, rows)
    next_ids = batch.prefill().argmax(-1)                # [B] greedy
    step_times = [now(dev)]
    record(next_ids, step_times[-1])
    pad = torch.full_like(next_ids, lm.pad_token_id)
    steps = 0
    if on_step:
        on_step(steps, sum(r is None for r in reasons))
    while any(r is None for r in reasons):
        live = torch.tensor([r is None for r in reasons], device=next_ids.device)
        # Finished rows are fed PAD: their column is still computed (the waste), never read.
        next_ids = batch.decode(torch.where(live, next_ids, pad)).argmax(-1)
        steps += 1
        step_times.append(now(dev))
        record(next_ids, step_times[-1])
        if on_step:
            on_step(steps, sum(r is None for r in reasons))
    wall_s = now(dev) - t0
    return BatchResult(prompts=list(prompts), prompt_ids=rows, output_ids=outputs,
                       texts=[lm.decode(o) for o in outputs], finish_reasons=list(reasons),
                       timings=timings, n_decode_steps=steps, n_pad=batch.n_pad, wall_s=wall_s,
                       kv_bytes=cache_bytes(batch.cache), step_times=step_times)
