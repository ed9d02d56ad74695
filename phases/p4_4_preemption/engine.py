"""`PreemptingEngine`: optimistic FCFS admission; when the pool runs dry, the latest request gives its blocks back.

Phase 4.3's engine with the vLLM paper's §4.5 rules. Admission (`OptimisticAdmission`): the head's whole group starts
when its prefill fits NOW, beside the running sequences' next tokens and `watermark_blocks`; nobody overtakes it, and
nothing new starts while a group is swapped out. Preemption: before each step, while the pool cannot cover every running
sequence's next token, the LATEST-arrived group is preempted whole. Recovery: "recompute" prefills prompt + outputs
again from the FRONT of the queue (a group's lead computes the prompt blocks its members fork, `claim`); "swap"
(swap.py) goes to a CPU pool and back, or recomputes if that pool is full or it was mid-prefill. Keyed draws (phase
3.10) change no token; `add()` refuses a request that could outgrow the pool alone, so preempting makes room.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import Counter, defaultdict, deque
from dataclasses import dataclass
from enum import Enum
from itertools import takewhile

from phases.p2_2_scheduler.sequence import Sequence, Status
from phases.p3_1_block_allocator.allocator import BlockAllocator, OutOfBlocks, blocks_for
from phases.p4_1_copy_on_write.engine import SequenceGroup
from phases.p4_3_prefix_caching.engine import PrefixCachingEngine
from phases.p4_4_preemption.swap import NoSwapSpace, SwapSpace


class Preemption(Enum):
    """The state this phase adds to phase 2.2's machine: KV taken away, to be prefilled again or swapped back in."""
    PREEMPTED = "PREEMPTED"


PREEMPTED = Preemption.PREEMPTED
PREEMPTION_MOVES = {Status.PREFILLING: {PREEMPTED}, Status.DECODING: {PREEMPTED},
                    PREEMPTED: {Status.PREFILLING, Status.DECODING}}
PREEMPTION_MODES = ("recompute", "swap")
DEFAULT_WATERMARK_FRACTION = 0.01  # vLLM's default: keep 1% of the pool free when admitting
DECISION_LOG_LENGTH = 100_000       # most recent admissions / preemptions kept (a server runs for days)


class PreemptibleSequence(Sequence):
    """Phase 2.2's sequence, whose state machine also has the moves in and out of PREEMPTED."""
    def move(self, new) -> None:
        if new in PREEMPTION_MOVES.get(self.status, ()):
            self.status = new
            self.history.append(new)
        else:
            super().move(new)


@dataclass
class PreemptionStats:
    n_preemptions: int = 0       # group preemptions (a group preempted twice counts twice)
    n_recomputed: int = 0        # groups re-prefilled after a preemption
    tokens_recomputed: int = 0   # tokens whose K/V were computed again (counted as their chunks are claimed)


class OptimisticAdmission:
    """vLLM's admission rule (§4.5): its promise covers one step; the engine keeps it by preempting."""
    def __init__(self, engine: PreemptingEngine):
        self.engine = engine    # read only: its queues, groups, pool, KV part and prefill pass

    def blocks_left(self) -> int:
        """Free blocks beyond the running sequences' next tokens, counted once per step."""
        return self.engine.allocator.n_free - self.blocks_promised()

    def can_admit(self, seq: Sequence, blocks_left: int) -> bool:
        """`seq`'s group may start: nothing older swapped out, slots free, its prefill fits beside the reserve."""
        e = self.engine
        group = e.group_of(seq)
        if e.swapped and group.request_id > e.swapped[0].request_id:
            return False   # nothing newer than a swapped group starts before it is back
        members = e.head_group()
        width = len(members) if group.forked else group.n
        if width > e.n_free_slots - e.slots_promised:
            return False
        reserve = e.watermark_blocks if e.running else 0   # alone in the pool: no reserve needed
        tokens = sum(len(s.all_ids) for s in members)
        return self.blocks_to_admit(seq) + reserve <= blocks_left and e.prefill.fits(tokens)

    def blocks_to_admit(self, seq: Sequence) -> int:
        """Blocks the prefill of `seq`'s group (`seq` heads the queue) takes NOW: every member waiting with it."""
        return sum(self.prefill_blocks(s) for s in self.engine.head_group())

    def prefill_blocks(self, seq: Sequence) -> int:
        """Blocks `seq`'s prefill takes NOW, less those it shares (forked from its lead, or cached and held)."""
        e = self.engine
        forked = len(seq.prompt_ids) // e.block_size if e.lead(seq) not in (None, seq) else 0
        return blocks_for(len(seq.all_ids), e.block_size) - forked - e.kv.blocks_in_use(seq, start_block=forked)

    def blocks_promised(self) -> int:
        """Only the blocks the running sequences claim in their next decode pass."""
        return sum(self.decode_blocks(m, self.engine.allocator) for m in self.engine.running_groups().values())

    def decode_blocks(self, seqs: list[Sequence], allocator: BlockAllocator) -> int:
        """Blocks `append_slots_cow` takes next pass for `seqs` (the rest of the prefill for one mid-prefill)."""
        need, writers = 0, Counter()
        for s in seqs:
            table = s.kv
            if s.status is Status.PREFILLING:
                forked = len(s.prompt_ids) // table.block_size if self.engine.lead(s) not in (None, s) else 0
                need += max(0, blocks_for(len(s.all_ids), table.block_size) - max(table.n_blocks, forked))
            elif table.n_filled == table.capacity:
                need += 1                                       # the last block is full: a new one
            else:
                writers[table.block_ids[table.n_filled // table.block_size]] += 1
        for block, k in writers.items():
            # k writers of a shared block each copy it, but the last finds refcount 1 if nobody else holds it
            need += k - 1 if allocator.refcount(block) == k else k
        return need


class PreemptingEngine(PrefixCachingEngine):
    """Phase 4.3's engine, admitting optimistically and preempting the latest request when the pool runs dry."""
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
        # The recovery part; the paper bounds the CPU pool by the GPU pool's size, and the default follows it.
        self.swap_space = self.make_swap_space(cpu_blocks or n)
        self.swapped: deque[SequenceGroup] = deque()  # swapped-out groups, in arrival order
        self.stats = PreemptionStats()
        self.preempted_ids: deque[int] = deque(maxlen=DECISION_LOG_LENGTH)  # request ids, latest preemptions
        self.admitted_ids: deque[int] = deque(maxlen=DECISION_LOG_LENGTH)   # ... and admissions and swap-ins
        self._computed: dict[int, int] = {}      # seq_id -> tokens whose K/V it had when dropped for recompute

    def make_admission(self) -> OptimisticAdmission:
        return OptimisticAdmission(self)

    def make_swap_space(self, cpu_blocks: int) -> SwapSpace | NoSwapSpace:
        return SwapSpace(self.allocator, cpu_blocks) if self.preemption_mode == "swap" else NoSwapSpace()

    def new_sequence(self, *args) -> PreemptibleSequence:
        return PreemptibleSequence(**vars(super().new_sequence(*args)))

    @property
    def has_work(self) -> bool:
        return super().has_work or bool(self.swapped)

    @property
    def swapped_seqs(self) -> list[Sequence]:
        """Sequences whose blocks are in the CPU pool (neither waiting nor running)."""
        return [s for g in self.swapped for s in self._preempted(g)]

    def withdraw(self, seq: Sequence) -> bool:
        self._computed.pop(seq.seq_id, None)
        group = self._group_of.get(seq.seq_id)
        if seq.status is not PREEMPTED or group not in self.swapped:
            return super().withdraw(seq)
        seq.kv.release(self.swap_space.cpu)     # a swapped-out sequence's blocks are in the CPU pool
        seq.kv = None
        if len(self._preempted(group)) == 1:    # it was the group's last one out there
            self.swapped.remove(group)
        return True

    @staticmethod
    def _preempted(group: SequenceGroup) -> list[Sequence]:
        return [s for s in group.seqs if s.status is PREEMPTED]

    def running_groups(self) -> dict[SequenceGroup, list[Sequence]]:
        """Running groups in arrival order, each with its running members."""
        groups: dict[SequenceGroup, list[Sequence]] = defaultdict(list)
        for s in self.running:
            groups[self.group_of(s)].append(s)
        return dict(sorted(groups.items(), key=lambda item: item[0].request_id))

    def _make_room_for_decode(self) -> bool:
        """Preempt the latest-arrived running groups until every running sequence has room for its next token."""
        preempted = False
        while (need := self.admission.blocks_promised()) > self.allocator.n_free:
            groups = self.running_groups()
            if len(groups) == 1:
                raise OutOfBlocks(f"request {next(iter(groups)).request_id} needs {need} blocks for its next token, "
                                  f"{self.allocator.n_free} are free and no other request is running to preempt: "
                                  f"{self.allocator.n_used} blocks are held outside the engine")
            victim = next(reversed(groups))
            self._preempt(victim, groups[victim])
            preempted = True
        return preempted

    def _preempt(self, group: SequenceGroup, members: list[Sequence]) -> None:
        """Take every running member of `group` off the pool: to the CPU pool, or dropped for recomputation."""
        self.stats.n_preemptions += 1
        self.preempted_ids.append(group.request_id)
        decoding = all(s.status is Status.DECODING for s in members)
        for s in members:
            s.move(PREEMPTED)
        if decoding and self.swap_space.try_swap_out([s.kv for s in members]):
            for s in members:
                self.running.remove(s)
            i = bisect_left([g.request_id for g in self.swapped], group.request_id)
            self.swapped.insert(i, group)
            return
        for s in members:
            self._computed[s.seq_id] = max(self._computed.get(s.seq_id, 0), s.kv.n_filled)
            self.retire(s)   # the blocks go (cached ones stay findable); its random stream stays for the resume
        # Back to the queue at its arrival position: the front, behind only earlier preempted groups.
        i = bisect_left([self.group_of(s).request_id for s in self.waiting], group.request_id)
        for s in reversed(members):
            self.waiting.insert(i, s)

    def _swap_in(self) -> None:
        """Bring swapped groups back, earliest first, while they fit beside the running ones' next tokens."""
        while self.swapped:
            group = self.swapped[0]
            if self.waiting and self.waiting[0].status is PREEMPTED \
                    and self.group_of(self.waiting[0]).request_id < group.request_id:
                return  # an earlier group waits to be recomputed (a swap fallback): FCFS, it goes first
            members = self._preempted(group)
            tables = [s.kv for s in members]
            reserve = self.admission.blocks_promised() + self.admission.decode_blocks(members, self.swap_space.cpu) \
                + (self.watermark_blocks if self.running else 0)
            if len(members) > self.n_free_slots - self.slots_promised \
                    or not self.swap_space.can_swap_in(tables, reserve):
                return
            self.swap_space.swap_in(tables)
            self.swapped.popleft()
            self.admitted_ids.append(group.request_id)
            for s in members:
                s.move(Status.DECODING)
                self.running.append(s)

    def admit(self) -> None:
        """Preempt to make room; a step that preempted admits nothing, else swapped groups come back, then new ones."""
        if self._make_room_for_decode():
            return
        self._swap_in()
        super().admit()

    def admit_head(self) -> Sequence:
        """The head of the queue's group joins the running set, all its waiting members; returns the last."""
        members = self.head_group()
        if any(s.output_ids or s.seq_id in self._computed for s in members):
            self.stats.n_recomputed += 1
        for _ in members:
            seq = super().admit_head()
        self.admitted_ids.append(self.group_of(seq).request_id)
        return seq

    def head_group(self) -> list[Sequence]:
        """The waiting members of the head's group, side by side at the head (a group is preempted whole)."""
        group = self.group_of(self.waiting[0])
        return list(takewhile(lambda s: self.group_of(s) is group, self.waiting))

    @staticmethod
    def _recomputing(seq: Sequence) -> bool:
        """Preempted and waiting to be recomputed, or admitted again and not re-prefilled yet."""
        return seq.status is PREEMPTED or (seq.status is Status.PREFILLING and bool(seq.output_ids))

    def lead(self, seq: Sequence) -> Sequence | None:
        """For a recomputing sequence, its group's first recomputing member, which recomputes the shared prompt."""
        if not self._recomputing(seq):
            return None
        group = self.group_of(seq)
        queue = self.waiting if seq.status is PREEMPTED else self.running
        return next(s for s in queue if self.group_of(s) is group and self._recomputing(s))

    def claim(self, chunk):
        """Claim the chunk's slots, counting recomputed tokens; a lead's claimed full prompt blocks are forked."""
        chunk = super().claim(chunk)
        self.stats.tokens_recomputed += max(0, min(chunk.end, self._computed_before(chunk.seq)) - chunk.start)
        if chunk.last:
            self._computed.pop(chunk.seq.seq_id, None)   # its prefill ends in this pass: all it had is back
        lead = chunk.seq
        full_prompt = len(lead.prompt_ids) // self.block_size * self.block_size
        if self._recomputing(lead) and self.lead(lead) is lead and lead.kv.n_filled >= full_prompt:
            for seq in self.running:
                if seq is not lead and self.group_of(seq) is self.group_of(lead) and self._recomputing(seq):
                    self._fork_prompt(lead, seq)
        return chunk

    def _computed_before(self, seq: Sequence) -> int:
        """Tokens of `seq` with K/V computed before it was dropped (all but the last output, whose decode never ran)."""
        return max(self._computed.get(seq.seq_id, 0), len(seq.all_ids) - 1 if self._recomputing(seq) else 0)

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

    def summary(self) -> dict:
        """Every counter, JSON-ready (for demos and a server's /metrics)."""
        o, i = self.swap_space.out, self.swap_space.into
        return dict(self.stats.__dict__, n_swap_fallbacks=self.swap_space.n_fallbacks,
                    preemption_mode=self.preemption_mode, n_swapped_out=o.n_swaps, n_swapped_in=i.n_swaps,
                    blocks_swapped_out=o.n_blocks, blocks_swapped_in=i.n_blocks, tokens_swapped_out=o.n_tokens,
                    tokens_swapped_in=i.n_tokens, bytes_swapped_out=o.n_bytes, bytes_swapped_in=i.n_bytes,
                    swap_s=o.seconds + i.seconds)
