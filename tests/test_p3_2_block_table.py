"""Phase 3.2: block tables map tokens to owned blocks, grow all-or-nothing, and give every block back."""

from collections import Counter

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from phases.p3_1_block_allocator import AllocatorError, BlockAllocator, OutOfBlocks, blocks_for
from phases.p3_2_block_table import BlockTable

BS = 4


def pool(n_blocks, block_size=BS):
    # "meta": the bookkeeping is real, the tensor takes no memory (the tests never read K/V)
    return BlockAllocator(n_blocks, n_layers=1, n_kv_heads=1, head_dim=1, block_size=block_size, device="meta")


# --- unit tests -------------------------------------------------------------------
def test_lesson_example_token_6_lives_in_block_2_offset_2():
    # The worked lookup of the paged-attention lesson in the seeds ("Part 3: Paged Attention"):
    # 9 tokens in blocks [5, 2, 8] of 4 tokens each.
    t = BlockTable(block_size=4, block_ids=[5, 2, 8], n_filled=9)
    assert t.physical_pos(6) == (2, 2)
    assert t.physical_pos(0) == (5, 0) and t.physical_pos(8) == (8, 0)
    assert t.slot(6) == 2 * 4 + 2
    assert t.slot_mapping() == [20, 21, 22, 23, 8, 9, 10, 11, 32]
    assert (t.n_blocks, t.capacity, t.tail_waste) == (3, 12, 3)


def test_maybe_extend_takes_a_block_only_at_a_boundary():
    a = pool(8)
    t = BlockTable(BS)
    for i in range(9):
        t.maybe_extend(a)
        assert t.n_blocks == i // BS + 1
        t.append_slots(a, 1)
    assert t.n_filled == 9 and t.n_blocks == 3 and a.n_used == 3 and t.tail_waste == 3


def test_prefill_takes_every_block_at_once_and_slots_follow_the_table():
    a = pool(8)
    a.alloc()  # someone else holds block 0, so physical != logical
    t = BlockTable(BS)
    slots = t.append_slots(a, 10)
    assert t.block_ids == [1, 2, 3]
    assert slots == [4, 5, 6, 7, 8, 9, 10, 11, 12, 13]
    assert t.append_slots(a, 1) == [14] and t.append_slots(a, 0) == []
    assert t.slot_mapping(9, 11) == [13, 14]


def test_ensure_capacity_is_all_or_nothing():
    a = pool(3)
    other = BlockTable(BS)
    other.append_slots(a, 1)
    t = BlockTable(BS)
    t.append_slots(a, 3)
    with pytest.raises(OutOfBlocks):
        t.ensure_capacity(a, 1 + 2 * BS)  # needs 2 more blocks, 1 is free
    assert (t.block_ids, t.n_filled, a.n_free) == ([1], 3, 1)  # nothing taken, nothing changed
    with pytest.raises(OutOfBlocks):
        t.append_slots(a, 1 + 2 * BS)
    assert t.n_filled == 3
    assert t.ensure_capacity(a, 1 + BS) == [2] and a.n_free == 0


def test_physical_pos_past_the_filled_tokens_is_an_index_error():
    a = pool(4)
    t = BlockTable(BS)
    t.append_slots(a, 5)  # capacity 8, but only 5 tokens written
    with pytest.raises(IndexError, match=r"position 5 .* holds 5 tokens"):
        t.physical_pos(5)
    with pytest.raises(IndexError):
        t.physical_pos(-1)
    with pytest.raises(IndexError, match="outside"):
        t.slot_mapping(3, 6)


def test_release_returns_every_block_and_a_second_release_is_harmless():
    a = pool(4)
    t = BlockTable(BS)
    t.append_slots(a, 2 * BS + 1)
    t.release(a)
    assert (t.block_ids, t.n_filled, a.n_free) == ([], 0, 4)
    t.release(a)  # an empty table gives nothing back
    assert a.n_free == 4


def test_releasing_a_stale_copy_of_a_table_is_a_double_free():
    a = pool(4)
    t = BlockTable(BS)
    t.append_slots(a, 3)
    stale = BlockTable(BS, list(t.block_ids), t.n_filled)
    t.release(a)
    with pytest.raises(AllocatorError, match="double free"):
        stale.release(a)


def test_bad_arguments():
    with pytest.raises(ValueError, match="block_size"):
        BlockTable(0)
    with pytest.raises(ValueError, match="does not fit"):
        BlockTable(4, [1], n_filled=5)
    with pytest.raises(ValueError, match="n_new_tokens"):
        BlockTable(4).ensure_capacity(pool(2), -1)


def test_one_token_at_a_time_claims_the_slots_a_whole_range_would():
    """The decode path (one token, usually into the last block) gives the same slots as the general one."""
    a = pool(4)
    one = BlockTable(BS)
    slots = [one.append_slots(a, 1)[0] for _ in range(2 * BS + 1)]
    assert slots == [one.slot(pos) for pos in range(2 * BS + 1)] == one.slot_mapping()
    assert one.n_blocks == 3 and one.n_filled == 2 * BS + 1 and a.n_free == 1


def test_a_write_through_the_slot_mapping_reads_back_through_physical_pos():
    a = BlockAllocator(4, n_layers=1, n_kv_heads=1, head_dim=1, block_size=BS, dtype=torch.float32)
    a.alloc()
    t = BlockTable(BS)
    slots = t.append_slots(a, 6)
    for value, s in enumerate(slots, start=1):  # how a cache writes token K: by slot
        a.kv_store[s // BS, 0, 0, 0, s % BS, 0] = float(value)
    for pos in range(6):
        block, offset = t.physical_pos(pos)
        assert a.kv_store[block, 0, 0, 0, offset, 0].item() == pos + 1


# --- properties: many tables sharing one pool ---------------------------------------------
class ManyTables(RuleBasedStateMachine):
    """Random interleavings of new / extend / fork / release across tables that share a pool."""

    tables = Bundle("tables")

    def __init__(self):
        super().__init__()
        self.alloc = pool(12)
        self.live: list[BlockTable] = []

    @rule(target=tables, n=st.integers(1, 3 * BS))
    def new_table(self, n):
        t = BlockTable(BS)
        try:
            t.append_slots(self.alloc, n)
        except OutOfBlocks:
            assert t.block_ids == [] and t.n_filled == 0
        self.live.append(t)
        return t

    @rule(t=tables, n=st.integers(0, 2 * BS))
    def extend(self, t, n):
        if t not in self.live:
            return
        before = (list(t.block_ids), t.n_filled, self.alloc.n_free)
        try:
            new = t.append_slots(self.alloc, n)
        except OutOfBlocks:
            assert (t.block_ids, t.n_filled, self.alloc.n_free) == before
            return
        # new tokens only ever land in blocks this table alone owns
        assert all(self.alloc.refcount(s // BS) == 1 for s in new)

    @rule(t=tables)
    def decode_one(self, t):
        if t not in self.live:
            return
        try:
            t.maybe_extend(self.alloc)
        except OutOfBlocks:
            return
        t.append_slots(self.alloc, 1)

    @rule(target=tables, t=tables)
    def fork(self, t):
        """A child shares the parent's full blocks (a common prefix), counted with incref."""
        full = t.n_filled // BS if t in self.live else 0
        child = BlockTable(BS, list(t.block_ids[:full]), full * BS)
        for b in child.block_ids:
            self.alloc.incref(b)
        self.live.append(child)
        return child

    @rule(t=consumes(tables))
    def release(self, t):
        if t in self.live:
            t.release(self.alloc)
            self.live.remove(t)

    @invariant()
    def bookkeeping_matches_the_tables(self):
        a = self.alloc
        a.check_invariants()
        holders = Counter(b for t in self.live for b in t.block_ids)
        for b in range(a.n_blocks):
            assert a.refcount(b) == holders[b]  # refcount == number of tables holding it; free <=> held by none
        assert a.n_used == len(holders)
        slot_owners: dict[int, set[int]] = {}
        for i, t in enumerate(self.live):
            assert len(set(t.block_ids)) == t.n_blocks  # a table never lists a block twice
            assert t.n_blocks == blocks_for(t.n_filled, BS)    # no block beyond the one the tail needs
            for pos in range(t.n_filled):
                block, offset = t.physical_pos(pos)
                assert block in t.block_ids and a.refcount(block) >= 1 and 0 <= offset < BS
                slot_owners.setdefault(t.slot(pos), set()).add(i)
        for s, owners in slot_owners.items():
            # two tables map the same slot only inside a block both of them hold (and count)
            assert len(owners) == 1 or a.refcount(s // BS) >= len(owners)

    def teardown(self):
        for t in self.live:
            t.release(self.alloc)
        assert self.alloc.n_free == self.alloc.n_blocks, "blocks leaked after every table was released"
        self.alloc.check_invariants()


TestManyTables = ManyTables.TestCase
TestManyTables.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


# --- demos (tiny model, quick settings) ------------------------------------------------------
def test_table_demo_one_sequence():
    from measure.cli import run_demo
    report = run_demo("table_demo", model="tiny", device="cpu", dtype="fp32", quick=True)
    summary = report.tables[0]
    prompt, generated, total, written, bs, blocks, waste = summary.rows[0]
    assert written == total - 1 and blocks == blocks_for(written, bs) and waste == blocks * bs - written
    titles = [t.title for t in report.tables[1:]]
    assert titles[0].startswith("after prefill") and titles[-1].startswith(("finished", "after token"))
    last = report.tables[-1].rows
    assert [r[0] for r in last] == list(range(blocks)) and last[-1][3] == f"{bs - waste}/{bs}"
    assert all(s["end"] > s["start"] for s in report.data["spans"])


def test_table_demo_concurrent_reuses_returned_blocks():
    from measure.cli import run_demo
    report = run_demo("table_demo", model="tiny", device="cpu", dtype="fp32", quick=True,
                      options={"concurrent": 2})
    seqs = report.tables[-1].rows
    assert len(seqs) == 4
    assert sum(r[-1] for r in seqs) > 0  # later sequences got blocks earlier ones returned
    spans = report.data["spans"]
    for b in {s["block"] for s in spans}:  # a block never has two owners at once
        mine = sorted((s["start"], s["end"]) for s in spans if s["block"] == b)
        assert all(e1 <= s2 for (_, e1), (s2, _) in zip(mine, mine[1:]))


def test_block_size_study_trade_off():
    from measure.cli import run_demo
    report = run_demo("block_size_study", model="tiny", device="cpu", dtype="fp32", quick=True,
                      options={"block_sizes": [1, 4, 16, 64]})
    d = report.data
    assert d["waste_pct"][0] == 0
    assert d["table_entries"] == sorted(d["table_entries"], reverse=True)
    assert d["table_entries"][0] == sum(d["tokens"])  # block size 1: one entry per token
    for row in report.tables[0].rows:
        assert row[3] < row[0] * d["n_sequences"]  # tail waste < one block per sequence


def test_vm_analogy_walks_a_real_block_table(tmp_path):
    from measure.cli import run_demo
    from phases.p3_2_block_table.demo import VM_BLOCK_SIZE, VM_TOKEN, plot_vm
    report = run_demo("vm_analogy", device="cpu", quick=True)
    process, sequence = report.data["panels"]
    table = sequence["table"]
    assert table != sorted(range(min(table), min(table) + len(table)))    # A's blocks are not contiguous
    assert table[VM_TOKEN // VM_BLOCK_SIZE] not in sequence["others"]      # the walked block is A's own
    assert process["table"][process["address"] // process["unit_size"]] == 9
    plot_vm(report, tmp_path / "vm.png")
    assert (tmp_path / "vm.png").stat().st_size > 0
