"""`PreemptingEngine`: optimistic FCFS admission; when the pool runs dry, the latest request gives its blocks back.

Phases 3.5-4.1 admitted a request only if its *worst case* (prompt +
max_new_tokens, for every sample) fit beside everyone else's worst case, so
decode never ran out of blocks, and most of the reserved blocks sat empty
(outputs usually stop long before max_new_tokens). Here (vLLM paper §4.5):

admission   first-come-first-served and optimistic: the head of the waiting
            queue is admitted when its prefill's blocks fit *now*, leaving the
            blocks the running sequences need for their next token and a small
            reserve (`watermark_blocks`, 1% of the pool) so that admission
            does not cause a preemption at the very next step. Nobody
            overtakes the head. While any group is swapped out, no new request
            is admitted (it would take the room the swapped group waits for).
preemption  before each decode pass the engine counts the blocks every running
            sequence needs for its next token (a new block when its last one is
            full, a copy when it writes into a shared block). If the pool can't
            cover them, the LATEST-ARRIVED running group is preempted, all of
            it (its samples or beams share blocks: gang-scheduled), and again
            until the rest fit. The earliest request is never preempted for a
            later one, so it always makes progress: no livelock.
recovery    `preemption_mode="recompute"` (recompute.py): the group's blocks
            are dropped and its sequences go back to the FRONT of the waiting
            queue (arrival order, ahead of every new request); when admitted
            again each prefills prompt + generated tokens in one pass and
            samples its next token. `preemption_mode="swap"` (swap.py): the
            group's blocks are copied to a CPU pool (shared blocks once) and
            freed; the earliest swapped group is copied back into fresh blocks
            as soon as it fits beside the running ones' next tokens and the
            reserve, and resumes decoding where it stopped. If the CPU pool is
            full, that one preemption falls back to recomputation
            (`stats.n_swap_fallbacks`).

Sampling is unaffected: every sequence keeps its own torch.Generator through a
preemption, and draws exactly one number per generated token either way, so a
seeded request gives the same tokens with or without preemption, and greedy
output equals an unlimited pool's.

Requests: `add()` refuses up front (ValueError, sizes named) a prompt that
cannot fit in the whole pool with its first generated token (when more than
one token is wanted: a single new token is never fed back), and, as in phase
4.1, a request whose prompt + max_new_tokens could outgrow the whole pool on
its own. So any accepted group, alone in the pool, always fits: preempting
every later group always makes room, and nothing is ever truncated or lost.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import Counter, defaultdict, deque
from dataclasses import dataclass

from phases.p2_2_scheduler.sequence import Sequence, Status
from phases.p3_1_block_allocator.allocator import BlockAllocator, OutOfBlocks
from phases.p3_5_paged_attention.engine import StepOutput
from phases.p4_1_copy_on_write.engine import SequenceGroup, SharingEngine, worst_case_blocks
from phases.p4_4_preemption.recompute import RecomputePrefill
from phases.p4_4_preemption.swap import SwapSpace

PREEMPTION_MODES = ("recompute", "swap")
DEFAULT_WATERMARK_FRACTION = 0.01  # vLLM's default: keep 1% of the pool free when admitting
DECISION_LOG_LENGTH = 100_000       # most recent admissions / preemptions kept (a server runs for days)


@dataclass
class PreemptionStats:
    n_preemptions: int = 0       # group preemptions (a group preempted twice counts twice)
    n_recomputed: int = 0        # groups re-prefilled after a preemption
    tokens_recomputed: int = 0   # tokens whose K/V were computed again
    recompute_s: float = 0.0     # prefill time spent on them (each pass's time x their share of its tokens)
    n_swap_fallbacks: int = 0    # swap-mode preemptions recomputed because the CPU pool was full


class PreemptingEngine(RecomputePrefill, SharingEngine):
    def __init__(self, lm, preemption_mode: str = "recompute", watermark_blocks: int | None = None,
                 cpu_blocks: int | None = None, **engine_kwargs):
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {preemption_mode!r}")
        super().__init__(lm, **engine_kwargs)
        self.preemption_mode = preemption_mode
        n = self.allocator.n_blocks
        self.watermark_blocks = math.ceil(DEFAULT_WATERMARK_FRACTION * n) if watermark_blocks is None \
            else watermark_blocks
        if not 0 <= self.watermark_blocks < n:
            raise ValueError(f"watermark_blocks must be in [0, {n}), got {self.watermark_blocks}")
        # The paper bounds swap space by the GPU pool's size; the default follows it.
        self.swap_space = SwapSpace(self.allocator, cpu_blocks or n) if preemption_mode == "swap" else None
        self.swapped: deque[SequenceGroup] = deque()  # swapped-out groups, in arrival order
        self.stats = PreemptionStats()
        # request_id of every preemption / every admission and swap-in, in order (the latest ones)
        self.preempted_ids: deque[int] = deque(maxlen=DECISION_LOG_LENGTH)
        self.admitted_ids: deque[int] = deque(maxlen=DECISION_LOG_LENGTH)
        self._preempted_now = False              # a preemption in this step: admit nothing new

    # --- requests -------------------------------------------------------------------
    def _add_group(self, prompt, max_new_tokens, sampling, ignore_eos, prompt_ids, arrival, n, group_cls,
                   **group_kwargs) -> SequenceGroup:
        if prompt_ids is None and prompt:
            prompt_ids = self.lm.prompt_ids(prompt)
        if prompt_ids and isinstance(n, int) and n >= 1:
            # the least it takes to make progress: the prompt, and its first token fed back if more follow
            fed_back = max_new_tokens > 1
            first = worst_case_blocks(len(prompt_ids), 2 if fed_back else 1, n, self.block_size)
            if first > self.allocator.n_blocks:
                extra = "+1 generated token, " if fed_back else ""
                raise ValueError(f"prompt of {len(prompt_ids)} tokens ({extra}x{n} sequences) needs "
                                 f"{first} blocks of {self.block_size} tokens, but the whole pool has "
                                 f"{self.allocator.n_blocks}: it could never run")
        # phase 4.1's check follows: prompt + max_new_tokens must fit in the whole pool (worst case)
        return super()._add_group(prompt, max_new_tokens, sampling, ignore_eos, prompt_ids, arrival, n,
                                  group_cls, **group_kwargs)

    def has_work(self) -> bool:
        return super().has_work() or bool(self.swapped)

    @property
    def swapped_seqs(self) -> list[Sequence]:
        """Sequences whose blocks are in the CPU pool (neither waiting nor running)."""
        return [s for g in self.swapped for s in self._preempted(g)]

    def abort(self, seq: Sequence) -> None:
        group = self._group_of.get(seq.seq_id)
        if group in self.swapped and seq.status is Status.PREEMPTED:
            seq.kv.release(self.swap_space.cpu)
            seq.finish_reason = "abort"
            seq.status = Status.DONE
            seq.history.append(Status.DONE)
            self.finished.append(seq)
            if not self._preempted(group):
                self.swapped.remove(group)
        else:
            super().abort(seq)
        if seq.status is Status.DONE:
            self._generators.pop(seq.seq_id, None)  # also for one aborted while waiting to be recomputed

    # --- one step ---------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        self._preempted_now = self._make_room_for_decode()
        if not self._preempted_now:
            self._swap_in()
        return super().step()  # admits (our `_admit`), prefills, decodes

    @staticmethod
    def _preempted(group: SequenceGroup) -> list[Sequence]:
        return [s for s in group.seqs if s.status is Status.PREEMPTED]

    def _running_groups(self) -> dict[SequenceGroup, list[Sequence]]:
        """Running groups in arrival order, each with its running members."""
        groups: dict[SequenceGroup, list[Sequence]] = defaultdict(list)
        for s in self.running:
            groups[self.group_of(s)].append(s)
        return dict(sorted(groups.items(), key=lambda item: item[0].request_id))

    @staticmethod
    def _decode_blocks(seqs: list[Sequence], allocator: BlockAllocator) -> int:
        """Blocks the next decode pass takes for `seqs`, exactly as `append_slots_cow` will take them."""
        need, writers = 0, Counter()
        for s in seqs:
            table = s.kv
            if table.n_filled == table.capacity:
                need += 1                                       # the last block is full: a new one
            else:
                writers[table.block_ids[table.n_filled // table.block_size]] += 1
        for block, k in writers.items():
            # k tables write into this partly filled block; while it is shared each writer copies it,
            # except that the last one, if nobody else holds it, finds refcount 1 and writes in place.
            need += k - 1 if allocator.refcount(block) == k else k
        return need

    def _decode_need(self) -> int:
        return sum(self._decode_blocks(m, self.allocator) for m in self._running_groups().values())

    # --- preemption ------------------------------------------------------------------------
    def _make_room_for_decode(self) -> bool:
        """Preempt the latest-arrived running groups until every running sequence has room for its next token."""
        preempted = False
        while True:
            groups = self._running_groups()
            need = sum(self._decode_blocks(m, self.allocator) for m in groups.values())
            if need <= self.allocator.n_free:
                return preempted
            if len(groups) == 1:
                # add() guarantees a group fits the pool alone; only blocks held outside the engine break that.
                raise OutOfBlocks(f"request {next(iter(groups)).request_id} needs {need} blocks for its next "
                                  f"token, {self.allocator.n_free} are free and no other request is running to "
                                  f"preempt: {self.allocator.n_used} blocks are held outside the engine")
            victim = next(reversed(groups))
            self._preempt(victim, groups[victim])
            preempted = True

    def _preempt(self, group: SequenceGroup, members: list[Sequence]) -> None:
        """Take every running member of `group` off the pool: to the CPU pool, or dropped for recomputation."""
        self.stats.n_preemptions += 1
        self.preempted_ids.append(group.request_id)
        for s in members:
            s.move(Status.PREEMPTED)
            self.running.remove(s)
        tables = [s.kv for s in members]
        if self.swap_space is not None and self.swap_space.can_swap_out(tables):
            self.swap_space.swap_out(tables)
            i = bisect_left([g.request_id for g in self.swapped], group.request_id)
            self.swapped.insert(i, group)
            return
        if self.swap_space is not None:
            self.stats.n_swap_fallbacks += 1
        for s in members:
            self._release(s)  # a preempted sequence keeps its generator (see `_release`)
        # Back to the waiting queue at its arrival position: every new request arrived later, so
        # in practice that is the front, behind only earlier preempted groups.
        rids = [self.group_of(s).request_id for s in self.waiting]
        i = bisect_left(rids, group.request_id)
        for s in reversed(members):
            self.waiting.insert(i, s)

    def _release(self, seq: Sequence) -> None:
        generator = self._generators.get(seq.seq_id)
        super()._release(seq)
        if seq.status is Status.PREEMPTED:
            self._generators[seq.seq_id] = generator  # same random stream when it resumes

    # --- recovery: swap in -------------------------------------------------------------------
    def _swap_in(self) -> None:
        """Bring swapped groups back, earliest first, while they fit beside the running ones' next tokens."""
        while self.swapped:
            group = self.swapped[0]
            if self.waiting and self.waiting[0].status is Status.PREEMPTED \
                    and self.group_of(self.waiting[0]).request_id < group.request_id:
                return  # an earlier group waits to be recomputed (a swap fallback): FCFS, it goes first
            members = self._preempted(group)
            tables = [s.kv for s in members]
            reserve = self._decode_need() + self._decode_blocks(members, self.swap_space.cpu)
            if self.running:
                reserve += self.watermark_blocks
            if len(self.running) + len(members) > self.max_running or \
                    not self.swap_space.can_swap_in(tables, reserve):
                return
            self.swap_space.swap_in(tables)
            self.swapped.popleft()
            self.admitted_ids.append(group.request_id)
            for s in members:
                s.move(Status.DECODING)
                self.running.append(s)

    # --- admission: optimistic, first come first served ------------------------------------------
    def _admit(self) -> list[Sequence]:
        """Admit whole groups from the head of the queue while their prefill fits now (plus the reserve)."""
        if self._preempted_now:
            return []
        budget = self.allocator.n_free - self._decode_need()
        admitted, prefill_tokens = [], 0
        while self.waiting:
            group = self.group_of(self.waiting[0])
            if self.swapped and group.request_id > self.swapped[0].request_id:
                break  # nothing newer than a swapped group starts before it is back
            members = [s for s in self.waiting if self.group_of(s) is group]
            width = len(members) if group.forked else group.n
            if len(self.running) + self._slots_promised + width > self.max_running:
                break
            need = sum(self._blocks_to_admit(s) for s in members)
            reserve = self.watermark_blocks if self.running else 0  # alone in the pool: no reserve needed
            tokens = sum(len(s.all_ids) for s in members)
            if need + reserve > budget or (admitted and prefill_tokens + tokens > self.max_prefill_tokens):
                break  # FCFS: nobody overtakes the head of the queue
            for s in members:
                self.waiting.remove(s)
                self._on_admit(s)
                self.running.append(s)
            budget -= need
            prefill_tokens += tokens
            admitted += members
            self.admitted_ids.append(group.request_id)
        return admitted

    # --- accounting -------------------------------------------------------------------------------
    @property
    def recovery_s(self) -> float:
        """Time spent getting preempted groups back: swap copies (both ways) and recomputation."""
        swap = self.swap_space.out.seconds + self.swap_space.into.seconds if self.swap_space else 0.0
        return swap + self.stats.recompute_s

    def summary(self) -> dict:
        """Every counter, JSON-ready (for demos and a server's /metrics)."""
        out = dict(self.stats.__dict__, preemption_mode=self.preemption_mode, recovery_s=self.recovery_s,
                   n_swapped_out=0, n_swapped_in=0, blocks_swapped_out=0, blocks_swapped_in=0,
                   tokens_swapped_out=0, tokens_swapped_in=0, bytes_swapped_out=0, bytes_swapped_in=0,
                   swap_s=0.0)
        if self.swap_space is not None:
            for name, traffic in (("out", self.swap_space.out), ("in", self.swap_space.into)):
                out[f"n_swapped_{name}"] = traffic.n_swaps
                out[f"blocks_swapped_{name}"] = traffic.n_blocks
                out[f"tokens_swapped_{name}"] = traffic.n_tokens
                out["swap_s"] += traffic.seconds
                out[f"bytes_swapped_{name}"] = traffic.n_bytes
        return out
