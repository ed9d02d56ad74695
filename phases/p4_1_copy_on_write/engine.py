"""`SharingEngine`: parallel sampling, n samples of one prompt decoding over ONE copy of its KV blocks.

A request may now ask for `n` samples of the same prompt. Phase 3.5 would
prefill the prompt n times and store its K/V n times. Here:

  1. the prompt is prefilled ONCE, as one sequence (the group's sample 0);
  2. right after that prefill pass, the group forks: samples 1..n-1 get block
     tables that list the parent's blocks (refcount n each, nothing copied) and
     every sample draws its first token from the same prefill logits, each
     with its own generator (seed + sample index, so a fixed seed reproduces);
  3. at the first decode step each sample writes its first token's K/V. If the
     prompt ended mid-block, that block is shared and partly filled: the first
     n-1 writers each copy it to a fresh block (copy-on-write) and the last
     one, now its only owner, writes in place. Full prompt blocks are never
     written again, so they stay shared until the last sample finishes.

The copies of a step are batched into one indexed copy run just before the
forward pass (block_ops.CopyQueue), so a step with many forks costs one launch.

Admission counts the shared prompt blocks once: a group of n needs
`full_prompt_blocks + n * (blocks_for(max_kv_tokens(prompt, max_new)) - full_prompt_blocks)`
blocks in the worst case (each sample's own copy of the partial block plus its
output; `max_kv_tokens` = prompt + max_new - 1, the last token is never fed back), and n free slots under `max_running`, since it will run as n sequences.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field, replace

import torch

from common.bench import SeqTiming
from common.sampling import GREEDY, SamplingParams, make_generator
from phases.p2_2_scheduler.sequence import Sequence, Status
from phases.p3_2_block_table.block_table import BlockTable
from phases.p3_5_paged_attention.engine import BatchedPagedEngine, StepOutput, _blocks_for, max_kv_tokens
from phases.p4_1_copy_on_write.block_ops import CopyQueue, append_slots_cow, blocks_held, fork

NO_ROOM = math.inf  # `_blocks_to_admit` answer when a group would not fit under max_running


@dataclass(eq=False)  # identity: a group is one request, even if two have equal fields
class SequenceGroup:
    """One request: a prompt and the `n` sequences generated from it (samples, or beams in p4_2)."""
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
        """Which member `seq` is: sample i (the response's choices[i]) or beam slot i."""
        return next(i for i, s in enumerate(self.seqs) if s is seq)

    @property
    def outputs(self) -> list[list[int]]:
        """Generated token ids of each member, in member order."""
        return [list(s.output_ids) for s in self.seqs]


def worst_case_blocks(n_prompt: int, max_new_tokens: int, n: int, block_size: int) -> int:
    """Most blocks n sequences forked from one prompt can hold at once: full prompt blocks counted once."""
    shared = n_prompt // block_size  # full prompt blocks: never written again, shared by all n
    return shared + n * (_blocks_for(max_kv_tokens(n_prompt, max_new_tokens), block_size) - shared)


class SharingEngine(BatchedPagedEngine):
    def __init__(self, lm, **engine_kwargs):
        super().__init__(lm, **engine_kwargs)
        self.copies = CopyQueue()                    # copy-on-write copies waiting for the next forward pass
        self.groups: list[SequenceGroup] = []        # every request added, in order
        self._group_of: dict[int, SequenceGroup] = {}  # seq_id -> its request
        self._slots_promised = 0                     # members of admitted groups not forked yet
        # (distinct blocks held, blocks the same tables would hold unshared) at every decode pass
        self.usage: list[tuple[int, int]] = []

    # --- requests ----------------------------------------------------------------
    def add(self, prompt: str | None = None, max_new_tokens: int = 64, sampling: SamplingParams = GREEDY,
            ignore_eos: bool = False, prompt_ids: list[int] | None = None, arrival: float | None = None,
            n: int = 1) -> SequenceGroup:
        """Queue a request for `n` samples of one prompt; returns its group (its `seqs` fill in at prefill)."""
        return self._add_group(prompt, max_new_tokens, sampling, ignore_eos, prompt_ids, arrival, n, SequenceGroup)

    def _add_group(self, prompt, max_new_tokens, sampling, ignore_eos, prompt_ids, arrival, n, group_cls,
                   **group_kwargs) -> SequenceGroup:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an integer >= 1, got {n!r}")
        if n > self.max_running:
            raise ValueError(f"a group of {n} sequences cannot run under max_running={self.max_running}")
        if prompt_ids is None and prompt:
            prompt_ids = self.lm.prompt_ids(prompt)
        if prompt_ids and max_new_tokens > 0:
            need = worst_case_blocks(len(prompt_ids), max_new_tokens, n, self.block_size)
            if need > self.allocator.n_blocks:
                raise ValueError(f"{n} sequences of {len(prompt_ids)} prompt + {max_new_tokens} new tokens need "
                                 f"up to {need} blocks of {self.block_size} tokens, but the whole pool has "
                                 f"{self.allocator.n_blocks}")
        seq = super().add(prompt, max_new_tokens, sampling, ignore_eos, prompt_ids, arrival)  # validates, queues
        group = group_cls(len(self.groups), seq.prompt, seq.prompt_ids, n, max_new_tokens, sampling, [seq],
                          **group_kwargs)
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

    # --- admission: shared blocks counted once, a group needs n slots -----------------
    def _blocks_to_admit(self, seq: Sequence) -> int:
        group = self._group_of[seq.seq_id]
        width = 1 if group.forked else group.n  # a forked member coming back (after preemption) is one sequence
        if len(self.running) + self._slots_promised + width > self.max_running:
            return NO_ROOM  # the group will run as n sequences; wait for n slots
        return worst_case_blocks(len(seq.prompt_ids), seq.max_new_tokens, width, self.block_size)

    def _on_admit(self, seq: Sequence) -> None:
        super()._on_admit(seq)
        group = self._group_of[seq.seq_id]
        if not group.forked:
            self._slots_promised += group.n - 1

    def _reserved_blocks(self) -> int:
        """Blocks the running groups may still claim: worst case of their live members minus what they hold."""
        live: dict[SequenceGroup, list[Sequence]] = defaultdict(list)
        for s in self.running:
            live[self._group_of[s.seq_id]].append(s)
        reserved = 0
        for group, members in live.items():
            worst = worst_case_blocks(len(group.prompt_ids), group.max_new_tokens, len(members), self.block_size)
            held, _ = blocks_held([s.kv for s in members])
            reserved += max(0, worst - held)
        return reserved

    # --- copy-on-write ---------------------------------------------------------------
    def _append_slots(self, seq: Sequence, n: int) -> list[int]:
        """Claim slots; a shared block about to be written is copied first (copy queued for this step)."""
        return append_slots_cow(seq.kv, self.allocator, n, self.copies)

    def _forward(self, input_ids, position_ids, batch, logits_to_keep=1) -> torch.Tensor:
        # Every copy decided while claiming this pass's slots runs now, in one
        # indexed copy, before any layer writes its new K/V into the pool.
        self.copies.flush(self.allocator.kv_store)
        if batch.is_decode:
            self.usage.append(self.block_usage())
        return super()._forward(input_ids, position_ids, batch, logits_to_keep)

    def block_usage(self) -> tuple[int, int]:
        """(blocks the running sequences hold, blocks they would hold if nothing were shared)."""
        return blocks_held([s.kv for s in self.running if isinstance(s.kv, BlockTable)])

    @property
    def n_copied(self) -> int:
        """Blocks copied by copy-on-write so far."""
        return self.copies.n_copied

    # --- forking a group after its prefill ----------------------------------------------
    def _emit(self, seqs: list[Sequence], logits: torch.Tensor) -> list[StepOutput]:
        """A group's parent just prefilled: fork its samples, each sampling from the parent's logits row."""
        members, rows = [], []
        for row, seq in enumerate(seqs):
            group = self._group_of[seq.seq_id]
            forked = [] if group.forked else self._fork_group(group)
            members += [seq] + forked
            rows += [row] * (1 + len(forked))
        if len(members) != len(seqs):
            logits = logits[rows]  # [n_members, V]: one row per sample, shared rows repeated
        return super()._emit(members, logits)

    def _fork_group(self, group: SequenceGroup) -> list[Sequence]:
        """Samples 1..n-1 of a freshly prefilled group, sharing every block of sample 0."""
        parent = group.seqs[0]
        children = [self._new_member(group, parent, fork(parent.kv, self.allocator), i) for i in range(1, group.n)]
        self._slots_promised -= len(children)
        return children

    def _new_member(self, group: SequenceGroup, parent: Sequence, kv: BlockTable, index: int) -> Sequence:
        """A running sequence of `group` that starts where `parent` is (same state, tokens, given table)."""
        child = Sequence(self._next_id, parent.prompt, parent.prompt_ids, parent.max_new_tokens, parent.sampling,
                         parent.ignore_eos, status=parent.status, output_ids=list(parent.output_ids),
                         timing=SeqTiming(arrival=parent.timing.arrival), kv=kv, history=list(parent.history))
        self._next_id += 1
        self._generators[child.seq_id] = self._member_generator(group.sampling, index)
        self._group_of[child.seq_id] = group
        group.seqs.append(child)
        self.running.append(child)
        return child

    def _member_generator(self, sampling: SamplingParams, index: int) -> torch.Generator | None:
        """Sample i draws from its own stream, seeded seed + i (sample 0 is what a plain request would draw)."""
        if sampling.seed is None:
            return None
        return make_generator(replace(sampling, seed=sampling.seed + index), self.lm.device)
