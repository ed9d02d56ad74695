"""`BatchedPagedEngine`: continuous batching over the paged pool, one forward pass per step.

Phase 2.3 and 3.3 ran one forward pass per running sequence per step, because
each sequence's K/V lived in its own cache at its own length. Here all K/V
live in one pool and attention reads it by block table (attention.py), so
sequences at different lengths decode together: every step is

  1. admit  - waiting sequences join while there is room (max_running, pool);
  2. prefill - the prompts of the newly admitted, packed into ONE forward pass
               ([1, sum of prompt lengths]); each samples its first token;
  3. decode  - every sequence that was already decoding, in ONE forward pass
               (input_ids [S, 1], each at its own position); each samples one
               token; finished sequences give their blocks back at once.

Later phases subclass this engine and override its hooks rather than edit it:
`_blocks_to_admit` (admission budget), `_on_admit` (mapping cached prefix blocks),
`_append_slots` (where copy-on-write goes), `_release` (what happens to a
finished sequence's blocks).

Admission here is conservative: a sequence is admitted only if the pool can
hold its prompt *and* its new tokens (`max_kv_tokens`) on top of what the running sequences
may still claim, so decode never runs out of blocks. Blocks are still taken
one at a time as tokens arrive; only the admission check is worst-case.
(Phase 4 admits optimistically and preempts instead.)
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from common.bench import SeqTiming, now
from common.sampling import GREEDY, SamplingParams, make_generator, sample
from phases.p2_2_scheduler.sequence import Sequence, Status
from phases.p3_1_block_allocator.allocator import DEFAULT_BLOCK_SIZE, BlockAllocator
from phases.p3_2_block_table.block_table import BlockTable
from phases.p3_5_paged_attention.attention import PagedBatch, Segment, use_paged_attention

DEFAULT_MAX_RUNNING = 64
DEFAULT_MAX_PREFILL_TOKENS = 4096  # prompt tokens packed into one prefill pass at most


@dataclass
class StepOutput:
    """One token emitted by one sequence in one step (what a streaming server sends)."""
    seq: Sequence
    token_id: int
    finished: bool


def _blocks_for(n_tokens: int, block_size: int) -> int:
    return -(-n_tokens // block_size)


def max_kv_tokens(n_prompt: int, max_new_tokens: int) -> int:
    """Most tokens a request can hold in the pool: its prompt and every new token but the last.

    The last token sampled ends the request, so it is never fed back and its K/V
    is never written. Counting it would make a request that ends exactly on a
    block boundary reserve a block it can never use."""
    return n_prompt + max(max_new_tokens - 1, 0)


class BatchedPagedEngine:
    def __init__(self, lm, max_running: int = DEFAULT_MAX_RUNNING, block_size: int = DEFAULT_BLOCK_SIZE,
                 n_blocks: int | None = None, max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS,
                 allocator: BlockAllocator | None = None):
        if max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {max_running}")
        self.lm = lm
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.allocator = allocator or BlockAllocator.for_model(lm, block_size=block_size, n_blocks=n_blocks)
        self.block_size = self.allocator.block_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.finished: list[Sequence] = []
        self._generators: dict[int, torch.Generator | None] = {}
        self._next_id = 0
        self.n_steps = 0
        self.n_forward_passes = 0
        self.peak_blocks_used = 0   # most blocks held at once (read after each pass, before any release)

    # --- requests ----------------------------------------------------------------
    def add(self, prompt: str | None = None, max_new_tokens: int = 64, sampling: SamplingParams = GREEDY,
            ignore_eos: bool = False, prompt_ids: list[int] | None = None, arrival: float | None = None) -> Sequence:
        """Queue a request (text through the chat template, or raw ids). Validates before queueing."""
        if prompt_ids is None:
            if not prompt:
                raise ValueError("empty prompt: give at least one character of text")
            prompt_ids = self.lm.prompt_ids(prompt)
        seq = Sequence(self._next_id, prompt or "", list(prompt_ids), max_new_tokens, sampling, ignore_eos)
        total = len(seq.prompt_ids) + max_new_tokens
        if total > self.lm.max_context:
            raise ValueError(f"request of {len(seq.prompt_ids)} prompt + {max_new_tokens} new tokens exceeds "
                             f"the model's context of {self.lm.max_context} tokens")
        need = _blocks_for(max_kv_tokens(len(seq.prompt_ids), max_new_tokens), self.block_size)
        if need > self.allocator.n_blocks:
            raise ValueError(f"request needs {need} blocks of {self.block_size} "
                             f"tokens, but the whole pool has {self.allocator.n_blocks}")
        self._next_id += 1
        seq.timing = SeqTiming(arrival=now(self.lm.device) if arrival is None else arrival)
        self._generators[seq.seq_id] = make_generator(sampling, self.lm.device)
        self.waiting.append(seq)
        return seq

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def run(self, progress=None) -> list[Sequence]:
        """Step until every queued request is done; return them in seq_id order."""
        while self.has_work():
            outs = self.step()
            if progress is not None:
                progress(sum(o.finished for o in outs))
        return sorted(self.finished, key=lambda s: s.seq_id)

    def abort(self, seq: Sequence) -> None:
        """Drop a request wherever it is (a client went away) and free its blocks now."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.running:
            self.running.remove(seq)
            self._release(seq)
        else:
            return
        seq.finish_reason = "abort"
        seq.status = Status.DONE
        seq.history.append(Status.DONE)
        self.finished.append(seq)

    # --- one step ----------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        decoding = [s for s in self.running if s.status is Status.DECODING]
        admitted = self._admit()
        outputs: list[StepOutput] = []
        with use_paged_attention(self.lm.model):
            if admitted:
                outputs += self._prefill(admitted)
            if decoding:
                outputs += self._decode(decoding)
        self.n_steps += 1
        return outputs

    def _reserved_blocks(self) -> int:
        """Blocks the running sequences may still claim before they finish (worst case)."""
        return sum(_blocks_for(max_kv_tokens(len(s.prompt_ids), s.max_new_tokens), self.block_size)
                   - s.kv.n_blocks for s in self.running)

    def _admit(self) -> list[Sequence]:
        """FCFS: admit from the head of the queue while a slot, the prefill budget and the pool allow."""
        admitted, prefill_tokens = [], 0
        budget = self.allocator.n_free - self._reserved_blocks()
        while self.waiting and len(self.running) < self.max_running:
            seq = self.waiting[0]
            need = self._blocks_to_admit(seq)
            if need > budget or (admitted and prefill_tokens + len(seq.prompt_ids) > self.max_prefill_tokens):
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            budget -= need
            prefill_tokens += len(seq.prompt_ids)
            self._on_admit(seq)
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    # --- hooks for later phases ----------------------------------------------------------
    def _blocks_to_admit(self, seq: Sequence) -> int:
        """Free blocks `seq` must find to be admitted (here: its worst case, see `max_kv_tokens`)."""
        return _blocks_for(max_kv_tokens(len(seq.prompt_ids), seq.max_new_tokens), self.block_size)

    def _on_admit(self, seq: Sequence) -> None:
        """Give an admitted sequence its (empty) block table. Prefix caching maps cached blocks in here."""
        seq.kv = BlockTable(self.block_size)

    def _append_slots(self, seq: Sequence, n: int) -> list[int]:
        """Claim pool slots for `seq`'s next `n` tokens. Copy-on-write hooks in here."""
        return seq.kv.append_slots(self.allocator, n)

    # --- forward passes --------------------------------------------------------------
    def _block_tables(self, seqs: list[Sequence]) -> torch.Tensor:
        """[S, max_blocks] int32, each row a sequence's physical block ids, padded with 0."""
        width = max(s.kv.n_blocks for s in seqs)
        rows = [s.kv.block_ids + [0] * (width - s.kv.n_blocks) for s in seqs]
        return torch.tensor(rows, dtype=torch.int32, device=self.lm.device)

    def _paged_batch(self, seqs: list[Sequence], slots: list[int], is_decode: bool,
                     segments: list[Segment] | None = None) -> PagedBatch:
        """The attention metadata of one pass: where new K/V go, and every sequence's table and length
        (after this pass's writes: slots are claimed before the forward pass)."""
        dev = self.lm.device
        return PagedBatch(
            kv_store=self.allocator.kv_store,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=self._block_tables(seqs),
            seq_lens=torch.tensor([s.kv.n_filled for s in seqs], dtype=torch.int32, device=dev),
            is_decode=is_decode, segments=segments or [])

    def _prefill(self, seqs: list[Sequence]) -> list[StepOutput]:
        """All new prompts in one packed forward pass: input_ids [1, N]."""
        ids, positions, slots, segments = [], [], [], []
        for row, seq in enumerate(seqs):
            seq.move(Status.PREFILLING)
            new = seq.prompt_ids
            start_pos = seq.kv.n_filled  # > 0 only when a later phase mapped cached blocks in
            slots += self._append_slots(seq, len(new) - start_pos)
            segments.append(Segment(start=len(ids), length=len(new) - start_pos, context_len=start_pos, row=row))
            ids += new[start_pos:]
            positions += range(start_pos, len(new))
        dev = self.lm.device
        batch = self._paged_batch(seqs, slots, is_decode=False, segments=segments)
        last = torch.tensor([seg.start + seg.length - 1 for seg in segments], device=dev)
        logits = self._forward(torch.tensor([ids], device=dev), torch.tensor([positions], device=dev), batch,
                               logits_to_keep=last)[0]               # [S, V]
        return self._emit(seqs, logits)

    def _decode(self, seqs: list[Sequence]) -> list[StepOutput]:
        """Every decoding sequence's last token in one forward pass: input_ids [S, 1]."""
        # The token fed now is the last one sampled; its K/V is written this pass.
        slots = [self._append_slots(s, 1)[0] for s in seqs]
        dev = self.lm.device
        batch = self._paged_batch(seqs, slots, is_decode=True)
        ids = torch.tensor([[s.output_ids[-1]] for s in seqs], device=dev)            # [S, 1]
        positions = torch.tensor([[s.kv.n_filled - 1] for s in seqs], device=dev)     # [S, 1]
        logits = self._forward(ids, positions, batch)[:, -1]                            # [S, V]
        return self._emit(seqs, logits)

    @torch.inference_mode()
    def _forward(self, input_ids, position_ids, batch: PagedBatch, logits_to_keep=1) -> torch.Tensor:
        self.n_forward_passes += 1
        out = self.lm.model(input_ids=input_ids, position_ids=position_ids, paged=batch,
                            use_cache=False, logits_to_keep=logits_to_keep)
        return out.logits

    # --- sampling and retiring -----------------------------------------------------------
    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
        """One token per row; greedy rows in one argmax, sampled rows each with their own generator."""
        tokens = logits.float().argmax(-1)  # [S]; fp32 first: CPU argmax over bf16 is ~4x slower, same answer
        for i, seq in enumerate(seqs):
            if not seq.sampling.greedy:
                tokens[i] = sample(logits[i:i + 1], seq.sampling, self._generators[seq.seq_id])[0]
        # One copy to the host for the whole batch, after every row is picked (on a GPU each
        # read of a token is a wait for the stream, so sampled rows are not read one by one).
        return tokens.tolist()

    def _emit(self, seqs: list[Sequence], logits: torch.Tensor) -> list[StepOutput]:
        self.peak_blocks_used = max(self.peak_blocks_used, self.allocator.n_used)
        tokens = self._sample(seqs, logits)
        t = now(self.lm.device)
        outputs = []
        for seq, tok in zip(seqs, tokens):
            if seq.status is Status.PREFILLING:
                seq.move(Status.DECODING)
            done = seq.append_token(tok, self.lm.eos_token_ids, t)
            if done:
                self._finish(seq)
            outputs.append(StepOutput(seq, tok, done))
        return outputs

    def _finish(self, seq: Sequence) -> None:
        seq.move(Status.DONE)
        self.running.remove(seq)
        self._release(seq)
        self.finished.append(seq)

    def _release(self, seq: Sequence) -> None:
        """Give back a finished or aborted sequence's blocks. Prefix caching keeps them cached instead."""
        seq.kv.release(self.allocator)
        self._generators.pop(seq.seq_id, None)
