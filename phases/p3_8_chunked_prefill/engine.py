"""`ChunkedPrefillEngine`: phase 3.6's engine with ONE forward pass per step, decode tokens and prefill chunks
together (vLLM's scheduler with chunked prefill). It picks two new parts:

  prefill plan  `TokenBudget`: at most `max_num_batched_tokens` tokens a step, decode tokens first, then
                prefill chunks in admission order, each min(what it still needs, what is left)
  runner        `MixedRunner` (runner.py): the step's one mixed pass

`WholePromptEngine` (`WholePromptBudget`): the same step, prompts never cut (chunking's baseline).
"""

from __future__ import annotations

from phases.p2_2_scheduler.sequence import Status
from phases.p3_1_block_allocator.allocator import DEFAULT_BLOCK_SIZE
from phases.p3_6_batched_engine.engine import DEFAULT_MAX_PREFILL_TOKENS, DEFAULT_MAX_RUNNING, BatchedPagedEngine
from phases.p3_6_batched_engine.runner import Batch
from phases.p3_8_chunked_prefill.runner import MixedRunner, PartialChunk

# Tokens in one forward pass: phase 3.6's prefill cap, so on a burst of prompts both engines pack the same
# prompts into a pass. Smaller budgets cut the stall a long prompt adds to running streams.
DEFAULT_MAX_NUM_BATCHED_TOKENS = DEFAULT_MAX_PREFILL_TOKENS


def prefill_left(seq) -> int:
    """Tokens of `seq` still to prefill; 0 unless it is prefilling."""
    return len(seq.all_ids) - seq.kv.n_filled if seq.status is Status.PREFILLING else 0


class TokenBudget:
    """The prefill plan of one token budget per step: decode tokens first, then prefill chunks in what is left."""

    def __init__(self, engine, max_num_batched_tokens: int):
        self.engine = engine    # read only: its running set; `claim` takes each chunk's slots
        self.max_num_batched_tokens = max_num_batched_tokens

    def plan(self, batch: Batch) -> None:
        """Add the step's prefill chunks to `batch`, in admission order (a prefill in flight before a newcomer),
        slots claimed."""
        prefilling, budget = self.prefill_work()
        chunks = batch.chunks
        for seq in prefilling:
            rest = prefill_left(seq)
            if not rest:
                continue
            length = self.chunk_length(rest, budget, first=not chunks)
            if not length:
                break          # this prompt waits for the next step, and FCFS: nobody behind it passes it
            chunks.append(self.engine.claim(PartialChunk(seq, seq.kv.n_filled, length)))
            budget -= length

    def chunk_length(self, rest: int, budget: int, first: bool) -> int:
        """Tokens this pass takes of a prompt with `rest` still to prefill: as many as fit (0: it waits)."""
        return min(rest, max(budget, 0))

    def prefill_work(self) -> tuple[list, int]:
        """The running sequences still prefilling, and the budget less one token per decoding sequence."""
        running = self.engine.running
        prefilling = [s for s in running if s.status is Status.PREFILLING]
        return prefilling, self.max_num_batched_tokens - (len(running) - len(prefilling))

    def budget_left(self) -> int:
        """What admission may still use: the budget less the decode tokens and the rest of every prefill."""
        used = sum(1 if s.status is Status.DECODING else prefill_left(s) for s in self.engine.running)
        return self.max_num_batched_tokens - used

    def fits(self, n_tokens: int) -> bool:
        """At least one token of the budget is left for a first chunk."""
        return self.budget_left() > 0


class WholePromptBudget(TokenBudget):
    """The same budget with every prompt prefilled whole (vLLM with chunked prefill off): a prompt that does not
    fit what is left waits, except that a step's first prompt always goes, however long."""

    def chunk_length(self, rest: int, budget: int, first: bool) -> int:
        return rest if first or rest <= budget else 0

    def fits(self, n_tokens: int) -> bool:
        """`n_tokens` fit what is left of the budget, or they are the step's only prefill."""
        return not any(prefill_left(s) for s in self.engine.running) or n_tokens <= self.budget_left()


class ChunkedPrefillEngine(BatchedPagedEngine):
    """Phase 3.6's engine on two new parts: `TokenBudget` and `MixedRunner`."""

    def __init__(self, lm, max_running: int = DEFAULT_MAX_RUNNING, block_size: int = DEFAULT_BLOCK_SIZE,
                 n_blocks: int | None = None, max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS):
        # read by make_prefill, during phase 3.6's constructor; checked before any memory is taken for the pool
        if isinstance(max_num_batched_tokens, bool) or not isinstance(max_num_batched_tokens, int) \
                or max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be an int >= 1, got {max_num_batched_tokens!r}")
        self.max_num_batched_tokens = max_num_batched_tokens
        super().__init__(lm, max_running, block_size, n_blocks)

    def make_prefill(self) -> TokenBudget:
        return TokenBudget(self, self.max_num_batched_tokens)

    def make_runner(self) -> MixedRunner:
        return MixedRunner(self.lm, self.allocator)

    # what the runner counted
    n_chunks = property(lambda self: self.runner.n_chunks)
    n_mixed_passes = property(lambda self: self.runner.n_mixed_passes)


class WholePromptEngine(ChunkedPrefillEngine):
    """The same one-pass step with every prompt prefilled whole (`WholePromptBudget`)."""

    def make_prefill(self) -> WholePromptBudget:
        return WholePromptBudget(self, self.max_num_batched_tokens)
