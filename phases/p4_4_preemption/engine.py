"""`PreemptingEngine`: optimistic FCFS admission; when the pool runs dry, the latest request gives its blocks back.

Phase 4.3's engine; until now a request was admitted only if its worst case fit. Here (vLLM paper §4.5):
admission   `OptimisticAdmission`: the head of the queue's whole group starts when its prefill's blocks fit
            NOW, beside the running sequences' next tokens and a reserve (`watermark_blocks`). Nobody
            overtakes the head; nothing new starts while a group is swapped out.
preemption  before each step, while the pool cannot cover every running sequence's next token (a new block,
            or a copy-on-write copy), the LATEST-arrived running group is preempted whole: no livelock.
recovery    "recompute": back to the FRONT of the queue, to prefill prompt + outputs (cached blocks found
            again; a group's lead computes the prompt blocks its members fork, `claim`). "swap" (swap.py):
            to a CPU pool and back when it fits; a full CPU pool, or a group mid-prefill, recomputes.
Draws are keyed on (seed, token index) (phase 3.10), so preemption changes no token; `add()` refuses a
request that could outgrow the pool alone, so preempting every later group always makes room.
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
    """The state this phase adds to phase 2.2's machine: a sequence whose KV was taken away to make room. It waits
    to be prefilled again (prompt and outputs) or to get its KV back from the CPU pool, possibly several times."""
    PREEMPTED = "PREEMPTED"


PREEMPTED = Preemption.PREEMPTED
# Its moves: out of PREFILLING (part-way through a prefill) or DECODING; back by prefilling again, or straight
# to DECODING when its KV is put back.
PREEMPTION_MOVES = {Status.PREFILLING: {PREEMPTED}, Status.DECODING: {PREEMPTED},
                    PREEMPTED: {Status.PREFILLING, Status.DECODING}}


class PreemptibleSequence(Sequence):
    """Phase 2.2's sequence, whose state machine also has the moves in and out of PREEMPTED."""

    def move(self, new) -> None:
        if new in PREEMPTION_MOVES.get(self.status, ()):
            self.status = new
            self.history.append(new)
        else:
            super().move(new)


PREEMPTION_MODES = ("recompute", "swap")
DEFAULT_WATERMARK_FRACTION = 0.01  # vLLM's default: keep 1% of the pool free when admitting
DECISION_LOG_LENGTH = 100_000       # most recent admissions / preemptions kept (a server runs for days)


@dataclass
class PreemptionStats:
    n_preemptions: int = 0       # group preemptions (a group preempted twice counts twice)
    n_recomputed: int = 0        # groups re-prefilled after a preemption
    tokens_recomputed: int = 0   # tokens whose K/V were computed again (counted as their chunks are claimed)


class OptimisticAdmission:
    """vLLM's admission rule (the paper's §4.5), chosen in place of phase 4.1's worst-case reservation: a group is
    admitted when its prefill's blocks fit NOW, beside the running sequences' next tokens and a reserve. Its
    promise covers one step only; the engine keeps it by preempting (`_make_room_for_decode`)."""

    def __init__(self, engine: PreemptingEngine):
        self.engine = engine    # read only: its queues, groups, pool, KV part and prefill pass

    def blocks_left(self) -> int:
        """Free blocks beyond the running sequences' next tokens, counted once per step."""
        return self.engine.allocator.n_free - self.blocks_promised()

    def can_admit(self, seq: Sequence, blocks_left: int) -> bool:
        """`seq`'s whole group may start: nothing older is swapped out, its members find slots, and their prefill
        fits the blocks left (less the reserve, `watermark_blocks`) and this step's pass."""
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
        """Blocks `seq`'s prefill takes NOW: its prompt (+ outputs if recomputed), less the blocks it shares:
        a recomputed sample's full prompt blocks (forked from its lead), and cached blocks someone holds."""
        e = self.engine
        forked = len(seq.prompt_ids) // e.block_size if e.lead(seq) not in (None, seq) else 0
        return blocks_for(len(seq.all_ids), e.block_size) - forked - e.kv.blocks_in_use(seq, start_block=forked)

    def blocks_promised(self) -> int:
        """Only the blocks the running sequences claim in their next decode pass."""
        return sum(self.decode_blocks(m, self.engine.allocator) for m in self.engine.running_groups().values())

    def decode_blocks(self, seqs: list[Sequence], allocator: BlockAllocator) -> int:
        """Blocks the next decode pass takes for `seqs`, as `append_slots_cow` will; for one part-way through its
        prefill, what the rest of it takes (less the prompt blocks a recomputed member forks from its lead)."""
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
            # k tables write into this partly filled block; while it is shared each writer copies it,
            # except that the last one, if nobody else holds it, finds refcount 1 and writes in place.
            need += k - 1 if allocator.refcount(block) == k else k
        return need


class PreemptingEngine(PrefixCachingEngine):
    """Phase 4.3's engine (samples, prefix caching), admitting optimistically and preempting the latest request
    when the pool runs dry."""

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
        # request_id of every preemption / every admission and swap-in, in order (the latest ones)
        self.preempted_ids: deque[int] = deque(maxlen=DECISION_LOG_LENGTH)
        self.admitted_ids: deque[int] = deque(maxlen=DECISION_LOG_LENGTH)
        self._computed: dict[int, int] = {}      # seq_id -> tokens whose K/V it had when dropped for recompute

    def make_admission(self) -> OptimisticAdmission:
        return OptimisticAdmission(self)

    def make_swap_space(self, cpu_blocks: int) -> SwapSpace | NoSwapSpace:
        """The CPU pool of `cpu_blocks` blocks ("swap"), or none ("recompute")."""
        return SwapSpace(self.allocator, cpu_blocks) if self.preemption_mode == "swap" else NoSwapSpace()

    # --- requests -------------------------------------------------------------------
    def new_sequence(self, *args) -> PreemptibleSequence:
        """Phase 3.6's checked request, as a sequence that may be preempted."""
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

    # --- preemption ------------------------------------------------------------------------
    def _make_room_for_decode(self) -> bool:
        """Preempt the latest-arrived running groups until every running sequence has room for its next token."""
        preempted = False
        while (need := self.admission.blocks_promised()) > self.allocator.n_free:
            groups = self.running_groups()
            if len(groups) == 1:
                # add() guarantees a group fits the pool alone; only blocks held outside the engine break that.
                raise OutOfBlocks(f"request {next(iter(groups)).request_id} needs {need} blocks for its next "
                                  f"token, {self.allocator.n_free} are free and no other request is running to "
                                  f"preempt: {self.allocator.n_used} blocks are held outside the engine")
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
        # Back to the waiting queue at its arrival position: every new request arrived later, so
        # in practice that is the front, behind only earlier preempted groups.
        rids = [self.group_of(s).request_id for s in self.waiting]
        i = bisect_left(rids, group.request_id)
        for s in reversed(members):
            self.waiting.insert(i, s)

    # --- recovery: swap in -------------------------------------------------------------------
    def _swap_in(self) -> None:
        """Bring swapped groups back, earliest first, while they fit beside the running ones' next tokens."""
        while self.swapped:
            group = self.swapped[0]
            if self.waiting and self.waiting[0].status is PREEMPTED \
                    and self.group_of(self.waiting[0]).request_id < group.request_id:
                return  # an earlier group waits to be recomputed (a swap fallback): FCFS, it goes first
            members = self._preempted(group)
            tables = [s.kv for s in members]
            reserve = self.admission.blocks_promised() + self.admission.decode_blocks(members, self.swap_space.cpu)
            if self.running:
                reserve += self.watermark_blocks
            if len(members) > self.n_free_slots - self.slots_promised \
                    or not self.swap_space.can_swap_in(tables, reserve):
                return
            self.swap_space.swap_in(tables)
            self.swapped.popleft()
            self.admitted_ids.append(group.request_id)
            for s in members:
                s.move(Status.DECODING)
                self.running.append(s)

    # --- admission: optimistic (`OptimisticAdmission`), first come first served, whole groups -----------
    def admit(self) -> None:
        """Make room for every running sequence's next token, preempting the latest groups. A step that preempted
        admits nothing; otherwise swapped groups come back first, then phase 3.6's loop admits from the head."""
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
        """The waiting members of the head of the queue's group. They wait side by side at the head: a group
        is preempted whole, and its members go back to the queue together."""
        group = self.group_of(self.waiting[0])
        return list(takewhile(lambda s: self.group_of(s) is group, self.waiting))

    # --- recovery: recompute --------------------------------------------------------------------
    @staticmethod
    def _recomputing(seq: Sequence) -> bool:
        """Preempted and waiting to be recomputed, or admitted again and not re-prefilled yet."""
        return seq.status is PREEMPTED or (seq.status is Status.PREFILLING and bool(seq.output_ids))

    def lead(self, seq: Sequence) -> Sequence | None:
        """For a sequence being recomputed: the first of its group's members in the queue (members are admitted
        and prefilled in that order), which recomputes the shared prompt. None for any other sequence."""
        if not self._recomputing(seq):
            return None
        group = self.group_of(seq)
        queue = self.waiting if seq.status is PREEMPTED else self.running
        return next(s for s in queue if self.group_of(s) is group and self._recomputing(s))

    def claim(self, chunk):
        """Claim the chunk's slots, counting the tokens it computes again; once a recomputing lead has claimed its
        full prompt blocks (nobody writes them again, no copy-on-write splits them), its group's members fork them."""
        chunk = super().claim(chunk)
        self.stats.tokens_recomputed += max(0, min(chunk.end, self._computed_before(chunk.seq)) - chunk.start)
        if chunk.last:
            self._computed.pop(chunk.seq.seq_id, None)   # its prefill ends in this pass: all it had is back
        lead = chunk.seq
        full_prompt = len(lead.prompt_ids) // self.block_size * self.block_size
        if self._recomputing(lead) and self.lead(lead) is lead and lead.kv.n_filled >= full_prompt:
            group = self.group_of(lead)
            for seq in self.running:
                if seq is not lead and self.group_of(seq) is group and self._recomputing(seq):
                    self._fork_prompt(lead, seq)
        return chunk

    def _computed_before(self, seq: Sequence) -> int:
        """Tokens of `seq` whose K/V had been computed before it was dropped: every token but the last output for
        a sequence with outputs (that decode never ran), what the pool held for one preempted mid-prefill."""
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

    # --- accounting -------------------------------------------------------------------------------
    def summary(self) -> dict:
        """Every counter, JSON-ready (for demos and a server's /metrics)."""
        out = dict(self.stats.__dict__, n_swap_fallbacks=self.swap_space.n_fallbacks,
                   preemption_mode=self.preemption_mode,
                   n_swapped_out=0, n_swapped_in=0, blocks_swapped_out=0, blocks_swapped_in=0,
                   tokens_swapped_out=0, tokens_swapped_in=0, bytes_swapped_out=0, bytes_swapped_in=0, swap_s=0.0)
        for name, traffic in (("out", self.swap_space.out), ("in", self.swap_space.into)):
            out[f"n_swapped_{name}"] = traffic.n_swaps
            out[f"blocks_swapped_{name}"] = traffic.n_blocks
            out[f"tokens_swapped_{name}"] = traffic.n_tokens
            out["swap_s"] += traffic.seconds
            out[f"bytes_swapped_{name}"] = traffic.n_bytes
        return out
