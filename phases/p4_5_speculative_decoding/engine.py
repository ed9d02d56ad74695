"""`SpeculativeEngine`: guess a sequence's next k tokens cheaply, check them all in one target pass, keep what agrees.

A proposer (proposers.py) guesses up to k tokens per decoding sequence; the
target scores the last sampled token and the guesses in ONE pass; acceptance
(acceptance.py) keeps the guesses it agrees with plus one token of its own. A
step makes 1 to k + 1 tokens per sequence, all of them what the target alone
would make. Phase 4.4's engine, with one change per part it touches:

plan      `SpeculativePlan`, 3.8's token budget plus one rule: after the decode
          tokens and prefill chunks, a decoding sequence with m guesses becomes a
          `Verify` chunk of m + 1 rows (its last token, then the guesses), in the
          budget left and truly free blocks only: a guess never preempts, evicts a
          cached block, delays an admission or runs past max_new_tokens.
runner    unchanged: phase 3.8's mixed pass runs the chunk and keeps every row's
          logits (`rows_kept`). Decode-only steps keep phase 3.10's static path; a
          graph's decode kernel takes one query row per sequence, so a step with a
          verification is a mixed pass.
kv        the rejected guesses' slots are cut from the table, emptied blocks back
          to the pool (`truncate`), BEFORE the KV part hears the pass ran: only
          accepted tokens are ever published to the prefix cache. Copy-on-write
          happens on the real last token's write; the guesses land in that block,
          now private, or in fresh ones.

Refused: k < 1, a draft with another vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.clock import now
from phases.p2_2_scheduler.sequence import Sequence, Status, StepOutput
from phases.p3_6_batched_engine.runner import Batch, Chunk
from phases.p3_8_chunked_prefill.engine import TokenBudget
from phases.p4_4_preemption.engine import PreemptingEngine
from phases.p4_5_speculative_decoding.acceptance import Proposal, accept
from phases.p4_5_speculative_decoding.proposers import DraftProposer, NgramProposer, NoProposer, self_draft, truncate

SPECULATIVE_METHODS = ("ngram", "draft")
DEFAULT_NUM_SPECULATIVE_TOKENS = 4


@dataclass
class Verify(Chunk):
    """A decoding sequence's last token and its m proposed tokens: m + 1 rows, every row's logits kept."""
    proposal: Proposal = field(default_factory=lambda: Proposal([]))

    @property
    def last(self) -> bool:
        return True          # it emits: at least the target's own next token

    @property
    def ids(self) -> list[int]:
        return [self.seq.all_ids[-1]] + self.proposal.tokens

    @property
    def rows_kept(self) -> range:
        return range(self.length)


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

    def as_dict(self) -> dict:
        return dict(self.__dict__, acceptance_rate=self.acceptance_rate)


def make_proposer(lm, speculative, draft_layers: int | None, draft_blocks: int):
    """A proposer from a method name ("ngram", "draft": a self-draft of `draft_layers` layers, by default half
    the target's; None: `NoProposer`), or the given one."""
    if speculative is None:
        return NoProposer()
    if hasattr(speculative, "propose"):
        return speculative
    if speculative == "ngram":
        return NgramProposer()
    if speculative == "draft":
        n = max(1, lm.n_layers // 2) if draft_layers is None else draft_layers
        return DraftProposer(lm, self_draft(lm, n), n_blocks=draft_blocks)
    raise ValueError(f"speculative must be one of {SPECULATIVE_METHODS}, a proposer, or None; got {speculative!r}")


class SpeculativePlan(TokenBudget):
    """Phase 3.8's token budget; what decode tokens and prefill chunks leave of it verifies proposals."""

    def __init__(self, engine, max_num_batched_tokens: int, proposer, num_speculative_tokens: int):
        super().__init__(engine, max_num_batched_tokens)
        self.proposer = proposer
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
        proposals = self.proposer.propose(asking, self.num_speculative_tokens, [e.sampler.seed(s) for s in asking])
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
        """Positions `seq` can claim without preempting anyone or evicting a cached block: the rest of its last
        block, then the truly free blocks (a guess likely to be rejected is not worth a prefix-cache entry)."""
        allocator = self.engine.allocator
        free = getattr(allocator, "n_uncached_free", allocator.n_free)   # prefix caching off: n_free
        return seq.kv.capacity - seq.kv.n_filled + free * allocator.block_size


class SpeculativeEngine(PreemptingEngine):
    """Phase 4.4's engine; decoding sequences verify up to k proposed tokens per step (`speculative=None`: the
    plan stays phase 3.8's token budget, and nothing is proposed)."""

    def __init__(self, lm, speculative=None, num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS,
                 draft_layers: int | None = None, **engine_kwargs):
        k = num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"num_speculative_tokens must be an integer >= 1, got {k!r}")
        super().__init__(lm, **engine_kwargs)
        self.proposer = make_proposer(lm, speculative, draft_layers, self.allocator.n_blocks)
        self.num_speculative_tokens = k
        self.spec_stats = SpecStats()
        if speculative is not None:
            self.prefill = SpeculativePlan(self, self.prefill.max_num_batched_tokens, self.proposer, k)

    def retire(self, seq: Sequence) -> None:
        """Leaving the running set (finished, preempted for recomputation, aborted): the proposer's state goes."""
        super().retire(seq)
        self.proposer.release(seq)

    def close(self, seq: Sequence) -> None:
        """DONE from anywhere (a swapped-out sequence is aborted without retiring)."""
        super().close(seq)
        self.proposer.release(seq)

    # --- run: verify, roll the KV back, emit ---------------------------------------------------
    def run_batch(self, batch: Batch) -> list[StepOutput]:
        verifying = [c for c in batch.chunks if isinstance(c, Verify)]
        if not verifying:
            return super().run_batch(batch)
        logits = self.runner.run(batch)                  # rows: each chunk's rows_kept in order, then decode rows
        plain_rows, verify_rows, r = [], [], 0
        for c in batch.chunks:
            n = len(c.rows_kept)
            (verify_rows if isinstance(c, Verify) else plain_rows).extend(range(r, r + n))
            r += n
        plain_rows += range(r, r + len(batch.decode))
        seqs = [c.seq for c in verifying]
        new_tokens = accept(seqs, [c.proposal for c in verifying], logits[verify_rows],
                            [self.sampler.seed(s) for s in seqs])
        for c, tokens in zip(verifying, new_tokens):
            # Positions c.start .. c.start + len(tokens) - 1 hold real tokens (the last one and the kept
            # guesses); the rejected guesses' slots go, before anything is published.
            self.spec_stats.blocks_rolled_back += truncate(c.seq.kv, self.allocator, c.start + len(tokens))
        self.kv.written(batch.seqs)
        plain = [c.seq for c in batch.chunks if c.last and not isinstance(c, Verify)] + batch.decode
        outputs = self.emit(plain, logits[plain_rows]) if plain else []
        return outputs + self.take_tokens(seqs, [c.proposal for c in verifying], new_tokens)

    def take_tokens(self, seqs: list[Sequence], proposals: list[Proposal], new_tokens: list[list[int]]
                    ) -> list[StepOutput]:
        """Each sequence takes its new tokens in order (phase 3.6's update, one round per position); one that
        finishes part-way (EOS, max_new_tokens) drops the rest."""
        st = self.spec_stats
        st.n_verify_passes += 1
        st.n_verified += len(seqs)
        for p, tokens in zip(proposals, new_tokens):
            st.proposed += len(p)
            st.accepted += len(tokens) - 1
        t = now(self.lm.device)
        pending = list(zip(seqs, new_tokens))
        outputs: list[StepOutput] = []
        for j in range(max(len(tokens) for tokens in new_tokens)):
            pending = [(s, tokens) for s, tokens in pending if len(tokens) > j and s.status is not Status.DONE]
            outputs += self.update([s for s, _ in pending], [tokens[j] for _, tokens in pending], t)
        st.emitted += len(outputs)
        return outputs

    # --- what the speculation counted ----------------------------------------------------------------
    def summary(self) -> dict:
        out = super().summary()
        out.update({f"spec_{k}": v for k, v in self.spec_stats.as_dict().items()})
        return out
