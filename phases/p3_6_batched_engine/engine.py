"""`BatchedPagedEngine`, four parts: the scheduler (this class; its rules `WorstCaseAdmission`, `WholePrompts`),
`BlockKV` (kv.py), `PagedRunner` (runner.py) and `Sampler` (common/sampling.py)."""

from __future__ import annotations

from collections import deque

import torch

from common.clock import SeqTiming, now
from common.sampling import GREEDY, Sampler, SamplingParams
from extras.p3_6_batched_engine.support import check_attention_supported
from phases.p2_1_naive_batching.validate import tokenize_prompt
from phases.p2_2_scheduler.scheduler import Progress
from phases.p2_2_scheduler.sequence import Sequence, Status, StepOutput, take_tokens
from phases.p3_1_block_allocator.allocator import DEFAULT_BLOCK_SIZE, BlockAllocator
from phases.p3_3_paged_cache.scheduler import check_fits_pool
from phases.p3_6_batched_engine.kv import BlockKV
from phases.p3_6_batched_engine.runner import Batch, Chunk, PagedRunner

DEFAULT_MAX_RUNNING = 64
DEFAULT_MAX_PREFILL_TOKENS = 4096  # prompt tokens packed into one prefill pass at most


class WorstCaseAdmission:
    """Phase 3.3's rule, plus room in the prefill pass: no decode ever finds the pool empty."""

    def __init__(self, engine: BatchedPagedEngine):
        self.engine = engine    # read only: its running set, pool, KV part and prefill pass

    def blocks_left(self) -> int:
        """Free blocks no running sequence may still claim: what this step's admissions can take."""
        return self.engine.allocator.n_free - self.blocks_promised()

    def can_admit(self, seq: Sequence, blocks_left: int) -> bool:
        e = self.engine
        if not e.n_free_slots or not e.prefill.fits(len(seq.all_ids)):
            return False
        if self.blocks_to_admit(seq) <= blocks_left:
            return True
        e.waited_for_blocks.add(seq.seq_id)   # a slot was free, the pool was not
        return False

    def blocks_to_admit(self, seq: Sequence) -> int:
        return self.engine.kv.blocks_for_worst_case(seq)

    def blocks_promised(self) -> int:
        return sum(self.engine.kv.blocks_still_needed(s) for s in self.engine.running)


class WholePrompts:
    """Every admitted prompt, whole, in one pass of at most `max_prefill_tokens` (the first always goes)."""

    def __init__(self, engine: BatchedPagedEngine, max_prefill_tokens: int):
        self.engine = engine    # read only: its running set; `claim` takes each chunk's slots
        self.max_prefill_tokens = max_prefill_tokens

    def plan(self, batch: Batch) -> None:
        """Add the step's prefill chunks to `batch`, after its decode tokens, slots claimed."""
        e = self.engine
        batch.chunks += [e.claim(Chunk(s, 0, len(s.all_ids))) for s in e.running if s.status is Status.PREFILLING]

    def fits(self, n_tokens: int) -> bool:
        pending = sum(len(s.all_ids) for s in self.engine.running if s.status is Status.PREFILLING)
        return not pending or pending + n_tokens <= self.max_prefill_tokens


class BatchedPagedEngine:
    """Continuous batching on the paged pool: one packed prefill pass and one decode pass per step."""

    def __init__(self, lm, max_running: int = DEFAULT_MAX_RUNNING, block_size: int = DEFAULT_BLOCK_SIZE,
                 n_blocks: int | None = None, max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS):
        if isinstance(max_running, bool) or not isinstance(max_running, int) or max_running < 1:
            raise ValueError(f"max_running must be an int >= 1, got {max_running!r}")
        check_attention_supported(lm.model)   # before any memory is taken for the pool
        self.lm = lm
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.allocator = self.make_allocator(block_size, n_blocks)
        self.block_size = self.allocator.block_size
        self.kv = self.make_kv()
        self.admission = self.make_admission()
        self.prefill = self.make_prefill()
        self.sampler = self.make_sampler()
        self.runner = self.make_runner()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []          # in admission order
        self.finished: list[Sequence] = []
        self.sequences: list[Sequence] = []        # everything added, in seq_id order
        self.waited_for_blocks: set[int] = set()   # seq_ids that found a free slot but not enough blocks
        self.n_steps = 0
        self._next_id = 0

    def make_allocator(self, block_size: int, n_blocks: int | None) -> BlockAllocator:
        """The pool; n_blocks=None sizes it from the memory left after model load (phase 3.1's budget)."""
        return BlockAllocator.for_model(self.lm, block_size=block_size, n_blocks=n_blocks)

    def make_kv(self) -> BlockKV:
        return BlockKV(self.allocator)

    def make_admission(self) -> WorstCaseAdmission:
        return WorstCaseAdmission(self)

    def make_prefill(self) -> WholePrompts:
        return WholePrompts(self, self.max_prefill_tokens)

    def make_sampler(self) -> Sampler:
        return Sampler(self.lm.device)

    def make_runner(self) -> PagedRunner:
        return PagedRunner(self.lm, self.allocator)

    def add(self, prompt: str | list[int], max_new_tokens: int, sampling: SamplingParams = GREEDY,
            ignore_eos: bool = False, arrival: float | None = None) -> Sequence:
        """Queue a request: text (chat template applied) or token ids; `arrival` a `common.clock.now` reading."""
        seq = self.new_sequence(prompt, max_new_tokens, sampling, ignore_eos, arrival)
        self.queue(seq)
        return seq

    def new_sequence(self, prompt: str | list[int], max_new_tokens: int, sampling: SamplingParams,
                     ignore_eos: bool, arrival: float | None) -> Sequence:
        """A checked request, not queued yet: a prompt the model takes, a worst case the pool can hold."""
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams (it validates itself), got {type(sampling).__name__}")
        ids = tokenize_prompt(self.lm, prompt, max_new_tokens, label=f"sequence {self._next_id}")
        text = prompt if isinstance(prompt, str) else self.lm.decode(ids)
        seq = Sequence(self._next_id, text, ids, max_new_tokens, sampling=sampling, ignore_eos=ignore_eos)
        seq.timing = SeqTiming(arrival=now(self.lm.device) if arrival is None else arrival)
        check_fits_pool(seq, self.allocator)
        return seq

    def queue(self, seq: Sequence) -> None:
        """A checked sequence joins the back of the queue, and takes its seq_id for good."""
        self._next_id += 1
        self.sequences.append(seq)
        self.waiting.append(seq)

    has_work = property(lambda self: bool(self.waiting or self.running))
    n_free_slots = property(lambda self: self.max_running - len(self.running))

    def run(self, progress: Progress | None = None) -> list[Sequence]:
        """Step until every queued sequence is DONE; return them in seq_id order."""
        while self.has_work:
            self.step()
            if progress:
                progress(len(self.finished), len(self.sequences))
        return sorted(self.finished, key=lambda s: s.seq_id)

    def step(self) -> list[StepOutput]:
        """One step: schedule, run, sample, update. Returns one StepOutput per token made."""
        batch = self.schedule()
        outputs = self.run_batch(batch) if batch else []
        self.n_steps += 1
        return outputs

    def run_batch(self, batch: Batch) -> list[StepOutput]:
        logits = self.runner.run(batch)                          # [len(batch.emitting), V]
        self.kv.written(batch.seqs)                              # every claimed slot holds its K/V
        return self.emit(batch.emitting, logits)

    def emit(self, seqs: list[Sequence], logits: torch.Tensor) -> list[StepOutput]:
        """Row i of logits [S, V] is seqs[i]'s."""
        tokens = self.sampler.sample(seqs, logits)
        return self.update(seqs, tokens)

    def schedule(self) -> Batch:
        """Admission, then every decoding sequence's next token, then the step's prefill work."""
        self.admit()
        decode = [s for s in self.running if s.status is Status.DECODING]
        batch = Batch(decode=decode, decode_slots=[self.kv.append_slots(s, 1)[0] for s in decode])
        self.prefill.plan(batch)
        return batch

    def claim(self, chunk: Chunk) -> Chunk:
        """Claim the pool slots of `chunk`'s positions (before the pass; attention writes them)."""
        chunk.slots = self.kv.append_slots(chunk.seq, chunk.length)
        return chunk

    def admit(self) -> None:
        """Admit from the head of the queue while the rule lets it; nobody overtakes the head (no starving)."""
        if self.waiting:
            left = self.admission.blocks_left()
            while self.waiting and self.admission.can_admit(self.waiting[0], left):
                left -= self.admission.blocks_to_admit(self.waiting[0])
                self.admit_head()
        if self.waiting and not self.running:
            # add() refuses what the empty pool cannot hold: a guard against a silent hang.
            raise RuntimeError(f"sequence {self.waiting[0].seq_id} cannot be admitted into an idle pool "
                               f"({self.allocator.n_free} of {self.allocator.n_blocks} blocks free)")

    def admit_head(self) -> Sequence:
        seq = self.waiting.popleft()
        seq.move(Status.PREFILLING)
        self.kv.new_table(seq)
        self.running.append(seq)
        return seq

    def update(self, seqs: list[Sequence], tokens: list[int], t: float | None = None) -> list[StepOutput]:
        """Each sequence takes its token; a finished one leaves, its blocks back. `t`: when (default: now)."""
        t = now(self.lm.device) if t is None else t
        return take_tokens(seqs, tokens, self.lm.eos_token_ids, t, self.finish)

    def finish(self, seq: Sequence) -> None:
        seq.move(Status.DONE)
        self.retire(seq)
        self.close(seq)

    def abort(self, seq: Sequence) -> None:
        """Drop a request wherever it is (a client went away); a running one gives its blocks back now."""
        if not self.withdraw(seq):
            return
        seq.finish_reason = "abort"
        seq.status = Status.DONE      # the one way out of any state, so not a `move`
        seq.history.append(Status.DONE)
        self.close(seq)

    def withdraw(self, seq: Sequence) -> bool:
        """Take `seq` out of the queue or the running set (its blocks back); False if it is in neither."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.running:
            self.retire(seq)
        else:
            return False
        return True

    def retire(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq)

    def close(self, seq: Sequence) -> None:
        self.sampler.forget(seq)
        self.finished.append(seq)

    n_forward_passes = property(lambda self: self.runner.n_forward_passes)
    n_prefill_tokens = property(lambda self: self.runner.n_prefill_tokens)
    peak_blocks_used = property(lambda self: self.kv.peak_blocks_used)
