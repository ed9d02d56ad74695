"""Orca's reservations on this engine: the baselines the vLLM paper measures paged allocation against (§6.1).

Orca (as the paper builds it) keeps a request's K/V in one contiguous chunk, so it must reserve the chunk
when it admits the request, for the longest the request might grow, and hold all of it until the request
finishes. The paper tries three guesses of that length, and so does `ReservingEngine`:

  max     the context limit (the model's maximum length): no guess at all
  pow2    the next power of two of the request's final length (prompt + output): at most 2x over,
          the size a buddy allocator hands out
  oracle  exactly the final length: knowledge no real server has, Orca's upper bound

Paged allocation, vLLM's policy, is `PreemptingEngine` as it is: a request is admitted when its prompt
fits, takes a block only as one fills, and the latest request is preempted if the pool runs dry. The two
differ only in admission and in when blocks are claimed; the runner, the sampler and the pool are the
same, so a policy changes who runs when, never a token.

How a reservation runs here: first come, first served, the head of the queue is admitted when its whole
reservation is free (`ReservationAdmission`); `ReservedKV.new_table` claims every reserved block then; decoding
never runs out of blocks, so nothing is ever preempted; at the finish the whole reservation goes back
at once. Requests are of one sequence only (`new_request`); `UnsharedReservingEngine` is Orca (Oracle) for
requests of several sequences.
"""

from __future__ import annotations

from typing import Callable

from phases.p2_2_scheduler.sequence import Sequence
from phases.p3_1_block_allocator.allocator import BlockAllocator, OutOfBlocks, blocks_for
from phases.p3_2_block_table.block_table import BlockTable
from phases.p4_1_copy_on_write.block_ops import blocks_held
from phases.p4_1_copy_on_write.engine import GroupWorstCaseAdmission, SequenceGroup
from phases.p4_1_copy_on_write.kv import CowKV
from phases.p4_2_beam_search.engine import BeamSearchEngine
from phases.p4_4_preemption.engine import OptimisticAdmission, PreemptingEngine

RESERVATION_POLICIES = ("oracle", "pow2", "max")   # from the best guess of a request's length to the worst
PAGED = "paged"   # the name the demos give the plain PreemptingEngine beside the three reservations


def check_policy(policy: str) -> str:
    """`policy` if it names a reservation policy; ValueError naming the choices otherwise."""
    if policy not in RESERVATION_POLICIES:
        raise ValueError(f"unknown reservation policy {policy!r}: choose one of {list(RESERVATION_POLICIES)} "
                         f"(paged allocation, vLLM's policy, is the plain PreemptingEngine)")
    return policy


def reserved_tokens(policy: str, final_len: int, context_limit: int) -> int:
    """Tokens a request of `final_len` (prompt + output) reserves under `policy`, never past the context limit."""
    check_policy(policy)
    if policy == "max":
        return context_limit
    if policy == "pow2":
        return min(1 << (final_len - 1).bit_length(), context_limit)   # 25 -> 32, 32 -> 32, 33 -> 64
    return final_len


class ReservedKV(CowKV):
    """Block tables that claim their whole reservation at admission and never grow.

    Blocks stand in for Orca's contiguous chunk: a reservation of L tokens holds blocks_for(L) blocks, so the
    chunk is rounded up to a whole block (with small blocks, a few tokens). What the paper's Orca also loses to
    external fragmentation between chunks of different sizes is not modelled: blocks need not be adjacent.
    Both make these baselines slightly kinder than the paper's."""

    def __init__(self, allocator: BlockAllocator, reservation: Callable[[Sequence], int]):
        super().__init__(allocator)
        self.reservation = reservation    # seq -> tokens it reserves

    def blocks_reserved(self, seq: Sequence) -> int:
        return blocks_for(self.reservation(seq), self.block_size)

    def new_table(self, seq: Sequence) -> None:
        """`seq`'s table at admission, every reserved block claimed (all or nothing), none written yet: the table
        is full-size before the prefill writes a token, and never grows."""
        table = BlockTable(self.block_size)
        table.ensure_capacity(self.allocator, self.reservation(seq))
        seq.kv = table

    def append_slots(self, seq: Sequence, n: int) -> list[int]:
        """Slots for `seq`'s next `n` tokens, always inside its reservation."""
        table = seq.kv
        if table.n_filled + n > table.capacity:
            raise OutOfBlocks(f"sequence {seq.seq_id} would write {table.n_filled + n} tokens into a reservation "
                              f"of {table.capacity}: a reservation is never extended")
        return super().append_slots(seq, n)


class ReservationAdmission(OptimisticAdmission):
    """Phase 4.4's admission loop counting reservations: a request starts when its whole reservation is free."""

    def blocks_to_admit(self, seq: Sequence) -> int:
        """The whole reservation, claimed at admission."""
        return self.engine.kv.blocks_reserved(seq)

    def blocks_promised(self) -> int:
        """Nothing: every running request already holds all it will ever write, so no watermark is kept and
        nobody is ever preempted."""
        return 0


class ReservingEngine(PreemptingEngine):
    """Phase 4.4's engine admitting like Orca: each request holds its whole reservation from admission to finish."""

    def __init__(self, lm, policy: str, context_limit: int | None = None, **engine_kwargs):
        check_policy(policy)
        if "prefix_caching" in engine_kwargs or "watermark_blocks" in engine_kwargs:
            raise ValueError("a reserving engine has no prefix cache and keeps no watermark")
        self.policy = policy    # read by make_kv (through reserved_tokens), during phase 3.6's constructor
        self.context_limit = lm.max_context if context_limit is None else context_limit
        super().__init__(lm, prefix_caching=False, watermark_blocks=0, **engine_kwargs)
        if policy == "max" and blocks_for(self.context_limit, self.block_size) > self.allocator.n_blocks:
            raise ValueError(f"a context limit of {self.context_limit} tokens needs "
                             f"{blocks_for(self.context_limit, self.block_size)} blocks of {self.block_size}, but "
                             f"the whole pool has {self.allocator.n_blocks}: Orca (max) could never admit anyone")

    def make_kv(self) -> ReservedKV:
        return ReservedKV(self.allocator, self.reserved_tokens)

    def make_admission(self) -> ReservationAdmission:
        return ReservationAdmission(self)

    def reserved_tokens(self, seq: Sequence) -> int:
        """Tokens `seq` reserves. Its final length is what it asks for: run with ignore_eos=True and
        max_new_tokens = the number of tokens it generates, and Oracle knows it exactly. A request that may stop
        early at EOS still runs correctly; its reservation is then larger than it needed."""
        return reserved_tokens(self.policy, len(seq.prompt_ids) + seq.max_new_tokens, self.context_limit)

    # --- requests: one sequence each, within the context limit, a reservation the pool can hold ---------------
    def new_request(self, prompt, max_new_tokens, sampling, ignore_eos, arrival, n) -> Sequence:
        """One sequence only: n samples would fork blocks into reserved tables, so `add_group(n>1)` is refused
        here."""
        if n != 1:
            raise ValueError(f"a reserving engine serves requests of one sequence; got n={n}")
        return super().new_request(prompt, max_new_tokens, sampling, ignore_eos, arrival, n)

    def new_sequence(self, prompt, max_new_tokens, sampling, ignore_eos, arrival) -> Sequence:
        seq = super().new_sequence(prompt, max_new_tokens, sampling, ignore_eos, arrival)
        final = len(seq.prompt_ids) + max_new_tokens
        if final > self.context_limit:
            raise ValueError(f"prompt of {len(seq.prompt_ids)} + {max_new_tokens} new tokens is past the context "
                             f"limit of {self.context_limit}")
        need = self.kv.blocks_reserved(seq)
        if need > self.allocator.n_blocks:
            raise ValueError(f"Orca ({self.policy}) reserves {self.reserved_tokens(seq)} tokens = {need} blocks "
                             f"of {self.block_size} for this request, but the whole pool has "
                             f"{self.allocator.n_blocks}")
        return seq


class UnsharedAdmission(GroupWorstCaseAdmission):
    """Orca (Oracle) for requests of n sequences: each sequence reserves its own copy of the prompt and its
    final length, n x blocks_for(prompt + max_new_tokens), from admission to finish."""

    def reserved(self, group: SequenceGroup) -> int:
        return group.n * blocks_for(len(group.prompt_ids) + group.max_new_tokens, self.engine.block_size)

    def blocks_to_admit(self, seq: Sequence) -> int:
        return self.reserved(self.engine.group_of(seq))

    def blocks_promised(self) -> int:
        """What the running requests reserved and do not hold yet: counted as if claimed, as Orca claims it."""
        e = self.engine
        groups = {e.group_of(s) for s in e.running}
        return sum(max(0, self.reserved(g) - blocks_held([s.kv for s in g.live if s.kv is not None])[0])
                   for g in groups)


class UnsharedReservingEngine(BeamSearchEngine):
    """Phase 4.2's engine (samples and beams) admitting like Orca (Oracle): nothing shared, all reserved.

    Requests of several sequences (n samples, a beam search of width k) are what the paper's Fig. 14 measures.
    Orca keeps each sequence in its own chunk, so it shares nothing: a request is admitted when k unshared
    copies of its final length fit beside what the running requests reserved. The blocks are still shared
    underneath (phase 4.1's tables fork); only the count that admission keeps is Orca's, and that count alone
    sets how many requests run at once."""

    def make_admission(self) -> UnsharedAdmission:
        return UnsharedAdmission(self)

    def new_request(self, prompt, max_new_tokens, sampling, ignore_eos, arrival, n) -> Sequence:
        """Refused up front if its n unshared copies could never fit the pool, even alone."""
        seq = super().new_request(prompt, max_new_tokens, sampling, ignore_eos, arrival, n)
        need = n * blocks_for(len(seq.prompt_ids) + max_new_tokens, self.block_size)
        if need > self.allocator.n_blocks:
            raise ValueError(f"Orca (oracle) reserves {n} unshared copies of {len(seq.prompt_ids)} + {max_new_tokens} "
                             f"tokens = {need} blocks of {self.block_size}, but the whole pool has "
                             f"{self.allocator.n_blocks}")
        return seq
