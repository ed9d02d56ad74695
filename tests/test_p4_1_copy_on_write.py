"""Copy-on-write: forked tables share blocks by refcount, a shared block is copied before it is written,
and n parallel samples of one prompt hold one copy of its full blocks."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common.sampling import SamplingParams
from measure.workload import Request
from phases.p3_1_block_allocator.allocator import BlockAllocator, OutOfBlocks
from phases.p3_2_block_table.block_table import BlockTable
from phases.p3_10_cuda_graphs.engine import StaticDecodeEngine
from phases.p4_1_copy_on_write.block_ops import (CopyQueue, append_slots_cow, blocks_held, check_refcounts, fork,
                                                 needs_copy)
from phases.p4_1_copy_on_write.engine import SharingEngine, worst_case_blocks
from tests.oracles import hf_greedy

SAMPLING = SamplingParams(temperature=0.9, seed=1234)


# --- block operations, property-based --------------------------------------------------
def _tiny_pool(n_blocks: int, block_size: int) -> BlockAllocator:
    # one layer, one head, head_dim 1: each slot holds one K and one V number we can check
    return BlockAllocator(n_blocks, n_layers=1, n_kv_heads=1, head_dim=1, block_size=block_size,
                          dtype=torch.float32)


def _read(pool: BlockAllocator, table: BlockTable) -> list[float]:
    flat = pool.kv_store[:, 0, 0, 0, :, 0].reshape(-1)     # [n_blocks * block_size] K values by slot
    return flat[table.slot_mapping()].tolist()


ops = st.lists(st.tuples(st.sampled_from(["new", "fork", "append", "free"]), st.integers(0, 10 ** 6),
                         st.integers(1, 5)), min_size=1, max_size=40)


@settings(max_examples=80, deadline=None)
@given(ops=ops, block_size=st.sampled_from([1, 2, 3, 4]))
def test_random_fork_append_free_keeps_refcounts_contents_and_frees_everything(ops, block_size):
    pool = _tiny_pool(24, block_size)
    copies = CopyQueue()
    tables: list[BlockTable] = []
    expected: dict[BlockTable, list[float]] = {}  # what each table must read back
    next_value = 1.0
    for op, pick, n in ops:
        if op == "new" or not tables:
            table = BlockTable(block_size)
            tables.append(table)
            expected[table] = []
            continue
        table = tables[pick % len(tables)]
        if op == "fork":
            child = fork(table, pool)
            tables.append(child)
            expected[child] = list(expected[table])
        elif op == "free":
            table.release(pool)
            tables.remove(table)
            del expected[table]
        else:  # append n tokens, copy-on-write first if the block written into is shared
            before = list(table.block_ids)
            try:
                slots = append_slots_cow(table, pool, n, copies)
            except OutOfBlocks:
                assert table.block_ids == before  # all or nothing
                continue
            copies.flush(pool.kv_store)
            for slot in slots:
                block = slot // block_size
                assert pool.refcount(block) == 1, f"write into block {block} shared by {pool.refcount(block)}"
                pool.kv_store[block, 0, 0, 0, slot % block_size, 0] = next_value
                expected[table].append(next_value)
                next_value += 1
        check_refcounts(pool, tables)
        for t in tables:
            assert _read(pool, t) == expected[t]  # nobody saw another table's writes
    for t in tables:
        t.release(pool)
    assert pool.n_free == pool.n_blocks


def test_fork_shares_every_block_and_copy_happens_once_per_writer():
    pool = _tiny_pool(16, 4)
    copies = CopyQueue()
    parent = BlockTable(4)
    append_slots_cow(parent, pool, 6, copies)             # blocks: one full, one half-filled
    kids = [fork(parent, pool) for _ in range(2)]
    assert all(k.block_ids == parent.block_ids for k in kids)
    assert [pool.refcount(b) for b in parent.block_ids] == [3, 3]
    assert blocks_held([parent, *kids]) == (2, 6)
    append_slots_cow(kids[0], pool, 1, copies)            # first writer: copies the half block
    append_slots_cow(kids[1], pool, 1, copies)            # second writer: copies too
    assert not needs_copy(parent, pool)                    # the last owner writes in place
    append_slots_cow(parent, pool, 1, copies)
    assert len(copies) == 2 and copies.flush(pool.kv_store) == 2
    assert kids[0].block_ids[0] == kids[1].block_ids[0] == parent.block_ids[0]  # the full block stays shared
    assert len({kids[0].block_ids[1], kids[1].block_ids[1], parent.block_ids[1]}) == 3
    check_refcounts(pool, [parent, *kids])


def test_copy_queue_moves_whole_blocks_in_every_layer():
    pool = BlockAllocator(6, n_layers=3, n_kv_heads=2, head_dim=4, block_size=2, dtype=torch.float32)
    pool.kv_store.copy_(torch.randn_like(pool.kv_store))
    q = CopyQueue()
    q.add(1, 4)
    q.add(2, 5)
    before = pool.kv_store.clone()
    q.flush(pool.kv_store)
    assert torch.equal(pool.kv_store[4], before[1]) and torch.equal(pool.kv_store[5], before[2])
    assert torch.equal(pool.kv_store[:4], before[:4])


# --- the engine ------------------------------------------------------------------------
def test_n_samples_hold_one_copy_of_the_prompt_then_copy_the_partial_block_on_first_write(tiny32):
    engine = SharingEngine(tiny32, block_size=4, n_blocks=64)
    group = engine.add_group(list(range(300, 310)), 6, ignore_eos=True, n=4)
    engine.step()                                          # one prefill pass, then the fork
    assert engine.n_forward_passes == 1 and group.forked
    assert [group.index(s) for s in group.seqs] == [0, 1, 2, 3]
    ids = [s.kv.block_ids for s in group.seqs]
    assert all(t == ids[0] for t in ids) and len(ids[0]) == 3      # 10 tokens: 2 full blocks + 2 of 4
    assert [engine.allocator.refcount(b) for b in ids[0]] == [4, 4, 4]
    assert engine.allocator.n_used == 3                    # not 12
    engine.step()                                          # first decode: the copy-on-write moment
    assert engine.n_copied == 3                            # 3 writers copy, the 4th writes in place
    full = {tuple(s.kv.block_ids[:2]) for s in group.seqs}
    assert full == {tuple(ids[0][:2])}                     # full prompt blocks still shared by all
    assert len({s.kv.block_ids[2] for s in group.seqs}) == 4
    check_refcounts(engine.allocator, [s.kv for s in engine.running])
    engine.run()
    assert engine.allocator.n_free == engine.allocator.n_blocks


def test_seeded_samples_reproduce_differ_and_sample_0_is_the_plain_request(tiny32):
    def sample(n):
        engine = SharingEngine(tiny32, block_size=4, n_blocks=64)
        group = engine.add_group("Name one fruit.", 8, SAMPLING, ignore_eos=True, n=n)
        engine.run()
        return group.outputs
    first, second = sample(3), sample(3)
    assert first == second
    assert len({tuple(o) for o in first}) == 3             # each sample has its own generator
    plain = StaticDecodeEngine(tiny32, block_size=4, n_blocks=64)
    seq = plain.add("Name one fruit.", 8, SAMPLING, ignore_eos=True)
    plain.run()
    assert first[0] == seq.output_ids                      # sample i is seeded seed + i


def test_plain_requests_run_exactly_as_on_phase_3_10(tiny32):
    """add() is a group of one and returns its Sequence; with no samples the engine is phase 3.10's."""
    prompts = [list(range(300 + 9 * i, 305 + 11 * i)) for i in range(5)]
    runs = []
    for cls in (StaticDecodeEngine, SharingEngine):
        engine = cls(tiny32, max_running=2, block_size=4, n_blocks=9)  # the pool makes some wait
        seqs = [engine.add(p, 6 + i, ignore_eos=True) for i, p in enumerate(prompts)]
        assert all(type(s).__name__ == "Sequence" for s in seqs)
        engine.run()
        runs.append(([s.output_ids for s in seqs], engine.n_steps, engine.n_forward_passes, engine.peak_blocks_used,
                     sorted(engine.waited_for_blocks)))
    assert runs[0] == runs[1] and runs[0][4]
    assert engine.group_of(seqs[2]).seqs == [seqs[2]] and engine.n_copied == 0


def test_greedy_samples_all_equal_hf_greedy_packaged_model(smol32):
    engine = SharingEngine(smol32, block_size=16, n_blocks=64)
    groups = [engine.add_group(p, 16, n=3) for p in ["What is 2 + 2?", "Name one fruit."]]
    engine.run()
    for group in groups:
        reference = hf_greedy(smol32, group.prompt_ids, 16)
        assert group.outputs == [reference] * 3
    assert engine.allocator.n_free == engine.allocator.n_blocks


def test_groups_and_plain_requests_share_batches_and_copies_run_in_one_indexed_copy(tiny32):
    engine = SharingEngine(tiny32, max_running=16, block_size=4, n_blocks=128)
    flushes = []
    flush = engine.copies.flush
    engine.copies.flush = lambda kv: flushes.append(flush(kv)) or flushes[-1]
    prompts = [list(range(200, 205)), list(range(400, 409)), list(range(600, 614))]
    groups = [engine.add_group(p, 7, ignore_eos=True, n=n) for p, n in zip(prompts, (3, 1, 2))]
    while engine.has_work:
        engine.step()
        check_refcounts(engine.allocator, [s.kv for s in engine.running])
    # step 1: one prefill pass for the three prompts; step 2: one decode pass with all 6 sequences,
    # whose 2 + 1 copies (5 and 14 tokens end mid-block) ran as ONE indexed copy
    assert flushes[:2] == [0, 3] and engine.n_copied == 3
    assert engine.n_forward_passes == engine.n_steps == 7
    for group, p in zip(groups, prompts):
        assert group.outputs == [hf_greedy(tiny32, p, 7, ignore_eos=True)] * group.n
    assert engine.allocator.n_free == engine.allocator.n_blocks


def test_admission_counts_shared_blocks_once_and_needs_n_slots(tiny32):
    prompt = list(range(300, 316))                         # 16 tokens = 4 full blocks of 4
    need = worst_case_blocks(Request(prompt_ids=prompt, max_new_tokens=4), 4, 4)  # 4 shared + 4 x 1 own = 8
    assert need == 8                                       # (unshared: 4 x 5 = 20)
    engine = SharingEngine(tiny32, max_running=4, block_size=4, n_blocks=need)
    group = engine.add_group(prompt, 4, ignore_eos=True, n=4)
    engine.run()                                           # fits only because the prompt is stored once
    assert group.done and all(len(o) == 4 for o in group.outputs)
    with pytest.raises(ValueError, match="whole pool"):
        engine.add_group(prompt, 8, n=4)  # 4 + 4 x 2 = 12 > 8
    with pytest.raises(ValueError, match="max_running"):
        engine.add_group(prompt, 2, n=5)
    with pytest.raises(ValueError, match="n must be"):
        engine.add_group(prompt, 2, n=0)
    # a group waits until all n of its sequences have a slot
    engine = SharingEngine(tiny32, max_running=4, block_size=4, n_blocks=64)
    plain = engine.add([5, 6, 7], 3, ignore_eos=True)
    group = engine.add_group(prompt, 2, ignore_eos=True, n=4)
    engine.step()
    assert engine.running == [plain] and not group.forked
    engine.run()
    assert group.done and engine.allocator.n_free == engine.allocator.n_blocks


def test_abort_group_frees_shared_blocks(tiny32):
    engine = SharingEngine(tiny32, block_size=4, n_blocks=32)
    group = engine.add_group(list(range(300, 311)), 20, ignore_eos=True, n=3)
    engine.step()
    engine.step()
    engine.abort_group(group)
    assert group.done and all(s.finish_reason == "abort" for s in group.seqs)
    assert engine.allocator.n_free == engine.allocator.n_blocks


def test_cow_demo_runs_quick():
    from measure.cli import run_demo
    report = run_demo("cow_demo", model="tiny", device="cpu", dtype="fp32", quick=True)
    assert report.data["n_copied"] >= 1
    assert report.tables[0].rows
