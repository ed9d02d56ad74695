"""`Scheduler`: a waiting queue, a running set of at most `max_running`, and static batches.

When the running set is empty the scheduler admits up to `max_running` waiting requests (FIFO) as one
phase-2.1 `PaddedBatch`, one lock-step forward pass per `step()`. A sequence that finishes early moves to
DONE but keeps its slot until the whole batch is done (nothing can join a padded batch halfway); only
then is the next batch admitted. Every status change goes through `Sequence.move`.

The interface: `add(...) -> Sequence`, `step() -> [StepOutput]` (one per token made), `run()`;
`waiting`, `running` (in slot order), `finished`, `sequences`.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

import torch

from common.clock import SeqTiming, now
from common.sampling import GREEDY, SamplingParams, make_generator, sample
from phases.p2_1_naive_batching.batch import PaddedBatch
from phases.p2_1_naive_batching.validate import tokenize_prompt
from phases.p2_2_scheduler.sequence import Sequence, Status, StepOutput, take_tokens
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
        self._next_id = 0                          # the seq_id the next sequence gets
        self._generators: dict[int, torch.Generator | None] = {}
        self._batch: PaddedBatch | None = None     # the static batch in flight

    def add(self, prompt: str | list[int], max_new_tokens: int, sampling: SamplingParams = GREEDY,
            ignore_eos: bool = False, arrival: float | None = None) -> Sequence:
        """Queue a request: `prompt` is text (chat template applied) or token ids; bad input raises
        ValueError before anything is queued. `arrival`: a `common.clock.now` reading (default: now)."""
        seq = self._new_sequence(prompt, max_new_tokens, sampling, ignore_eos, arrival)
        self._next_id += 1
        self._generators[seq.seq_id] = make_generator(seq.sampling, self.lm.device)  # its own random stream
        self.sequences.append(seq)
        self.waiting.append(seq)
        return seq

    def _new_sequence(self, prompt: str | list[int], max_new_tokens: int, sampling: SamplingParams,
                      ignore_eos: bool, arrival: float | None) -> Sequence:
        """A checked request, not queued yet: a refused request takes no seq_id."""
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams (it validates itself), got {type(sampling).__name__}")
        seq_id = self._next_id
        ids = tokenize_prompt(self.lm, prompt, max_new_tokens, label=f"sequence {seq_id}")
        text = prompt if isinstance(prompt, str) else self.lm.decode(ids)
        seq = Sequence(seq_id, text, ids, max_new_tokens, sampling=sampling, ignore_eos=ignore_eos)
        seq.timing = SeqTiming(arrival=now(self.lm.device) if arrival is None else arrival)
        return seq

    @property
    def running(self) -> list[Sequence]:
        """The running set, in slot order."""
        return [s for s in self.slots if s is not None]

    @property
    def n_free_slots(self) -> int:
        return self.slots.count(None)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or self.n_free_slots < self.max_running

    def run(self, progress: Progress | None = None) -> list[Sequence]:
        """Step until every queued sequence is DONE; return them in seq_id order."""
        while self.has_work:
            self.step()
            if progress:
                progress(len(self.finished), len(self.sequences))
        return sorted(self.finished, key=lambda s: s.seq_id)

    def _admit(self) -> Sequence:
        """Move the oldest waiting sequence (FIFO) into the first free slot."""
        seq = self.waiting.popleft()
        seq.move(Status.PREFILLING)
        free = next((i for i, s in enumerate(self.slots) if s is None), None)
        if free is None:
            raise RuntimeError(f"sequence {seq.seq_id}: no free slot (all {self.max_running} are running)")
        self.slots[free] = seq
        return seq

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
        """One token per row of logits [S, V]: greedy rows in one argmax, sampled rows each with their own generator."""
        tokens = logits.float().argmax(-1)  # [S]; fp32 first: a CPU argmax over bf16 is slower, same answer
        for i, seq in enumerate(seqs):
            if not seq.sampling.greedy:
                tokens[i] = sample(logits[i:i + 1], seq.sampling, self._generators[seq.seq_id])[0]
        # One copy to the host for the whole batch (on a GPU each read is a wait for the stream).
        return tokens.tolist()

    def _emit(self, seqs: list[Sequence], logits: torch.Tensor) -> list[StepOutput]:
        """Pick each sequence's next token from logits [S, V] (row i is seqs[i]); advance its status."""
        tokens = self._sample(seqs, logits)
        t = now(self.lm.device)             # a synchronised clock: when the tokens exist
        return take_tokens(seqs, tokens, self.lm.eos_token_ids, t, self._finish)

    def _finish(self, seq: Sequence) -> None:
        """`seq` made its last token; it leaves the running set with its batch."""
        seq.move(Status.DONE)
        self.finished.append(seq)
        self._generators.pop(seq.seq_id, None)  # nothing more to sample

    def _record(self, t_start: float, t_end: float, work: list[str | None]) -> None:
        slots = [s.seq_id if s is not None else None for s in self.slots]
        self.trace.add(StepRecord(self.n_steps, t_start, t_end, slots, work))
        self.n_steps += 1

    def step(self) -> list[StepOutput]:
        """One forward pass of the current batch (prefill when a new batch starts); one StepOutput per token."""
        if self._batch is None:
            return self._start_batch() if self.waiting else []
        return self._decode_batch()

    def _start_batch(self) -> list[StepOutput]:
        batch = [self._admit() for _ in range(min(self.max_running, len(self.waiting)))]
        self._batch = PaddedBatch(self.lm, [s.prompt_ids for s in batch])
        for s in batch:
            s.kv = self._batch               # one cache, shared by the whole batch
        t_start = now(self.lm.device)
        logits = self._batch.prefill()       # [B, V]
        t_end = now(self.lm.device)
        work = [PREFILL if s is not None else None for s in self.slots]
        outputs = self._emit(batch, logits)
        self._record(t_start, t_end, work)
        self._maybe_end_batch()
        return outputs

    def _decode_batch(self) -> list[StepOutput]:
        batch = self.running                 # row i of the padded batch is slot i
        live = [i for i, s in enumerate(batch) if s.status is not Status.DONE]
        # A finished row is fed PAD: still computed (the waste), never read.
        feed = torch.tensor([s.output_ids[-1] if s.status is not Status.DONE else self.lm.pad_token_id
                             for s in batch])
        t_start = now(self.lm.device)
        logits = self._batch.decode(feed)    # [B, V]
        t_end = now(self.lm.device)
        work = [CARRIED if s.status is Status.DONE else DECODE for s in batch]
        work += [None] * (self.max_running - len(batch))
        outputs = self._emit([batch[i] for i in live], logits[live])
        self._record(t_start, t_end, work)
        self._maybe_end_batch()
        return outputs

    def _maybe_end_batch(self) -> None:
        """When every row is DONE the batch returns: all its results are handed back together."""
        if any(s.status is not Status.DONE for s in self.running):
            return
        t = max(s.timing.finish for s in self.running)   # when its last row finished
        for s in self.running:
            self.returned_at[s.seq_id] = t
            s.kv = None
        self.slots = [None] * self.max_running
        self._batch = None
