"""`SharingEngine`: parallel sampling, n samples of one prompt decoding over ONE copy of its KV blocks.

A request may now ask for `n` samples of the same prompt (`add_group(..., n=k)`;
`add()` is a request of one, and still returns its one Sequence). Phase 3.10's
engine would prefill the prompt n times and store its K/V n times. Here:

  1. the prompt is prefilled ONCE, as one sequence (the group's sample 0),
     in one pass or in chunks over several (phase 3.8);
  2. right after the pass of its last chunk, the group forks: samples 1..n-1 get block
     tables that list the parent's blocks (refcount n each, nothing copied) and
     every sample draws its first token from the same prefill logits, each
     with its own seed (seed + sample index, so a fixed seed reproduces);
  3. at the first decode step each sample writes its first token's K/V. If the
     prompt ended mid-block, that block is shared and partly filled: the first
     n-1 writers each copy it to a fresh block (copy-on-write) and the last
     one, now its only owner, writes in place. Full prompt blocks are never
     written again, so they stay shared until the last sample finishes.

A step's copies run as one indexed copy at the end of `schedule()`, before the pass writes (`CowKV`,
kv.py). Admission (`GroupWorstCaseAdmission`): n free slots, and the group's worst case with its full
prompt blocks counted once.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, replace

import torch

from common.clock import SeqTiming
from common.sampling import GREEDY, SamplingParams
from phases.p2_2_scheduler.sequence import Sequence, Status, StepOutput
from phases.p3_6_batched_engine.engine import WorstCaseAdmission
from phases.p3_10_cuda_graphs.engine import StaticDecodeEngine
from phases.p4_1_copy_on_write.block_ops import blocks_held
from phases.p4_1_copy_on_write.kv import CowKV, worst_case_blocks


@dataclass(eq=False)  # identity: a group is one request, even if two have equal fields
class SequenceGroup:
    """One request: a prompt and the `n` sequences generated from it (here, samples)."""
    request_id: int
    prompt: str
    prompt_ids: list[int]
    n: int
    max_new_tokens: int
    sampling: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)  # [parent] until the prefill, then n

    @property
    def forked(self) -> bool:
        return len(self.seqs) == self.n

    @property
    def done(self) -> bool:
        return all(s.status is Status.DONE for s in self.seqs)

    @property
    def live(self) -> list[Sequence]:
        """Members still holding blocks (admitted and not finished)."""
        return [s for s in self.seqs if s.status in (Status.PREFILLING, Status.DECODING)]

    def index(self, seq: Sequence) -> int:
        """Which member `seq` is: sample i (the response's choices[i])."""
        return next(i for i, s in enumerate(self.seqs) if s is seq)

    @property
    def outputs(self) -> list[list[int]]:
        """Generated token ids of each member, in member order."""
        return [list(s.output_ids) for s in self.seqs]


class GroupWorstCaseAdmission(WorstCaseAdmission):
    """Phase 3.6's rule for requests of n sequences: n free slots, and the group's worst case in blocks."""

    def can_admit(self, seq: Sequence, blocks_left: int) -> bool:
        e = self.engine
        return e.group_of(seq).n <= e.n_free_slots - e.slots_promised and super().can_admit(seq, blocks_left)

    def blocks_to_admit(self, seq: Sequence) -> int:
        """The group's worst case, `worst_case_blocks(request, n, block_size)` =
        `full_prompt_blocks + n * (blocks_for(worst_case_tokens(request)) - full_prompt_blocks)`: each sample's
        own copy of the partial block plus its output. `blocks_promised` sets the same aside for a running
        group."""
        return self.engine.kv.blocks_to_admit(seq, self.engine.group_of(seq).n)

    def blocks_promised(self) -> int:
        """Blocks the running groups may still claim: the worst case of their members minus the distinct
        blocks they hold (a group admitted but not forked yet counts its n samples to come)."""
        e = self.engine
        live: dict[SequenceGroup, list[Sequence]] = defaultdict(list)
        for s in e.running:
            live[e.group_of(s)].append(s)
        promised = 0
        for group, members in live.items():
            width = len(members) if group.forked else group.n
            held, _ = blocks_held([s.kv for s in members if s.kv is not None])
            promised += max(0, worst_case_blocks(group, width, e.block_size) - held)
        return promised


class SharingEngine(StaticDecodeEngine):
    """Phase 3.10's engine with requests of n sequences over shared blocks: its KV part `CowKV`, its admission
    `GroupWorstCaseAdmission`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.groups: list[SequenceGroup] = []        # every request added, in order
        self._group_of: dict[int, SequenceGroup] = {}  # seq_id -> its request
        self._next_request_id = 0

    def make_kv(self) -> CowKV:
        return CowKV(self.allocator)

    def make_admission(self) -> GroupWorstCaseAdmission:
        return GroupWorstCaseAdmission(self)

    # --- requests ----------------------------------------------------------------
    def add_group(self, prompt: str | list[int], max_new_tokens: int, sampling: SamplingParams = GREEDY,
                  ignore_eos: bool = False, arrival: float | None = None, *, n: int) -> SequenceGroup:
        """Queue a request for `n` samples of one prompt; returns its group (its `seqs` fill in at prefill)."""
        seq = self.new_request(prompt, max_new_tokens, sampling, ignore_eos, arrival, n)
        group = SequenceGroup(self._next_request_id, seq.prompt, seq.prompt_ids, n, max_new_tokens, sampling, [seq])
        return self.queue_group(group)

    def new_request(self, prompt, max_new_tokens: int, sampling: SamplingParams, ignore_eos: bool,
                    arrival: float | None, n: int) -> Sequence:
        """The first sequence of a checked request of `n` sequences, not queued yet (a refused request leaves
        no trace): `n` fits the running set, every sample's seed is one torch takes, and the worst case of
        the n sequences fits the whole pool."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an integer >= 1, got {n!r}")
        if n > self.max_running:
            raise ValueError(f"a group of {n} sequences cannot run under max_running={self.max_running}")
        seq = self.new_sequence(prompt, max_new_tokens, sampling, ignore_eos, arrival)  # checked, not queued
        sampling.validate(n_samples=n)  # sample i seeds with seed + i: the fork must never meet a seed torch refuses
        need = worst_case_blocks(seq, n, self.block_size)
        if need > self.allocator.n_blocks:
            raise ValueError(f"{n} sequences of {len(seq.prompt_ids)} prompt + {max_new_tokens} new tokens need "
                             f"up to {need} blocks of {self.block_size} tokens, but the whole pool has "
                             f"{self.allocator.n_blocks}")
        return seq

    def queue(self, seq: Sequence) -> None:
        """A checked request of one sequence (phase 3.6's `add`) is queued as a group of one."""
        self.queue_group(SequenceGroup(self._next_request_id, seq.prompt, seq.prompt_ids, 1, seq.max_new_tokens,
                                       seq.sampling, [seq]))

    def queue_group(self, group: SequenceGroup) -> SequenceGroup:
        """Queue a new request (its `request_id` the next one): its first sequence joins the waiting queue."""
        seq = group.seqs[0]
        super().queue(seq)
        self._next_request_id += 1
        self.groups.append(group)
        self._group_of[seq.seq_id] = group
        return group

    def group_of(self, seq: Sequence) -> SequenceGroup:
        """The request a sequence belongs to (e.g. for a StepOutput)."""
        return self._group_of[seq.seq_id]

    def abort_group(self, group: SequenceGroup) -> None:
        """Drop every member of a request, wherever it is, freeing its blocks now."""
        for seq in list(group.seqs):
            self.abort(seq)

    # --- admission: a group needs n slots, its shared blocks count once (`GroupWorstCaseAdmission`) ------
    @property
    def slots_promised(self) -> int:
        """Slots the running groups not forked yet will take at their fork (a group's prefill may take
        several steps)."""
        groups = {self.group_of(s) for s in self.running}
        return sum(g.n - len(g.seqs) for g in groups if not g.forked)

    # --- schedule: the step's copies run before its pass writes ------------------------------------
    def schedule(self):
        batch = super().schedule()
        self.kv.before_pass()      # every copy decided while claiming slots, in one indexed copy
        return batch

    def block_usage(self) -> tuple[int, int]:
        """(blocks the running sequences hold, blocks they would hold if nothing were shared)."""
        return blocks_held([s.kv for s in self.running if s.kv is not None])

    @property
    def n_copied(self) -> int:
        """Blocks copied by copy-on-write so far."""
        return self.kv.copies.n_copied

    @property
    def copies(self):
        return self.kv.copies

    # --- forking a group after its prefill ----------------------------------------------
    def emit(self, seqs: list[Sequence], logits: torch.Tensor) -> list[StepOutput]:
        """A group's parent just prefilled: fork its samples, each sampling from the parent's logits row."""
        members, rows = [], []
        for row, seq in enumerate(seqs):
            group = self.group_of(seq)
            forked = [] if group.forked else self.fork_group(group)
            members += [seq] + forked
            rows += [row] * (1 + len(forked))
        if len(members) != len(seqs):
            logits = logits[rows]  # [n_members, V]: one row per sample, shared rows repeated
        return super().emit(members, logits)

    def fork_group(self, group: SequenceGroup) -> list[Sequence]:
        """Samples 1..n-1 of a freshly prefilled group, sharing every block of sample 0.

        All or nothing: if a sample or its table cannot be made, the samples made so far are taken back
        (`unfork`) and the error goes on; the group is its parent alone again, and no block leaks."""
        parent = group.seqs[0]
        try:
            children = [self.new_member(group, parent, i) for i in range(1, group.n)]
            for child in children:
                child.kv = self.kv.fork(parent)     # one more owner of each of the parent's blocks
        except Exception:
            self.unfork(group)
            raise
        return children

    def unfork(self, group: SequenceGroup) -> None:
        """Take back every member but the parent (sample 0): slot, table and records."""
        for child in group.seqs[1:]:
            if child.kv is not None:
                self.kv.free(child)
            if child in self.running:
                self.running.remove(child)
            self.sampler.forget(child)
            self._group_of.pop(child.seq_id, None)
            self.sequences.remove(child)
        del group.seqs[1:]

    def new_member(self, group: SequenceGroup, parent: Sequence, index: int) -> Sequence:
        """A running sequence of `group` that starts where `parent` is (same state and tokens; no table yet).
        Sample i draws with seed + i (sample 0 is what a plain request would draw)."""
        sampling = parent.sampling if parent.sampling.seed is None else \
            replace(parent.sampling, seed=parent.sampling.seed + index)
        kind = type(parent)     # a member is the same kind of sequence as its parent
        child = kind(self._next_id, parent.prompt, parent.prompt_ids, parent.max_new_tokens, sampling,
                     parent.ignore_eos, status=parent.status, output_ids=list(parent.output_ids),
                     timing=SeqTiming(arrival=parent.timing.arrival), history=list(parent.history))
        self._next_id += 1
        self._group_of[child.seq_id] = group
        group.seqs.append(child)
        self.sequences.append(child)
        self.running.append(child)
        return child
