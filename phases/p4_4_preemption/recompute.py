"""Recomputation: a preempted sequence prefills its prompt AND the tokens it already generated, in one pass.

A sequence preempted by recomputation lost every block. Its K/V at every
position can be rebuilt in one prefill pass, because all its tokens are
known: the prompt and the outputs so far (vLLM paper §4.5: "the tokens
generated at decoding can be concatenated with the original user prompt as a
new prompt"). Phase 3.5's packed prefill already handles a segment that
starts at any position; here the prefill feeds `seq.all_ids` instead of
`seq.prompt_ids` (the same thing for a new request), so a recomputed
sequence rides in the same pass as new prompts.

The last position's logits give the sequence's NEXT token, sampled with the
generator it has kept all along: nothing it already generated is sampled
again, and a streaming client receives only that new token.

The K/V of the last output token had never been computed (its decode pass is
the one that was preempted), so a re-prefill of p + o tokens recomputes
p + o - 1 tokens' worth of earlier work (`stats.tokens_recomputed`).

A group of samples (or beams) is recomputed together, in one pass. Its first
preempted member, the lead, prefills its whole sequence; every other member
forks the lead's FULL prompt blocks (written by the lead in this same pass:
every layer writes all new K/V before any segment attends) and prefills only
its own tail, from the prompt's partial last block on. So the prompt is
computed once and stored once again, as after the group's first prefill. Beams
also shared part of their generated history; that part is recomputed per
beam (admission already counted unshared tails, so it fits).

A mixin for `PreemptingEngine` (engine.py): it expects `self.stats` (a
`PreemptionStats`) and phase 3.5/4.1's engine attributes.
"""

from __future__ import annotations

import torch

from common.bench import now
from phases.p2_2_scheduler.sequence import Sequence, Status
from phases.p3_5_paged_attention.attention import Segment
from phases.p3_5_paged_attention.engine import StepOutput, _blocks_for


class RecomputePrefill:
    """Prefill that also re-prefills preempted sequences (put it before the engine in the bases)."""

    def _blocks_to_admit(self, seq: Sequence) -> int:
        """Blocks `seq`'s prefill takes now: its prompt (+ outputs if recomputed), less prompt blocks it forks."""
        need = _blocks_for(len(seq.all_ids), self.block_size)
        if self._lead(seq) not in (None, seq):
            need -= len(seq.prompt_ids) // self.block_size
        return need

    def _lead(self, seq: Sequence) -> Sequence | None:
        """For a preempted sample: its group's first preempted member, which recomputes the shared prompt."""
        if seq.status is not Status.PREEMPTED:
            return None
        return next(s for s in self.group_of(seq).seqs if s.status is Status.PREEMPTED)

    def _prefill(self, seqs: list[Sequence]) -> list[StepOutput]:
        """Phase 3.5's packed prefill, feeding `all_ids`: a new prompt, or a preempted prompt + its outputs."""
        leads = {self.group_of(s): self._lead(s) for s in seqs if s.status is Status.PREEMPTED}
        ids, positions, slots, segments = [], [], [], []
        recomputed = 0
        for row, seq in enumerate(seqs):
            recomputing = seq.status is Status.PREEMPTED
            seq.move(Status.PREFILLING)
            lead = leads.get(self.group_of(seq)) if recomputing else None
            if lead is not None and lead is not seq:
                self._fork_prompt(lead, seq)
            tokens = seq.all_ids
            start = seq.kv.n_filled  # > 0: cached prefix (p4_3) or prompt blocks forked from the lead
            slots += self._append_slots(seq, len(tokens) - start)
            segments.append(Segment(start=len(ids), length=len(tokens) - start, context_len=start, row=row))
            ids += tokens[start:]
            positions += range(start, len(tokens))
            if recomputing:
                # every token fed had been computed before, except the last output (its decode never ran)
                recomputed += len(tokens) - start - 1
                if lead is seq:
                    self.stats.n_recomputed += 1
        dev = self.lm.device
        batch = self._paged_batch(seqs, slots, is_decode=False, segments=segments)
        last = torch.tensor([seg.start + seg.length - 1 for seg in segments], device=dev)
        start_s = now(dev)
        logits = self._forward(torch.tensor([ids], device=dev), torch.tensor([positions], device=dev), batch,
                               logits_to_keep=last)[0]               # [S, V]
        if recomputed:
            self.stats.tokens_recomputed += recomputed
            self.stats.recompute_s += (now(dev) - start_s) * recomputed / len(ids)
        return self._emit(seqs, logits)

    def _fork_prompt(self, lead: Sequence, seq: Sequence) -> None:
        """Share the lead's full prompt blocks (it computes them in this same pass) instead of recomputing them."""
        n_shared = len(seq.prompt_ids) // self.block_size
        table = seq.kv
        have = table.n_filled // self.block_size  # blocks already mapped in (a prefix-cache hit), same as the lead's
        if have >= n_shared:
            return
        assert table.block_ids == lead.kv.block_ids[:have], "a prefix hit maps the lead's own prompt blocks"
        for b in lead.kv.block_ids[have:n_shared]:
            self.allocator.incref(b)  # one more owner: the lead writes them in this pass, nobody writes them later
        table.block_ids += lead.kv.block_ids[have:n_shared]
        table.n_filled = n_shared * self.block_size
