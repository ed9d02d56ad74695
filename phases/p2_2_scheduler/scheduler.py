"""`Scheduler`: a waiting queue, a running set of at most `max_running`, and static batches.

Requests go into a FIFO `waiting` deque. When the running set is empty the
scheduler admits up to `max_running` of them as one batch and runs that batch
with phase 2.1's `PaddedBatch` (left padding, one shared DynamicCache),
one lock-step forward pass per `step()`. A sequence that finishes early moves
to DONE but keeps its slot until the whole batch is done: nothing new can
join a padded batch halfway. Only then is the next batch admitted.

Every status change goes through `Sequence.move`, which refuses illegal moves:
WAITING -> PREFILLING -> DECODING -> DONE, exactly once each. Phase 2.3
subclasses this class and changes only `step()` (continuous batching).
"""

from __future__ import annotations

from collections import deque
from typing import Callable

import torch

from common.bench import SeqTiming, now
from common.sampling import GREEDY, SamplingParams, make_generator, sample
from phases.p2_1_naive_batching.batch import PaddedBatch
from phases.p2_1_naive_batching.validate import tokenize_prompt
from phases.p2_2_scheduler.sequence import Sequence, Status
from phases.p2_2_scheduler.trace import CARRIED, DECODE, PREFILL, StepRecord, Trace

Progress = Callable[[int, int], None]  # progress(n_finished, n_added), called after every step


class Scheduler:
    """Static batching behind a scheduler's interface: add(), step(), run()."""

    def __init__(self, lm, max_running: int = 4):
        if isinstance(max_running, bool) or not isinstance(max_running, int) or max_running < 1:
            raise ValueError(f"max_running must be an int >= 1, got {max_running!r}")
        self.lm = lm
        self.max_running = max_running
        self.waiting: deque[Sequence] = deque()
        self.slots: list[Sequence | None] = [None] * max_running  # the running set, by slot
        self.finished: list[Sequence] = []
        self.sequences: list[Sequence] = []        # everything added, in seq_id order
        self.returned_at: dict[int, float] = {}    # seq_id -> when its result is handed back
        self.trace = Trace()
        self.n_steps = 0
        self._generators: dict[int, torch.Generator | None] = {}
        self._batch: PaddedBatch | None = None     # the static batch in flight

    # -- the queue ----------------------------------------------------------------
    def add(self, prompt: str | list[int], max_new_tokens: int, sampling: SamplingParams = GREEDY,
            ignore_eos: bool = False, arrival: float | None = None) -> Sequence:
        """Queue a request. `prompt` is text (chat template applied) or token ids.

        Bad input (empty prompt, too long for the context, max_new_tokens <= 0)
        raises ValueError here, before any forward pass. `arrival` is a clock
        reading from `common.bench.now` (default: now).
        """
        seq_id = len(self.sequences)
        ids = tokenize_prompt(self.lm, prompt, max_new_tokens, label=f"sequence {seq_id}")
        text = prompt if isinstance(prompt, str) else self.lm.decode(ids)
        seq = Sequence(seq_id, text, ids, max_new_tokens, sampling=sampling, ignore_eos=ignore_eos)
        seq.timing = SeqTiming(arrival=now(self.lm.device) if arrival is None else arrival)
        self._generators[seq_id] = make_generator(sampling, self.lm.device)
        self.sequences.append(seq)
        self.waiting.append(seq)
        return seq

    @property
    def running(self) -> list[Sequence]:
        return [s for s in self.slots if s is not None]

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or any(s is not None for s in self.slots)

    def run(self, progress: Progress | None = None) -> list[Sequence]:
        """Step until every queued sequence is DONE; return them in seq_id order."""
        while self.has_work:
            self.step()
            if progress:
                progress(len(self.finished), len(self.sequences))
        return sorted(self.finished, key=lambda s: s.seq_id)

    # -- shared helpers (phase 2.3 uses them too) -----------------------------------
    def _admit(self, slot: int) -> Sequence:
        """Move the oldest waiting sequence (FIFO) into `slot`."""
        seq = self.waiting.popleft()
        seq.move(Status.PREFILLING)
        self.slots[slot] = seq
        return seq

    def _emit(self, seq: Sequence, logits: torch.Tensor, t: float) -> bool:
        """Pick seq's next token from logits [V]; advance its status; True if it just finished."""
        token = int(sample(logits.view(1, -1), seq.sampling, self._generators[seq.seq_id])[0])
        done = seq.append_token(token, self.lm.eos_token_ids, t)
        if seq.status is Status.PREFILLING:
            seq.move(Status.DECODING)   # the prompt is in the cache; from here on it decodes
        if done:
            seq.move(Status.DONE)
            self.finished.append(seq)
        return done

    def _record(self, t_start: float, t_end: float, work: list[str | None]) -> None:
        slots = [s.seq_id if s is not None else None for s in self.slots]
        self.trace.add(StepRecord(self.n_steps, t_start, t_end, slots, work))
        self.n_steps += 1

    # -- one step of static batching ------------------------------------------------------
    def step(self) -> list[Sequence]:
        """One forward pass of the current batch (prefill when a new batch starts).

        Returns the sequences that finished during this step.
        """
        if self._batch is None:
            if not self.waiting:
                return []
            return self._start_batch()
        return self._decode_batch()

    def _start_batch(self) -> list[Sequence]:
        dev = self.lm.device
        batch = [self._admit(slot) for slot in range(min(self.max_running, len(self.waiting)))]
        self._batch = PaddedBatch(self.lm, [s.prompt_ids for s in batch])
        for s in batch:
            s.kv = self._batch               # one cache, shared by the whole batch
        t_start = now(dev)
        logits = self._batch.prefill()       # [B, V]
        t = now(dev)
        work = [PREFILL if s is not None else None for s in self.slots]
        finished = [s for i, s in enumerate(batch) if self._emit(s, logits[i], t)]
        self._record(t_start, t, work)
        self._maybe_end_batch(t)
        return finished

    def _decode_batch(self) -> list[Sequence]:
        dev = self.lm.device
        batch = self.running                 # row i of the padded batch is slot i
        live = [s.status is not Status.DONE for s in batch]
        # A finished row is fed PAD: still computed (the waste), never read.
        feed = torch.tensor([s.output_ids[-1] if ok else self.lm.pad_token_id for s, ok in zip(batch, live)])
        t_start = now(dev)
        logits = self._batch.decode(feed)    # [B, V]
        t = now(dev)
        work = [None] * self.max_running
        for i, ok in enumerate(live):
            work[i] = DECODE if ok else CARRIED
        finished = [s for i, s in enumerate(batch) if live[i] and self._emit(s, logits[i], t)]
        self._record(t_start, t, work)
        self._maybe_end_batch(t)
        return finished

    def _maybe_end_batch(self, t: float) -> None:
        """When every row is DONE the batch returns: all its results are handed back together."""
        if any(s.status is not Status.DONE for s in self.running):
            return
        for s in self.running:
            self.returned_at[s.seq_id] = t
            s.kv = None
        self.slots = [None] * self.max_running
        self._batch = None
