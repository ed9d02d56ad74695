"""Speculative decoding: guess each sequence's next k tokens cheaply, check them in one target pass, keep what agrees.

The loop stays phase 3.6's; with `speculative` set, three `make_` methods pick one more version of a part:
plan      `SpeculativePlan`: after 3.8's decode tokens and prefill chunks, a sequence with m guesses becomes a
          `Verify` chunk of m + 1 rows, in the budget left and truly free blocks only: a guess never preempts,
          evicts a cached block, delays an admission or runs past max_new_tokens.
runner    `VerifyingRunner`: the engine's runner runs the pass, then acceptance (acceptance.py) checks the
          guesses; rejected slots are cut (`truncate`) BEFORE the KV part hears the pass ran, so only accepted
          tokens reach the prefix cache.
sampler   `VerifyingSampler`: each kept row of a `Verify` chunk gets the token the check made; a sequence that
          made 3 tokens is in `emitting` 3 times, and update takes them in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from phases.p2_2_scheduler.sequence import Sequence
from phases.p3_6_batched_engine.runner import Batch
from phases.p3_8_chunked_prefill.engine import TokenBudget
from phases.p3_8_chunked_prefill.runner import PartialChunk
from phases.p4_4_preemption.engine import PreemptingEngine
from phases.p4_5_speculative_decoding.acceptance import Proposal, accept
from phases.p4_5_speculative_decoding.proposers import DraftProposer, NgramProposer, self_draft, truncate

SPECULATIVE_METHODS = ("ngram", "draft")
DEFAULT_NUM_SPECULATIVE_TOKENS = 4


@dataclass
class Verify(PartialChunk):
    """A sequence's last token and its m guesses: m + 1 rows; after the check, `made`: the tokens it kept."""
    proposal: Proposal = field(default_factory=lambda: Proposal([]))
    made: list[int] | None = None

    @property
    def last(self) -> bool:
        return True          # it emits: at least the target's own next token

    @property
    def ids(self) -> list[int]:
        return [self.seq.all_ids[-1]] + self.proposal.tokens

    @property
    def rows_kept(self) -> range:
        return range(self.length if self.made is None else len(self.made))


@dataclass
class SpecStats:
    n_verified: int = 0        # sequence-steps that verified a proposal
    proposed: int = 0          # tokens proposed and verified
    accepted: int = 0          # of those, kept
    emitted: int = 0           # tokens made by verifications (accepted + one per verification)
    n_verify_passes: int = 0   # target passes that carried at least one verification
    blocks_rolled_back: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else float("nan")


class SpeculativePlan(TokenBudget):
    """Phase 3.8's token budget; what decode tokens and prefill chunks leave of it verifies proposals."""

    def __init__(self, engine, max_num_batched_tokens: int, num_speculative_tokens: int):
        super().__init__(engine, max_num_batched_tokens)   # the engine's proposer guesses
        self.num_speculative_tokens = num_speculative_tokens

    def plan(self, batch: Batch) -> None:
        super().plan(batch)
        if batch.decode:
            self.speculate(batch)

    def speculate(self, batch: Batch) -> None:
        """Turn decoding sequences with a proposal into `Verify` chunks; the rest stay one-token decodes."""
        e = self.engine
        budget = self.max_num_batched_tokens - len(batch.decode) - sum(c.length for c in batch.chunks)
        room = {s.seq_id: s.max_new_tokens - len(s.output_ids) - 1 for s in batch.decode}   # past it: wasted
        asking = [s for s in batch.decode if room[s.seq_id] > 0]
        if budget <= 0 or not asking:
            return
        proposals = e.proposer.propose(asking, self.num_speculative_tokens, [e.sampler.seed(s) for s in asking])
        offered = {s.seq_id: p for s, p in zip(asking, proposals)}
        decode, slots = [], []
        for seq, slot in zip(batch.decode, batch.decode_slots):
            proposal = offered.get(seq.seq_id)
            m = 0 if proposal is None else min(len(proposal), room[seq.seq_id], budget, self.slots_free(seq))
            if m == 0:
                decode.append(seq)
                slots.append(slot)
                continue
            proposal = Proposal(proposal.tokens[:m], None if proposal.probs is None else proposal.probs[:m])
            batch.chunks.append(Verify(seq, seq.kv.n_filled - 1, m + 1, [slot] + e.kv.append_slots(seq, m),
                                       proposal))
            budget -= m
        batch.decode, batch.decode_slots = decode, slots

    def slots_free(self, seq: Sequence) -> int:
        """Positions `seq` can claim without preempting or evicting a cached block: its last block's, free blocks'."""
        allocator = self.engine.allocator      # phase 4.3's pool, caching on or off
        return seq.kv.capacity - seq.kv.n_filled + allocator.n_uncached_free * allocator.block_size


class VerifyingRunner:
    """The engine's runner, then the check: rejected guesses' slots go back; a `Verify` keeps a row per token made."""

    def __init__(self, runner, engine, stats: SpecStats):
        self.inner = runner           # the engine's own runner: it runs every pass
        self.engine = engine          # read only: its sampler's seeds, its pool, the model's EOS ids
        self.stats = stats
        self.decided: dict[int, list[int]] = {}    # seq_id -> the tokens this pass's check made for it

    # What the engine reports of its runner (and 3.10's emit reads after a decode-only static step): the inner's.
    n_forward_passes = property(lambda self: self.inner.n_forward_passes)
    n_prefill_tokens = property(lambda self: self.inner.n_prefill_tokens)
    n_chunks = property(lambda self: self.inner.n_chunks)
    n_mixed_passes = property(lambda self: self.inner.n_mixed_passes)
    ran_static = property(lambda self: self.inner.ran_static)
    buffers = property(lambda self: self.inner.buffers)

    def run(self, batch: Batch) -> torch.Tensor:
        """Logits [len(batch.emitting), V] once the check has run (a `Verify` chunk's rows are then its tokens')."""
        self.decided = {}
        logits = self.inner.run(batch)             # rows: each chunk's rows_kept in order, then the decode rows
        verifying = [c for c in batch.chunks if isinstance(c, Verify)]
        if not verifying:
            return logits
        spans, r = [], 0
        for c in batch.chunks:
            spans.append(range(r, r + len(c.rows_kept)))
            r += len(c.rows_kept)
        seqs = [c.seq for c in verifying]
        made = accept(seqs, [c.proposal for c in verifying],
                      logits[[i for c, rows in zip(batch.chunks, spans) if isinstance(c, Verify) for i in rows]],
                      [self.engine.sampler.seed(s) for s in seqs])
        st = self.stats
        st.n_verify_passes += 1
        st.n_verified += len(verifying)
        for c, tokens in zip(verifying, made):
            st.proposed += len(c.proposal)
            st.accepted += len(tokens) - 1
            c.made = until_stop(c.seq, tokens, self.engine.lm.eos_token_ids)
            # Slots past the last token and the kept guesses go back, before anything is published.
            self.stats.blocks_rolled_back += truncate(c.seq.kv, self.engine.allocator, c.start + len(c.made))
            self.decided[c.seq.seq_id] = c.made
        kept = [i for c, rows in zip(batch.chunks, spans) for i in rows[:len(c.rows_kept)]]
        return logits[kept + list(range(r, logits.shape[0]))]   # a Verify chunk's first rows stand for its tokens


def until_stop(seq: Sequence, tokens: list[int], eos_ids: set[int]) -> list[int]:
    """`tokens` up to the one that ends `seq` (EOS, or its last allowed token): what it takes of them."""
    tokens = tokens[:seq.max_new_tokens - len(seq.output_ids)]
    if not seq.ignore_eos:
        for i, token in enumerate(tokens):
            if token in eos_ids:
                return tokens[:i + 1]
    return tokens


class VerifyingSampler:
    """The engine's sampler, but a checked row gets the token the check made; a DONE sequence leaves the proposer."""

    def __init__(self, sampler, engine, stats: SpecStats):
        self.inner = sampler          # the engine's own sampler: it samples every other row
        self.engine = engine          # read only: its runner's `decided` (this pass's checked tokens), its proposer
        self.stats = stats

    def seed(self, seq: Sequence) -> int:
        return self.inner.seed(seq)

    def draw(self, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        return self.inner.draw(seqs, logits)    # 3.10's draw after a static (decode-only) step: nothing checked

    def sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
        decided = self.engine.runner.decided
        if not decided:
            return self.inner.sample(seqs, logits)
        plain = [i for i, s in enumerate(seqs) if s.seq_id not in decided]
        drawn = iter(self.inner.sample([seqs[i] for i in plain], logits[plain]) if plain else [])
        made = {seq_id: iter(tokens) for seq_id, tokens in decided.items()}
        self.stats.emitted += len(seqs) - len(plain)
        return [next(made[s.seq_id]) if s.seq_id in made else next(drawn) for s in seqs]

    def forget(self, seq: Sequence) -> None:
        self.inner.forget(seq)
        self.engine.proposer.release(seq)


class SpeculativeEngine(PreemptingEngine):
    """Phase 4.4's engine; decoding sequences verify up to k guesses per step (`speculative=None`: phase 4.4's)."""

    def __init__(self, lm, speculative=None, num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS,
                 draft_layers: int | None = None, **engine_kwargs):
        k = num_speculative_tokens     # checked before the engine takes its pool
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"num_speculative_tokens must be an integer >= 1, got {k!r}")
        # read by the make_ methods, during phase 3.6's constructor
        self.speculative, self.num_speculative_tokens = speculative, num_speculative_tokens
        self.spec_stats = SpecStats()
        super().__init__(lm, **engine_kwargs)
        if hasattr(speculative, "propose"):       # a proposer of the caller's, or "ngram", or a self-draft
            self.proposer = speculative
        elif speculative == "ngram":
            self.proposer = NgramProposer()
        elif speculative == "draft":          # of `draft_layers`, by default half the target's
            n = max(1, lm.n_layers // 2) if draft_layers is None else draft_layers
            self.proposer = DraftProposer(lm, self_draft(lm, n), n_blocks=self.allocator.n_blocks)
        elif speculative is not None:
            raise ValueError(f"speculative must be one of {SPECULATIVE_METHODS}, a proposer, or None; "
                             f"got {speculative!r}")

    def make_prefill(self) -> TokenBudget:
        if self.speculative is None:
            return super().make_prefill()
        return SpeculativePlan(self, self.max_num_batched_tokens, self.num_speculative_tokens)

    def make_sampler(self):
        sampler = super().make_sampler()
        return sampler if self.speculative is None else VerifyingSampler(sampler, self, self.spec_stats)

    def make_runner(self):
        runner = super().make_runner()
        return runner if self.speculative is None else VerifyingRunner(runner, self, self.spec_stats)

    def summary(self) -> dict:
        counted = dict(self.spec_stats.__dict__, acceptance_rate=self.spec_stats.acceptance_rate)
        return super().summary() | {f"spec_{k}": v for k, v in counted.items()}
