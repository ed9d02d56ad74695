"""`BeamSearchEngine`: beam search whose k beams share KV blocks, with a sharing pattern that changes every step.

A beam-search request of width k runs as a group of k *beam slots* (Sequence
objects that stay in the engine's running list). Every step:

  1. the engine's ordinary decode pass feeds each live beam its last token, in
     the same batched forward pass as every other running sequence (other beam
     requests, parallel samples, plain requests);
  2. `BeamSearch.step` (beam.py) picks the k best continuations; beam slot i
     continues from parent beam j = `parents[i]` with one more token;
  3. slot i gets `fork(parent j's table)` (`fork_kv`, as a sample forks
     its parent in phase 4.1): the new beams are aliases of their parents,
     refcounts counting how many children each parent has;
  4. the old tables are released. A block held only by beams that were not
     chosen drops to refcount 0 and is back on the free list right away; a
     block of a parent with two children is now shared by both.

The next decode pass writes each beam's new token. A beam whose last block is
shared with a sibling copies that one block first (phase 4.1's copy-on-write);
every earlier block stays shared for as long as the beams that hold it live.
That is the paper's Fig. 9: a tree of beams sharing their common history,
pruned and re-forked every step, with at most one block copy per beam per step.
When the search stops (HF's rule, see beam.py), slot i holds the i-th best
finished hypothesis: `group.best` is slot 0.
"""

from __future__ import annotations

import torch

from common.clock import now
from common.sampling import GREEDY
from phases.p2_2_scheduler.sequence import Sequence, Status, StepOutput
from phases.p3_2_block_table.block_table import BlockTable
from phases.p4_1_copy_on_write.engine import SequenceGroup, SharingEngine
from phases.p4_2_beam_search.beam import BeamSearch, Hypothesis


class BeamGroup(SequenceGroup):
    """A beam-search request: `n` is the beam width, `seqs` the beam slots, `search` the scores."""

    def __init__(self, *args, search: BeamSearch, **kwargs):
        super().__init__(*args, **kwargs)
        self.search = search

    @property
    def hypotheses(self) -> list[Hypothesis]:
        """Finished hypotheses, best first (final once `done`)."""
        return self.search.hypotheses

    @property
    def best(self) -> list[int]:
        """Token ids of the best finished hypothesis (what HF generate(num_beams=k) returns)."""
        if not self.done:
            raise RuntimeError(f"beam request {self.request_id} is still running")
        return list(self.hypotheses[0].token_ids)


class BeamSearchEngine(SharingEngine):
    def add_beam_search(self, prompt: str | list[int], max_new_tokens: int, beam_width: int = 4,
                        length_penalty: float = 1.0, early_stopping: bool | str = False,
                        arrival: float | None = None) -> BeamGroup:
        """Queue a beam-search request (text or token ids); returns its group (`group.best` once `group.done`)."""
        search = BeamSearch(beam_width, max_new_tokens, self.lm.eos_token_ids, length_penalty, early_stopping)
        seq = self.new_request(prompt, max_new_tokens, GREEDY, False, arrival, beam_width)
        return self.queue_group(BeamGroup(self._next_request_id, seq.prompt, seq.prompt_ids, beam_width, max_new_tokens,
                                          GREEDY, [seq], search=search))

    def emit(self, seqs: list[Sequence], logits: torch.Tensor) -> list[StepOutput]:
        """Beam rows go to their group's search; every other row is sampled as before.

        A search step needs every live beam's logits at once. The prompt is prefilled once, as beam 0 (in
        chunks, perhaps: phase 3.8), and its last chunk's row opens the search; from then on the beams only
        decode, and every step's pass carries one decode row for each of them."""
        beam_rows: dict[BeamGroup, list[int]] = {}
        other_rows = []
        for row, seq in enumerate(seqs):
            group = self.group_of(seq)
            if isinstance(group, BeamGroup):
                beam_rows.setdefault(group, []).append(row)
            else:
                other_rows.append(row)
        outputs = []
        if other_rows:
            outputs += super().emit([seqs[r] for r in other_rows], logits[other_rows])
        for group, rows in beam_rows.items():
            outputs += self._beam_step(group, [seqs[r] for r in rows], logits[rows])
        return outputs

    def _beam_step(self, group: BeamGroup, beams: list[Sequence], logits: torch.Tensor) -> list[StepOutput]:
        # The search expects its live beams in its own order (best first): slot order.
        order = sorted(range(len(beams)), key=lambda i: group.seqs.index(beams[i]))
        beams, logits = [beams[i] for i in order], logits[order]
        parents = group.search.step(logits)
        t = now(self.lm.device)
        if not group.forked:  # the prompt was just prefilled: open slots 1..k-1 (their tables come below)
            for i in range(1, group.n):
                self.new_member(group, beams[0], i)
        for slot in group.seqs:
            if slot.status is Status.PREFILLING:
                slot.move(Status.DECODING)
        if group.search.done:
            return self._finish_beams(group, beams, t)
        # Slot i continues beam parents[i]: its table becomes a fork of the parent's (every fork is
        # taken before any old table is released, so a block both generations hold stays owned).
        self.fork_kv(group.seqs, [beams[p] for p in parents])
        outputs = []
        for slot, tokens in zip(group.seqs, group.search.running_tokens):
            slot.output_ids = list(tokens)
            slot.timing.token(t)
            outputs.append(StepOutput(slot, tokens[-1], False))
        return outputs

    def fork_kv(self, seqs: list[Sequence], parents: list[Sequence]) -> None:
        """seqs[i] continues parents[i]: its table becomes a fork of the parent's (one more owner per block,
        nothing copied), its old table, if any, is released. Every fork is taken before any old table is
        released, so a block held by both generations never touches the free list; if one fork fails, the
        forks taken so far are released and nothing has changed."""
        tables: list = []
        try:
            for p in parents:
                tables.append(self.kv.fork(p))
        except Exception:
            for table in tables:
                table.release(self.allocator)
            raise
        for seq, table in zip(seqs, tables):
            if seq.kv is not None:
                seq.kv.release(self.allocator)
            seq.kv = table

    def _finish_beams(self, group: BeamGroup, beams: list[Sequence], t: float) -> list[StepOutput]:
        """The search stopped: slot i takes the i-th best hypothesis; every slot's blocks go back."""
        for slot in group.seqs:
            if slot.kv is None:  # a slot opened this very step, never given a table
                slot.kv = BlockTable(self.block_size)
        outputs = []
        for i, slot in enumerate(group.seqs):
            hyp = group.hypotheses[i] if i < len(group.hypotheses) else None
            slot.output_ids = list(hyp.token_ids) if hyp else []
            slot.finish_reason = hyp.finish_reason if hyp else "pruned"
            slot.timing.token(t)
            self.finish(slot)
            outputs.append(StepOutput(slot, slot.output_ids[-1] if slot.output_ids else -1, True))
        return outputs
