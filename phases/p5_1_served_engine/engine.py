"""`ServingEngine`: the whole engine line (4.7's engine), where a step that raises fails only its culprit.

A server steps one engine for every client at once, so an exception in a step (a kernel that trips on one
prompt's shape, a bad value that slipped past validation, a CUDA error) would otherwise fail every request
in it, and could leave blocks claimed by nobody. Validation (`SamplingParams`, `add()`) stops every known
cause before a request is queued; this is the second line, for what is left:

1. Outputs already made are kept: a step runs one forward pass, or several narrower ones while isolating,
   and tokens an earlier pass made are real, so they go out with the failure (`StepFailed.outputs`).
2. The failing pass names the suspects: the groups (requests) in it. One suspect is the culprit: it alone
   fails (`StepFailed.failed`). Several are rolled back (`_roll_back`) and the engine *isolates*: every
   forward pass runs at most `isolation_width` groups, half the suspects of the last failure. Each failure
   either halves the width or fails a request, so the search ends, after at most log2(suspects) + 1
   failed passes.
3. The isolation ends once every suspect has come through a pass in the roles it had in the pass that
   failed (prefilling a chunk, decoding, or both), or has finished.

The KV of a failed pass is never trusted: it is dropped, never swapped. A failure with no group to blame
(nothing running), or one that is no request's fault (a tensor-parallel worker died: `WorkerDied`), is raised
as it is: the caller must fail everything.
"""

from __future__ import annotations

import math
from bisect import bisect_left

from phases.p2_2_scheduler.sequence import Sequence, Status, StepOutput
from phases.p3_6_batched_engine.runner import Batch
from phases.p4_1_copy_on_write.engine import SequenceGroup
from phases.p4_4_preemption.engine import PREEMPTED
from phases.p4_5_speculative_decoding.engine import DEFAULT_NUM_SPECULATIVE_TOKENS, Verify
from phases.p4_7_tensor_parallel.engine import TensorParallelEngine
from phases.p4_7_tensor_parallel.workers import WorkerDied

# a group's roles in a forward pass: prefilling a chunk, decoding (verifying guesses too), or both
PREFILL_PASS, DECODE_PASS = "prefill", "decode"


class StepFailed(RuntimeError):
    """A step raised; the engine is consistent again. Deliver `outputs`, fail `failed`; `retried` carry on."""

    def __init__(self, error: BaseException, outputs: list[StepOutput], failed: list[SequenceGroup],
                 retried: list[SequenceGroup]):
        super().__init__(f"{type(error).__name__}: {error}")
        self.error = error
        self.outputs = outputs      # tokens made by the step's passes that succeeded
        self.failed = failed        # groups aborted for it (finish_reason "error")
        self.retried = retried      # groups rolled back, to be recomputed in narrower passes


class ServingEngine(TensorParallelEngine):
    """The served engine: phase 4.7's (speculating with 4.5's parts, across 4.7's workers, when asked), with
    failures isolated to their culprit, and a request's records forgotten once it is over (a server runs for
    days; a run's report reads them, a server never does)."""

    def __init__(self, lm, speculative=None, num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS,
                 draft_layers: int | None = None, **engine_kwargs):
        super().__init__(lm, speculative=speculative, num_speculative_tokens=num_speculative_tokens,
                         draft_layers=draft_layers, **engine_kwargs)
        self.isolation_width: int | None = None   # while isolating: groups per forward pass at most
        self.suspects: dict[SequenceGroup, frozenset[str] | None] = {}  # group -> roles to come through a pass in
        self.n_step_failures = 0
        self.n_groups_failed = 0
        self.n_groups_retried = 0
        self._made: list[StepOutput] = []          # outputs of the step in flight, pass by pass
        self._unrun: list[SequenceGroup] = []      # groups of this step's narrower passes that have not run yet
        self.in_pass: dict[SequenceGroup, frozenset[str]] | None = None  # groups in the pass running now, their roles

    # --- the step, and what a failure leaves --------------------------------------------
    def step(self) -> list[StepOutput]:
        self._made, self._unrun = [], []
        try:
            return super().step()
        except WorkerDied:
            raise                          # the engine's fault, not a request's: nothing to isolate
        except Exception as error:
            raise self._recover(error) from error
        finally:
            self._made, self._unrun, self.in_pass = [], [], None

    def _recover(self, error: Exception) -> StepFailed:
        """Put the engine back together after `error`; return the StepFailed that says what became of whom."""
        self.n_step_failures += 1
        in_pass = self.in_pass or dict.fromkeys(self._groups(self.running))   # no pass running: anyone, any role
        self.kv.copies.discard()           # copies for a pass that never ran: their blocks go back below
        involved = sorted((g for g in in_pass if not g.done), key=lambda g: g.request_id)
        if not involved:
            raise error                    # nothing to blame: the caller fails everything
        failed, retried = (involved, []) if len(involved) == 1 else ([], involved)
        unrun = [g for g in self._unrun if g not in in_pass and not g.done]   # claimed slots never written
        for group in retried + unrun:
            self._roll_back(group)
        for group in failed:
            self._fail(group)
        self.n_groups_failed += len(failed)
        self.n_groups_retried += len(retried) + len(unrun)
        if retried:                        # several suspects (one alone is the culprit, failed above)
            width = math.ceil(len(involved) / 2)   # a narrower pass that fails again halves it, down to one
            self.isolation_width = width if self.isolation_width is None else min(self.isolation_width, width)
            self.suspects.update({g: in_pass[g] for g in retried})
        else:
            self._end_isolation()          # the culprit failed alone: a new round
        return StepFailed(error, list(self._made), failed, retried + unrun)

    def _groups(self, seqs) -> list[SequenceGroup]:
        """The distinct groups of `seqs`, in arrival order."""
        groups = {self.group_of(s): None for s in seqs}
        return sorted(groups, key=lambda g: g.request_id)

    def _roll_back(self, group: SequenceGroup) -> None:
        """Take `group` off the pool and back to the waiting queue, to be admitted and recomputed later.

        It uses what phase 4.4 built for preemption: the group's blocks go back to the pool (full blocks stay in
        the prefix cache: passes that succeeded wrote them), and its sequences go back to the waiting queue at
        their arrival position. A sequence with outputs is PREEMPTED and recomputed (prompt + outputs in one
        prefill; nothing is sampled or streamed twice). A request that had made nothing is un-admitted: its
        samples are un-forked (phase 4.1's `unfork`) and its parent is WAITING again, its random stream started
        afresh, so a seeded request still draws what it would have drawn. Seeded samples need nothing more:
        each draw is keyed on (seed, token index), not taken from a generator's state, so a pass whose sampling
        raised part-way leaves nothing drawn behind. (With speculation on, which guesses a step checks changes
        which token a draw picks, so a seeded request's tokens may differ, distributed the same.)"""
        if any(s.output_ids for s in group.seqs):
            members = [s for s in group.seqs if s in self.running]
            for s in members:
                self._take_back(s, PREEMPTED)   # recomputed from prompt + outputs when admitted again
        else:  # it made nothing yet: un-admit it, as if it had never been admitted
            if group.forked:
                self.unfork(group)
            parent = group.seqs[0]
            self._take_back(parent, Status.WAITING)
            self.sampler.forget(parent)                # its random stream starts afresh, from its seed
            members = [parent]
        rids = [self.group_of(s).request_id for s in self.waiting]
        i = bisect_left(rids, group.request_id)        # its arrival position: ahead of every later request
        for s in reversed(members):
            self.waiting.insert(i, s)

    def _take_back(self, seq: Sequence, status: Status) -> None:
        """Release `seq`'s blocks and slot and set its status: an undo, not one of the state machine's moves."""
        if seq in self.running:
            self.running.remove(seq)
        if seq.kv is not None:
            self.kv.free(seq)
        seq.status = status
        seq.history.append(status)

    def _fail(self, group: SequenceGroup) -> None:
        """Abort the culprit: every block and slot back, every member DONE with finish_reason "error"."""
        live = [s for s in group.seqs if s.status is not Status.DONE]
        self.abort_group(group)
        for s in live:
            s.finish_reason = "error"

    # --- the passes of a step: one, or narrower ones while isolating ---------------------------
    def run_batch(self, batch: Batch) -> list[StepOutput]:
        """Phase 3.6's pass (with speculation, its runner checks the guesses); while isolating, one pass per
        `isolation_width` groups (in arrival order, a group's members together), each a slice of the step's
        batch: the narrower passes share its one token budget. Should one fail, the groups of the passes not
        yet run (`_unrun`) are rolled back too: they claimed slots that hold nothing."""
        if not self.isolating:
            return self._watched(batch)
        groups = self._groups(batch.seqs)
        narrow = [set(groups[i:i + self.isolation_width]) for i in range(0, len(groups), self.isolation_width)]
        outputs = []
        for k, window in enumerate(narrow):
            self._unrun = [g for later in narrow[k + 1:] for g in later]
            part = Batch(chunks=[c for c in batch.chunks if self.group_of(c.seq) in window])
            for seq, slot in zip(batch.decode, batch.decode_slots):
                if self.group_of(seq) in window:
                    part.decode.append(seq)
                    part.decode_slots.append(slot)
            outputs += self._watched(part)
        return outputs

    def _watched(self, batch: Batch) -> list[StepOutput]:
        """Run one forward pass, noting who is in it and in what role (the suspects, should it raise)."""
        roles: dict[SequenceGroup, set[str]] = {}
        for c in batch.chunks:
            roles.setdefault(self.group_of(c.seq), set()).add(DECODE_PASS if isinstance(c, Verify) else PREFILL_PASS)
        for s in batch.decode:
            roles.setdefault(self.group_of(s), set()).add(DECODE_PASS)
        self.in_pass = {g: frozenset(r) for g, r in roles.items()}
        outputs = super().run_batch(batch)
        self._made += outputs   # kept, should a later pass of this step fail
        self._cleared(self.in_pass)
        self.in_pass = None
        return outputs

    def _cleared(self, roles: dict[SequenceGroup, frozenset[str]]) -> None:
        """Suspects in a pass that succeeded are cleared if they were in every role they failed in; none left:
        isolation ends."""
        if not self.isolating:
            return
        for group, now_in in roles.items():
            if group in self.suspects and (self.suspects[group] is None or self.suspects[group] <= now_in):
                del self.suspects[group]
        for group in [g for g in self.suspects if g.done]:
            del self.suspects[group]
        if not self.suspects:
            self._end_isolation()

    def _end_isolation(self) -> None:
        self.isolation_width = None
        self.suspects.clear()

    @property
    def isolating(self) -> bool:
        return self.isolation_width is not None

    # --- a server runs for days: a request's records go once it is over ------------------------
    def group_or_none(self, seq) -> SequenceGroup | None:
        return self._group_of.get(seq.seq_id)

    def forget(self, group: SequenceGroup) -> None:
        gone = {id(s) for s in group.seqs}
        for seq in group.seqs:
            self._group_of.pop(seq.seq_id, None)
            self.waited_for_blocks.discard(seq.seq_id)
        self.sequences = [s for s in self.sequences if id(s) not in gone]  # the ones still in flight: a short list
        if group in self.groups:
            self.groups.remove(group)
        self.suspects.pop(group, None)
