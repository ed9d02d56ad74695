"""`BatchedPagedEngine`: phase 3.3's paged continuous batching, with ONE forward pass per step for all sequences.

Phases 2.3 and 3.3 ran one forward pass per running sequence per step, because
each sequence's K/V sat behind its own cache object at its own length. Here
attention reads the pool by block table (attention.py), so sequences at
different lengths run together, and a sequence's KV state is now its bare
`BlockTable` (no cache object). Every step is

  1. admit   - phase 3.3's rule, unchanged: first come first served, a free
               slot, room in the pool for the newcomer's worst case;
  2. prefill - the newly admitted, packed into ONE forward pass
               ([1, sum of their new tokens]); each samples its first token;
  3. decode  - every sequence that was already decoding, in ONE forward pass
               (input_ids [S, 1], each at its own position); each samples one
               token; finished sequences give their blocks back at once.

Everything else is inherited: the queue and `add()`'s checks, the generators
and timings, `run()`, `_emit()`, the admission rule (`can_admit`,
`blocks_to_admit`, `blocks_promised`; this phase adds one condition: the
prompts admitted in one step share one prefill pass of at most
`max_prefill_tokens`) and the KV hooks (`new_kv` now returns a BlockTable).
There is no per-slot trace any more (phase 2's picture of slots over time);
`n_steps` and `n_forward_passes` count the work.

A prefill starts past whatever the table already holds (`_prefill_from`),
so a table that was handed blocks already written is not computed again.

A model whose attention the pool's attention cannot compute as the model
defines it (attention sinks, chunked or bidirectional attention) is refused
here, at construction, by name (attention.py: sliding windows, softcaps and
any scaling are honoured).
"""

from __future__ import annotations

import torch

from phases.p2_2_scheduler.sequence import Sequence, Status, StepOutput
from phases.p3_1_block_allocator.allocator import DEFAULT_BLOCK_SIZE, BlockAllocator
from phases.p3_2_block_table.block_table import BlockTable
from phases.p3_3_paged_cache.scheduler import PagedScheduler
from phases.p3_5_paged_attention.attention import (ATTN_NAME, PagedBatch, Segment, check_attention_supported,
                                                   use_paged_attention)

DEFAULT_MAX_RUNNING = 64
DEFAULT_MAX_PREFILL_TOKENS = 4096  # prompt tokens packed into one prefill pass at most


class BatchedPagedEngine(PagedScheduler):
    """Continuous batching over the paged pool: one packed prefill pass and one decode pass per step."""

    attention_name = ATTN_NAME   # the AttentionInterface entry the model runs under inside `step`

    def __init__(self, lm, max_running: int = DEFAULT_MAX_RUNNING, block_size: int = DEFAULT_BLOCK_SIZE,
                 n_blocks: int | None = None, allocator: BlockAllocator | None = None,
                 max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS):
        check_attention_supported(lm.model)   # before any memory is taken for the pool
        super().__init__(lm, max_running, block_size, n_blocks, allocator)
        self.max_prefill_tokens = max_prefill_tokens
        self.n_forward_passes = 0
        self.n_prefill_tokens = 0   # tokens whose K/V the prefill passes computed
        self.peak_blocks_used = 0   # most blocks held at once (read after each pass, before any release)

    # --- KV state: the block table itself ------------------------------------------------
    def new_kv(self, seq: Sequence) -> BlockTable:
        """An empty table: the prefill claims its blocks."""
        return BlockTable(self.block_size)

    def block_table(self, seq: Sequence) -> BlockTable:
        return seq.kv

    # --- admission: phase 3.3's rule, plus room in this step's prefill pass ---------------------
    def can_admit(self, seq: Sequence) -> bool:
        """Phase 3.3's rule, and `seq` fits in this step's forward pass."""
        return self._fits_prefill_pass(seq) and super().can_admit(seq)

    def _fits_prefill_pass(self, seq: Sequence) -> bool:
        """The prompts admitted this step fit in one prefill pass of at most max_prefill_tokens (the first
        always does)."""
        pending = sum(len(s.all_ids) for s in self.running if s.status is Status.PREFILLING)
        return not pending or pending + len(seq.all_ids) <= self.max_prefill_tokens

    def abort(self, seq: Sequence) -> None:
        """Drop a request wherever it is (a client went away); a running one gives its blocks back now."""
        if not self._withdraw(seq):
            return
        seq.finish_reason = "abort"
        seq.status = Status.DONE      # the one way out of any state, so not a `move`
        seq.history.append(Status.DONE)
        self.finished.append(seq)
        self._generators.pop(seq.seq_id, None)

    def _withdraw(self, seq: Sequence) -> bool:
        """Take `seq` out of the queue or the running set (its KV back); False if it is in neither."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.running:
            self.free_kv(seq)
            self._vacate(seq)
        else:
            return False
        return True

    # --- one step ----------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Admit, ONE prefill pass for the newly admitted, ONE decode pass for the rest, retire the finished."""
        self._fill_free_slots()
        with use_paged_attention(self.lm.model, self.attention_name):
            outputs = self._forward_passes()
        for out in outputs:
            if out.finished:
                self._retire(out.seq)
        self.n_steps += 1
        return outputs

    def _forward_passes(self) -> list[StepOutput]:
        """The forward passes of one step: the newly admitted in one packed prefill, then everyone else's decode."""
        prefilling = [s for s in self.running if s.status is Status.PREFILLING]
        decoding = [s for s in self.running if s.status is Status.DECODING]
        outputs: list[StepOutput] = []
        if prefilling:
            outputs += self._prefill(prefilling)
        if decoding:
            outputs += self._decode(decoding)
        return outputs

    # --- hooks for later phases ----------------------------------------------------------
    def _append_slots(self, seq: Sequence, n: int) -> list[int]:
        """Claim pool slots for `seq`'s next `n` tokens. Copy-on-write hooks in here."""
        return seq.kv.append_slots(self.allocator, n)

    def _prefill_from(self, seq: Sequence) -> int:
        """The first position whose K/V this prefill computes: what the table already holds (0 here;
        a later phase may have put a cached prefix in it)."""
        return seq.kv.n_filled

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
        """Every admitted sequence's tokens not in the pool yet, packed into ONE forward pass: input_ids [1, N]."""
        ids, positions, slots, segments = [], [], [], []
        for row, seq in enumerate(seqs):
            tokens = seq.all_ids          # the prompt (or, recomputed after a preemption, prompt + outputs)
            start = self._prefill_from(seq)
            slots += self._append_slots(seq, len(tokens) - start)
            segments.append(Segment(start=len(ids), length=len(tokens) - start, context_len=start, row=row))
            ids += tokens[start:]
            positions += range(start, len(tokens))
        self.n_prefill_tokens += len(ids)
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
        """One forward pass of many sequences; attention finds their K/V through `batch`. Returns logits."""
        self.n_forward_passes += 1
        out = self.lm.model(input_ids=input_ids, position_ids=position_ids, paged=batch,
                            use_cache=False, logits_to_keep=logits_to_keep)
        return out.logits

    def _emit(self, seqs: list[Sequence], logits: torch.Tensor) -> list[StepOutput]:
        self.peak_blocks_used = max(self.peak_blocks_used, self.allocator.n_used)
        return super()._emit(seqs, logits)
