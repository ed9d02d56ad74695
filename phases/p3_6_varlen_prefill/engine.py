"""`ChunkedPrefillEngine`: phase 3.5's engine with ONE forward pass per step: decode tokens and prefill chunks together.

Phase 3.5 ran up to two passes a step (the newly admitted prompts packed into
one, every decoding sequence's next token in another) and attended each prompt
with its own SDPA call per layer. A long prompt arriving mid-stream took one
long prefill pass, and every running stream waited that long for its next token.
Here (vLLM's scheduler with chunked prefill):

token budget  every step runs ONE forward pass of at most `max_num_batched_tokens`
              tokens (vLLM's name). Decode tokens come first: one per decoding
              sequence, always all of them. What is left goes to prefill chunks:
              the sequences already part-way through their prefill first, then
              the newly admitted, in admission order. Each takes
              min(what it still needs, what is left); a prompt longer than that
              is prefilled over several steps, a chunk at a time.
mixed batch   the pass's row is [decode tokens | chunk | chunk | ...], `input_ids
              [1, N]` (attention.py): the decode rows run phase 3.5's paged decode
              kernel, the chunks ONE varlen prefill kernel per layer (kernel.py),
              each chunk reading its sequence's earlier tokens in place from the pool.
a chunk       computes positions start .. start + n - 1 of its sequence (`Chunk`);
              its blocks are claimed as it runs, so a partly prefilled sequence
              holds the blocks of the tokens it has, and `kv.n_filled` is how far
              it got. Only the chunk that ends the prompt keeps logits: the
              sequence's first token comes out in the step its last chunk runs.
              Until then it is PREFILLING, emits nothing, holds its slot.
admission     phase 3.3's rule (a free slot; the worst case of every running
              sequence, a partly prefilled one included, fits the pool), and
              room in this step's budget: the budget less the decode tokens and
              the rest of every prefill in flight must leave at least one token.
              `chunked_prefill=False` keeps prompts whole (the "before" for latency):
              a prompt that does not fit what is left waits, except that the first
              prompt of a step always goes, however long.

A step with no prefill work keeps phase 3.5's decode pass (input_ids [S, 1],
the same kernel), so steady decoding costs what it cost. Hooks for the later
engines: `_prefill_from(seq)` is asked once per prefill, for its first chunk (a
later phase may have mapped a cached prefix in); later chunks continue from
`kv.n_filled`. `_claim_chunk(chunk)` claims a chunk's slots as it is scheduled,
in admission order.
A chunk that does not end its prompt calls `_chunk_written(seq)` after the pass
(a no-op here; a prefix cache registers the blocks the chunk filled).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from phases.p2_2_scheduler.sequence import Sequence, Status, StepOutput
from phases.p3_1_block_allocator.allocator import DEFAULT_BLOCK_SIZE, BlockAllocator
from phases.p3_5_paged_attention.attention import Segment
from phases.p3_5_paged_attention.engine import DEFAULT_MAX_PREFILL_TOKENS, DEFAULT_MAX_RUNNING, BatchedPagedEngine
from phases.p3_6_varlen_prefill.attention import VARLEN_ATTN_NAME, MixedBatch
from phases.p3_6_varlen_prefill.ops import plan_prefill

# Tokens in one forward pass. Phase 3.5's prefill cap, so on a burst of prompts both engines pack the same
# prompts into a pass and a comparison sees the kernel, not the packing. Smaller budgets lower the latency
# a long prompt adds to running streams (prefill_bench measures it); larger ones give long prompts bigger passes.
DEFAULT_MAX_NUM_BATCHED_TOKENS = DEFAULT_MAX_PREFILL_TOKENS


@dataclass
class Chunk:
    """The next piece of one sequence's prefill, in this step's pass."""
    seq: Sequence
    start: int      # first position it computes: the pool already holds positions 0 .. start - 1
    length: int     # positions it computes
    slots: list[int] = field(default_factory=list)   # pool slots of those positions (claimed when scheduled)

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def last(self) -> bool:
        """It ends the prefill: its last row's logits give the sequence's next token."""
        return self.end == len(self.seq.all_ids)


class ChunkedPrefillEngine(BatchedPagedEngine):
    """Phase 3.5's engine: one mixed pass per step, prefill in chunks under a token budget, varlen prefill attention."""

    attention_name = VARLEN_ATTN_NAME

    def __init__(self, lm, max_running: int = DEFAULT_MAX_RUNNING, block_size: int = DEFAULT_BLOCK_SIZE,
                 n_blocks: int | None = None, allocator: BlockAllocator | None = None,
                 max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS, chunked_prefill: bool = True):
        if isinstance(max_num_batched_tokens, bool) or not isinstance(max_num_batched_tokens, int) \
                or max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be an int >= 1, got {max_num_batched_tokens!r}")
        # Phase 3.5's max_prefill_tokens keeps its meaning (the most prompt tokens one pass takes).
        super().__init__(lm, max_running, block_size, n_blocks, allocator, max_prefill_tokens=max_num_batched_tokens)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
        self.n_chunks = 0           # prefill chunks run (a prompt prefilled in one piece counts one)
        self.n_mixed_passes = 0     # passes that carried decode tokens AND prefill chunks
        self._prefill_started: set[int] = set()   # seq_ids whose first chunk has run (or is running)
        self._prefilling: dict[int, Sequence] = {}  # seq_id -> sequence admitted and not prefilled yet, in admission order

    # --- admission: room in this step's token budget -----------------------------------------------
    def budget_left(self) -> int:
        """Tokens this step's pass can still take: the budget, less one per decoding sequence and the rest
        of every prefill in flight (admitted this step or part-way through)."""
        used = 0
        for s in self.running:
            if s.status is Status.DECODING:
                used += 1
            elif s.status is Status.PREFILLING:
                used += len(s.all_ids) - s.kv.n_filled
        return self.max_num_batched_tokens - used

    def _fits_prefill_pass(self, seq: Sequence) -> bool:
        return self._fits_prefill_tokens(len(seq.all_ids))

    def _fits_prefill_tokens(self, n_tokens: int) -> bool:
        """Chunked: at least one token of the budget is left for a first chunk. Whole prompts: `n_tokens`
        fit what is left, or they are the only prefill of the step."""
        left = self.budget_left()
        if self.chunked_prefill:
            return left > 0
        # (only a prefill with tokens left to compute takes the budget)
        prefilling = any(s.status is Status.PREFILLING and s.kv.n_filled < len(s.all_ids) for s in self.running)
        return not prefilling or n_tokens <= left

    def _admit(self) -> Sequence:
        seq = super()._admit()
        self._prefilling[seq.seq_id] = seq
        return seq

    # --- one step: one pass --------------------------------------------------------------------
    def _forward_passes(self) -> list[StepOutput]:
        """ONE forward pass: every decode token and this step's prefill chunks (or phase 3.5's decode pass
        when no prefill is due)."""
        decoding = [s for s in self.running if s.status is Status.DECODING]
        chunks = self._schedule_chunks(self.max_num_batched_tokens - len(decoding))
        if chunks:
            return self._mixed_pass(chunks, decoding)
        return self._decode(decoding) if decoding else []

    def _schedule_chunks(self, budget: int, among: list[Sequence] | None = None) -> list[Chunk]:
        """The prefill chunks of one pass, `budget` tokens at most, handed out in admission order (a prefill
        in flight before a newcomer); each chunk's slots are claimed as it is scheduled. `among`: only these
        sequences' prefills (default: every running one)."""
        chunks: list[Chunk] = []
        allowed = set(self.running if among is None else among)
        prefilling = [s for s in self._prefilling.values() if s.status is Status.PREFILLING and s in allowed]
        for seq in prefilling:
            if budget <= 0 and (self.chunked_prefill or chunks):
                break
            start = self._chunk_start(seq)
            rest = len(seq.all_ids) - start
            length = min(rest, budget) if self.chunked_prefill else rest
            if chunks and length > budget:
                break          # a whole prompt that no longer fits waits for the next step (FCFS: nobody passes it)
            chunk = Chunk(seq, start, length)
            chunk.slots = self._claim_chunk(chunk)
            chunks.append(chunk)
            budget -= length
        return chunks

    def _claim_chunk(self, chunk: Chunk) -> list[int]:
        """Claim pool slots for `chunk`'s positions (before the pass; a later chunk of this pass may read them)."""
        if chunk.start != chunk.seq.kv.n_filled:
            raise RuntimeError(f"sequence {chunk.seq.seq_id}: chunk starts at {chunk.start} but the pool holds "
                               f"{chunk.seq.kv.n_filled} of its tokens")
        return self._append_slots(chunk.seq, chunk.length)

    def _chunk_start(self, seq: Sequence) -> int:
        """Where `seq`'s next chunk starts: for its first, `_prefill_from` (asked once per prefill); after
        that, where the last one ended."""
        if seq.seq_id not in self._prefill_started:
            self._prefill_started.add(seq.seq_id)
            return self._prefill_from(seq)
        return seq.kv.n_filled

    def _chunk_written(self, seq: Sequence) -> None:
        """Hook: the pass wrote a chunk of `seq` that does not end its prefill (so no token was emitted)."""

    def free_kv(self, seq: Sequence) -> None:
        self._end_prefill(seq)   # aborted (or later: preempted) part-way: start afresh
        super().free_kv(seq)

    def _end_prefill(self, seq: Sequence) -> None:
        self._prefill_started.discard(seq.seq_id)
        self._prefilling.pop(seq.seq_id, None)

    # --- the mixed pass -------------------------------------------------------------------------
    def _mixed_pass(self, chunks: list[Chunk], decoding: list[Sequence]) -> list[StepOutput]:
        """Decode tokens, then the chunks, packed into ONE forward pass: input_ids [1, D + sum of chunk lengths].
        Emits one token per decoding sequence and per sequence whose last chunk this is."""
        ids, positions, slots = [], [], []
        for seq in decoding:
            # The token fed is the last one sampled; its K/V is written this pass (phase 3.5's decode row).
            slots += self._append_slots(seq, 1)
            ids.append(seq.output_ids[-1])
            positions.append(seq.kv.n_filled - 1)
        cu, context = [0], []                          # chunk rows (from row D), and what precedes each chunk
        for c in chunks:
            slots += c.slots                           # claimed when the chunk was scheduled
            ids += c.seq.all_ids[c.start:c.end]
            positions += range(c.start, c.end)
            cu.append(cu[-1] + c.length)
            context.append(c.start)
        n_decode = len(decoding)
        batch = self._mixed_batch(decoding, chunks, slots, cu, context)
        # Logits only where a token is sampled: the last row of each chunk that ends its prompt, each decode row.
        finishing = [i for i, c in enumerate(chunks) if c.last]
        keep = [n_decode + cu[i + 1] - 1 for i in finishing] + list(range(n_decode))
        dev = self.lm.device
        logits = self._forward(torch.tensor([ids], device=dev), torch.tensor([positions], device=dev), batch,
                               logits_to_keep=torch.tensor(keep, dtype=torch.int64, device=dev))[0]   # [K, V]
        self.n_prefill_tokens += cu[-1]
        self.n_chunks += len(chunks)
        self.n_mixed_passes += bool(decoding)
        self.peak_blocks_used = max(self.peak_blocks_used, self.allocator.n_used)
        for c in chunks:
            if c.last:
                self._end_prefill(c.seq)
            else:
                self._chunk_written(c.seq)
        emitting = [chunks[i].seq for i in finishing] + decoding
        return self._emit(emitting, logits) if emitting else []

    def _mixed_batch(self, decoding: list[Sequence], chunks: list[Chunk], slots: list[int], cu: list[int],
                     context: list[int]) -> MixedBatch:
        """The pass's metadata: phase 3.5's (slots, one table row per sequence, lengths after the writes) with
        the decode/prefill split. cu and context are host lists, so the plan reads nothing back from a GPU."""
        dev = self.lm.device
        seqs = decoding + [c.seq for c in chunks]
        d = len(decoding)
        return MixedBatch(
            kv_store=self.allocator.kv_store,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=self._block_tables(seqs),
            seq_lens=torch.tensor([s.kv.n_filled for s in seqs], dtype=torch.int32, device=dev),
            is_decode=False,
            segments=[Segment(start=d + cu[i], length=c.length, context_len=c.start, row=d + i)
                      for i, c in enumerate(chunks)],
            n_decode=d,
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            context_lens=torch.tensor(context, dtype=torch.int32, device=dev),
            prefill_plan=plan_prefill(cu, context, device=dev))
