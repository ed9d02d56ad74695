"""Phase 5.1: the served engine, driven directly (no HTTP): it refuses what would crash a step before queueing
anything, a failing pass fails only its culprit (every other output equal to an undisturbed run, token for
token), a fork that fails half-way rolls back, and `serve_workload` runs it beside phases 3.6 and 3.10.
"""

from __future__ import annotations

import math

import pytest

from common.sampling import SEED_MAX, GREEDY, InvalidSamplingParams, SamplingParams
from phases.p3_1_block_allocator.allocator import BlockAllocator
from phases.p3_2_block_table.block_table import BlockTable
from phases.p4_1_copy_on_write.block_ops import CopyQueue, append_slots_cow, check_refcounts, fork
from phases.p4_1_copy_on_write.engine import SharingEngine
from phases.p5_1_served_engine.engine import DECODE_PASS, PREFILL_PASS, ServingEngine, StepFailed
from tests.test_p4_5_speculative import refused_before_a_pool_is_taken

POISON_MAX_TOKENS = 13     # a request with this max_tokens makes every forward pass it is in raise


def test_the_engine_refuses_a_seed_its_samples_would_overflow_before_queueing_anything(tiny32):
    engine = ServingEngine(tiny32, max_running=4, block_size=16, n_blocks=32)
    with pytest.raises(InvalidSamplingParams) as e:
        engine.add_group([5, 6, 7], 4, SamplingParams(temperature=1.0, seed=SEED_MAX - 1), n=3)
    assert e.value.param == "seed"
    assert not engine.waiting and not engine.groups and engine._next_id == 0
    with pytest.raises(TypeError, match="SamplingParams"):
        engine.add([5, 6, 7], 4, sampling={"temperature": 1.0})


@pytest.mark.parametrize("k", [0, True])
def test_the_served_engine_refuses_a_bad_k_before_taking_a_pool(tiny32, k, monkeypatch):
    refused_before_a_pool_is_taken(
        lambda: ServingEngine(tiny32, speculative="ngram", num_speculative_tokens=k, n_blocks=8), monkeypatch)


class PoisonedEngine(ServingEngine):
    """Every forward pass that holds a request with max_tokens == POISON_MAX_TOKENS in the role `poisoned_kind`
    (prefilling a chunk, or decoding) raises, after its slots were claimed: a request-specific failure no
    validation can see."""
    poisoned_kind = PREFILL_PASS

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        run = self.runner.run

        def poisoned(batch):
            if any(g.max_new_tokens == POISON_MAX_TOKENS and self.poisoned_kind in roles
                   for g, roles in self.in_pass.items()):
                raise RuntimeError("poisoned pass")
            return run(batch)
        self.runner.run = poisoned


def run_to_end(engine) -> tuple[list[StepFailed], int]:
    failures = []
    while engine.has_work:
        try:
            engine.step()
        except StepFailed as f:
            failures.append(f)
    return failures


@pytest.mark.parametrize("kind,budget", [(PREFILL_PASS, None), (DECODE_PASS, None), (PREFILL_PASS, 7), (DECODE_PASS, 7)])
def test_the_culprit_of_a_failing_pass_is_found_and_fails_alone(tiny32, kind, budget):
    """Six requests, one poisoned, samples and seeds among them: the engine narrows its passes until the
    poisoned one fails alone; every other output equals an undisturbed run, token for token. With a budget of 7
    tokens the prompts (20-25 tokens) are prefilled in chunks beside decode tokens."""
    def add_all(engine, poison_index):
        groups = []
        for i in range(6):
            sampling = SamplingParams(temperature=1.0, seed=5 + i) if i % 2 else GREEDY
            groups.append(engine.add_group(list(range(10 + i, 30 + i)), POISON_MAX_TOKENS if i == poison_index else 12,
                                           sampling, ignore_eos=True, n=2 if i == 4 else 1))
        return groups

    chunks = {} if budget is None else dict(max_num_batched_tokens=budget)
    reference = ServingEngine(tiny32, max_running=8, block_size=4, n_blocks=256, **chunks)
    expected = add_all(reference, poison_index=None)
    assert not run_to_end(reference)
    engine = PoisonedEngine(tiny32, max_running=8, block_size=4, n_blocks=256, **chunks)
    engine.poisoned_kind = kind
    groups = add_all(engine, poison_index=3)
    failures = run_to_end(engine)
    assert [g.request_id for f in failures for g in f.failed] == [3]
    assert len(failures) <= math.ceil(math.log2(6)) + 1   # each failure halves the width or fails the culprit
    assert all(str(f.error) == "poisoned pass" for f in failures)
    for i, (g, ref) in enumerate(zip(groups, expected)):
        if i == 3:
            assert [s.finish_reason for s in g.seqs] == ["error"]
        else:
            assert [s.output_ids for s in g.seqs] == [s.output_ids for s in ref.seqs], i
            assert all(s.finish_reason == "length" for s in g.seqs)
    assert engine.allocator.n_free == engine.allocator.n_blocks and not engine.isolating
    assert engine.slots_promised == 0 and not engine.running and not engine.waiting
    check_refcounts(engine.allocator, [])


def test_a_fork_that_fails_half_way_rolls_back(tiny32):
    """Phase 4.1's fork is all or nothing: making the third sample raises (what a seed + i overflow did);
    the two made before it are taken back, and no block or slot leaks."""
    class FailingFork(SharingEngine):
        def new_member(self, group, parent, index):
            if index == 2:
                raise ValueError("Overflow when unpacking long long")
            return super().new_member(group, parent, index)

    engine = FailingFork(tiny32, max_running=4, block_size=4, n_blocks=32)
    group = engine.add_group(list(range(10, 21)), 4, SamplingParams(temperature=1.0, seed=1), n=3)
    with pytest.raises(ValueError, match="Overflow"):
        engine.step()
    parent = group.seqs[0]
    assert group.seqs == [parent] and engine.running == [parent] and engine.sequences == [parent]
    check_refcounts(engine.allocator, [parent.kv])     # only the parent's own table holds blocks
    engine.abort_group(group)
    assert engine.allocator.n_free == engine.allocator.n_blocks and not engine.running


def test_the_served_engine_fails_only_the_group_whose_fork_failed(tiny32):
    class FailingFork(ServingEngine):
        def new_member(self, group, parent, index):
            if group.sampling.seed == 99 and index == 2:
                raise ValueError("Overflow when unpacking long long")
            return super().new_member(group, parent, index)

    reference = ServingEngine(tiny32, max_running=8, block_size=4, n_blocks=64)
    engine = FailingFork(tiny32, max_running=8, block_size=4, n_blocks=64)
    for e in (reference, engine):
        e.good = e.add_group(list(range(40, 50)), 6, SamplingParams(temperature=1.0, seed=3), ignore_eos=True, n=2)
        e.bad = e.add_group(list(range(60, 70)), 6, SamplingParams(temperature=1.0, seed=99), ignore_eos=True, n=3)
    run_to_end(reference)
    failures = run_to_end(engine)
    assert [g for f in failures for g in f.failed] == [engine.bad]
    assert [s.output_ids for s in engine.good.seqs] == [s.output_ids for s in reference.good.seqs]
    assert engine.allocator.n_free == engine.allocator.n_blocks and engine.slots_promised == 0


def test_block_ops_are_all_or_nothing():
    alloc = BlockAllocator(8, n_layers=1, n_kv_heads=1, head_dim=2, block_size=4)
    table = BlockTable(4)
    table.append_slots(alloc, 6)                 # 2 blocks, the second half full
    alloc.free(table.block_ids[1])               # the table now lists a block nobody owns: a fork must fail ...
    with pytest.raises(Exception):
        fork(table, alloc)
    assert alloc.refcount(table.block_ids[0]) == 1   # ... and give back the reference it took on block 0
    table.block_ids[1] = alloc.alloc()
    child = fork(table, alloc)                   # the partial last block is now shared
    copies = CopyQueue()
    before = (list(child.block_ids), child.n_filled, alloc.n_free)

    real_alloc = alloc.alloc                     # the copy's block is granted, the next one is not
    calls = iter(range(1000))

    def alloc_once():
        if next(calls) >= 1:
            raise RuntimeError("device error")
        return real_alloc()
    alloc.alloc = alloc_once
    with pytest.raises(RuntimeError):
        append_slots_cow(child, alloc, 6, copies)  # copy-on-write of block 1, then a new block: fails
    alloc.alloc = real_alloc
    assert (list(child.block_ids), child.n_filled, alloc.n_free) == before and len(copies) == 0
    check_refcounts(alloc, [table, child])


def test_serve_workload_runs_the_served_engine_beside_3_5_and_3_7_with_the_same_outputs():
    from measure.cli import run_demo
    report = run_demo("serve_workload", model="tiny", device="cpu", dtype="fp32", quick=True)
    notes = " ".join(n for t in report.tables for n in t.notes)
    for engine in ("graphs", "served"):       # greedy, fixed lengths: every engine's tokens equal the first's
        assert f"{engine}: 4/4 outputs identical to batched's" in notes
    rows = report.data["results"]["equal"]
    assert rows["served"]["tok_s"] > 0 and rows["batched"]["tok_s"] > 0
    targets = next(t for t in report.tables if t.columns[-2:] == ["target", "met"])
    assert {tuple(r[:2]) for r in targets.rows} == {("equal", "served / batched tok/s"), ("mixed", "served / batched tok/s")}
