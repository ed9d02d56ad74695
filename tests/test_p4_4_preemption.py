"""Preemption: optimistic FCFS admission, the latest group preempted whole, recomputed or swapped back in;
outputs equal an unlimited pool's, nothing lost, nothing leaked."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.sampling import SamplingParams
from measure.harness import drive, outputs_of
from measure.workload import TracedRequest, burst, stress_trace
from phases.p2_2_scheduler.sequence import Status
from phases.p3_1_block_allocator.allocator import BlockAllocator, OutOfBlocks
from phases.p3_2_block_table.block_table import BlockTable
from phases.p4_1_copy_on_write.block_ops import blocks_held, check_refcounts, fork
from phases.p3_1_block_allocator.allocator import blocks_for
from phases.p4_1_copy_on_write.engine import SharingEngine, worst_case_blocks
from measure.preempt_checks import Audited, check_finished
from phases.p4_4_preemption.engine import PREEMPTED, PreemptingEngine
from phases.p4_4_preemption.swap import SwapSpace
from tests.oracles import hf_greedy

MODES = ["recompute", "swap"]
PACKAGED_PROMPTS = ["What is the capital of France?",
                    "Explain in detail how the attention mechanism works in a transformer.",
                    "Write a short story about a robot who learns to paint."]
PACKAGED_NEW_TOKENS = 16


pytestmark = pytest.mark.usefixtures("one_thread")   # many tiny passes: one thread is faster


class Engine(Audited, PreemptingEngine):
    """The last engine (samples, preemption), every scheduling decision audited (checks.py). Prefix caching
    is off unless a test turns it on: these tests are about preemption, and a cache hit would change its counts."""

    def __init__(self, *args, prefix_caching: bool = False, **kwargs):
        super().__init__(*args, prefix_caching=prefix_caching, **kwargs)


def _unlimited(lm, trace, block_size, prefix_caching=False):
    n_blocks = sum(worst_case_blocks(r, r.n, block_size) for r in trace)
    engine = Engine(lm, block_size=block_size, n_blocks=n_blocks, max_running=64, prefix_caching=prefix_caching)
    groups = drive(engine, trace)
    assert engine.stats.n_preemptions == 0
    return outputs_of(groups)


def chunked(budget: int | None) -> dict:
    """Engine kwargs for a per-step token budget (phase 3.8's chunked prefill); None: the default budget."""
    return {} if budget is None else dict(max_num_batched_tokens=budget)


def _fits_alone(trace, block_size):
    return max(worst_case_blocks(r, r.n, block_size) for r in trace)


# --- outputs: identical to an unlimited pool, and to HF ---------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_greedy_outputs_equal_unlimited_pool_and_hf_under_many_preemptions(tiny32, mode):
    trace = burst(tiny32.vocab_size, 10, (3, 14), (4, 16), seed=3)
    engine = Engine(tiny32, preemption_mode=mode, block_size=2, n_blocks=_fits_alone(trace, 2) + 3)
    groups = drive(engine, trace)
    assert engine.stats.n_preemptions >= 5
    assert check_finished(engine, groups) == []
    assert outputs_of(groups) == _unlimited(tiny32, trace, 2)
    for r, g in list(zip(trace, groups))[:3]:
        assert g.outputs[0] == hf_greedy(tiny32, r.prompt_ids, r.max_new_tokens, ignore_eos=True)


@pytest.mark.parametrize("mode", MODES)
def test_packaged_model_fp32_preempted_requests_equal_hf_generate(smol32, mode):
    ids = [smol32.prompt_ids(p) for p in PACKAGED_PROMPTS]
    block_size = 8
    # room for every prompt and a couple of blocks more: decoding soon runs out and preempts
    n_blocks = sum(blocks_for(len(p), block_size) for p in ids) + 2
    # the engine as it is served: prefix caching on (the prompts share the chat template's system prompt)
    engine = PreemptingEngine(smol32, preemption_mode=mode, block_size=block_size, n_blocks=n_blocks)
    seqs = [engine.add(p, PACKAGED_NEW_TOKENS) for p in ids]
    engine.run()
    assert engine.stats.n_preemptions >= 1
    for seq in seqs:
        assert seq.output_ids == hf_greedy(smol32, seq.prompt_ids, PACKAGED_NEW_TOKENS)
    assert engine.allocator.n_free == engine.allocator.n_blocks


@pytest.mark.parametrize("mode", MODES)
def test_seeded_samples_reproduce_with_and_without_preemption(tiny32, mode):
    trace = [TracedRequest(list(range(200 + 7 * i, 209 + 7 * i)), 10, kind="samples", n=2 + i % 2, seed=i)
             for i in range(4)] + burst(tiny32.vocab_size, 3, (4, 9), (6, 12), seed=5)
    engine = Engine(tiny32, preemption_mode=mode, block_size=2, n_blocks=_fits_alone(trace, 2) + 2)
    groups = drive(engine, trace)
    assert engine.stats.n_preemptions >= 3
    assert check_finished(engine, groups) == []
    out = outputs_of(groups)
    assert out == _unlimited(tiny32, trace, 2)
    assert all(len({tuple(o) for o in req}) > 1 for req in out[:4])  # each sample drew its own tokens


# --- property-based: random workloads, random pools --------------------------------------------------------
@settings(max_examples=35, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10 ** 6), n_requests=st.integers(2, 8), block_size=st.sampled_from([1, 2, 4]),
       slack=st.integers(0, 4), mode=st.sampled_from(MODES), max_running=st.sampled_from([3, 4, 64]),
       cpu_blocks=st.one_of(st.none(), st.integers(1, 4)), prefix_caching=st.booleans(),
       budget=st.sampled_from([None, 1, 3, 5, 8]))
def test_random_workloads_keep_every_promise(tiny32, seed, n_requests, block_size, slack, mode, max_running,
                                             cpu_blocks, prefix_caching, budget):
    trace = stress_trace(tiny32.vocab_size, n_requests, (1, 10), (1, 12), burst_size=(1, 4), burst_gap=(0, 2),
                         p_samples=0.25, p_beam=0.0, max_n=3, seed=seed)
    # the smallest pools every request fits in alone; a tiny CPU pool forces swaps to fall back to recomputation
    engine = Engine(tiny32, preemption_mode=mode, block_size=block_size, max_running=max_running,
                    n_blocks=_fits_alone(trace, block_size) + slack, cpu_blocks=cpu_blocks,
                    prefix_caching=prefix_caching, **chunked(budget))
    groups = drive(engine, trace)
    # every request done, each sequence finished once, no leak in either pool, FCFS admission and
    # swap-in, the latest-arrived group preempted, never part of a group (Audited)
    assert check_finished(engine, groups) == []
    assert outputs_of(groups) == _unlimited(tiny32, trace, block_size)   # the cache never changes a token


# --- the scheduling rules, one scenario each --------------------------------------------------------------
def _tight(lm, mode, **kwargs):
    """Three 6-token requests growing to 16 tokens in a pool of 9 blocks of 4: the third must go."""
    engine = Engine(lm, preemption_mode=mode, block_size=4, n_blocks=9, watermark_blocks=0, **kwargs)
    groups = [engine.add_group(list(range(300 + 10 * i, 306 + 10 * i)), 10, ignore_eos=True, n=1) for i in range(3)]
    return engine, groups


def test_latest_group_is_preempted_and_goes_back_to_the_front_of_the_queue(tiny32):
    engine, (a, b, c) = _tight(tiny32, "recompute")
    while not engine.preempted_ids:
        engine.step()
    assert list(engine.preempted_ids) == [c.request_id]
    assert engine.waiting[0] is c.seqs[0] and c.seqs[0].status is PREEMPTED
    assert c.seqs[0].kv is None                            # its blocks were dropped
    d = engine.add_group([7, 8, 9], 2, n=1)                # a new request queues behind the preempted one
    assert list(engine.waiting) == [c.seqs[0], d.seqs[0]]
    engine.run()
    assert engine.admitted_ids.index(c.request_id, 3) < engine.admitted_ids.index(d.request_id)
    history = c.seqs[0].history
    assert history[:5] == [Status.WAITING, Status.PREFILLING, Status.DECODING, PREEMPTED, Status.PREFILLING]
    assert check_finished(engine, [a, b, c, d]) == []


def test_nothing_new_is_admitted_while_a_group_is_swapped_out(tiny32):
    engine, groups = _tight(tiny32, "swap")
    while not engine.swapped:
        engine.step()
    late = engine.add_group([5, 6], 2, n=1)                # would fit, but the swapped group comes first
    while engine.swapped:
        assert late.seqs[0].status is Status.WAITING
        engine.step()
    engine.run()
    assert check_finished(engine, groups + [late]) == []
    assert engine.swap_space.out.n_swaps == engine.swap_space.into.n_swaps >= 1


@pytest.mark.parametrize("mode", MODES)
def test_a_streaming_client_sees_each_token_once_in_order(tiny32, mode):
    engine, groups = _tight(tiny32, mode)
    streamed = {s.seq_id: [] for g in groups for s in g.seqs}
    while engine.has_work:
        for out in engine.step():
            streamed[out.seq.seq_id].append(out.token_id)   # recomputation re-sends nothing
    assert engine.stats.n_preemptions >= 1
    assert all(streamed[s.seq_id] == s.output_ids for g in groups for s in g.seqs)


def test_swapping_a_sample_group_copies_each_shared_block_once(tiny32):
    class Recording(Engine):
        def _preempt(self, group, members):
            self.seen.append(blocks_held([s.kv for s in members]))  # (distinct, sum of table lengths)
            super()._preempt(group, members)

    engine = Recording(tiny32, preemption_mode="swap", block_size=2, n_blocks=24, watermark_blocks=0)
    engine.seen = []
    first = engine.add_group(list(range(400, 410)), 20, ignore_eos=True, n=1)
    group = engine.add_group(list(range(500, 512)), 12, SamplingParams(temperature=1.0, seed=3), ignore_eos=True, n=3)
    engine.run()
    assert engine.seen and all(distinct < total for distinct, total in engine.seen)  # the prompt is shared
    assert engine.swap_space.out.n_blocks == sum(distinct for distinct, _ in engine.seen)
    assert check_finished(engine, [first, group]) == []


@pytest.mark.parametrize("batched", [True, False])
def test_swap_space_round_trip_keeps_contents_and_sharing(batched):
    gpu = BlockAllocator(10, n_layers=2, n_kv_heads=1, head_dim=3, block_size=2, dtype=torch.float32)
    gpu.kv_store.copy_(torch.randn_like(gpu.kv_store))
    parent = BlockTable(2)
    parent.append_slots(gpu, 5)                      # 3 blocks
    child = fork(parent, gpu)                        # shares all 3
    other = BlockTable(2)
    other.append_slots(gpu, 2)                       # not part of the group: must stay put
    before = {id(t): gpu.kv_store[t.block_ids].clone() for t in (parent, child)}
    space = SwapSpace(gpu, n_blocks=4, batched=batched)   # one indexed copy, or one copy per block
    assert space.swap_out([parent, child]) == 3      # copied once, not twice
    assert gpu.n_used == 1 and space.cpu.n_used == 3
    check_refcounts(space.cpu, [parent, child])      # CPU refcount 2 each: the sharing moved along
    assert space.out.n_bytes == 3 * gpu.bytes_per_block and space.out.n_tokens == 5
    space.swap_in([parent, child])
    check_refcounts(gpu, [parent, child, other])
    assert parent.block_ids == child.block_ids and space.cpu.n_free == 4 and parent.n_filled == 5
    for t in (parent, child):
        assert torch.equal(gpu.kv_store[t.block_ids], before[id(t)])
    with pytest.raises(OutOfBlocks):
        SwapSpace(gpu, n_blocks=2).swap_out([parent, child])


def test_swap_space_is_pinned_only_for_a_cuda_pool():
    """Pinned CPU memory lets the GPU copy blocks by DMA (and swap-in without waiting); it needs CUDA.
    A CUDA pool is faked (FakeTensorMode: shapes and devices, no data), so this runs without a GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    shape = dict(n_layers=2, n_kv_heads=1, head_dim=4, block_size=2, dtype=torch.float32)
    on_cpu = SwapSpace(BlockAllocator(4, **shape), n_blocks=4)
    assert not on_cpu.pinned and not on_cpu.cpu.kv_store.is_pinned()
    with FakeTensorMode():
        on_cuda = SwapSpace(BlockAllocator(4, **shape, device="cuda"), n_blocks=4)
    assert on_cuda.pinned and on_cuda.cpu.kv_store.device.type == "cpu"


# --- requests that cannot fit, misuse, aborts ---------------------------------------------------------------
def test_a_prompt_that_cannot_fit_is_refused_up_front_and_the_others_finish(tiny32):
    engine = PreemptingEngine(tiny32, block_size=4, n_blocks=5)
    with pytest.raises(ValueError, match=r"20 prompt \+ 2 new tokens need up to 6 blocks of 4, .*whole pool has 5"):
        engine.add(list(range(100, 120)), 2)          # the prompt and its first token fed back: 21 tokens
    with pytest.raises(ValueError, match=r"3 sequences of 12 prompt \+ 2 new tokens need up to 6 blocks"):
        engine.add_group(list(range(100, 112)), 2, n=3)
    with pytest.raises(ValueError, match=r"8 prompt \+ 40 new tokens need up to 12 blocks"):
        engine.add(list(range(100, 108)), 40)          # could outgrow the pool alone
    assert not engine.has_work and not engine.groups  # nothing half-queued
    ok = [engine.add(list(range(200 + 9 * i, 206 + 9 * i)), 8, ignore_eos=True) for i in range(3)]
    engine.run()
    assert all(s.status is Status.DONE for s in ok) and engine.stats.n_preemptions >= 1
    assert engine.allocator.n_free == engine.allocator.n_blocks


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="preemption_mode"):
        PreemptingEngine(None, preemption_mode="drop")


def test_blocks_held_outside_the_engine_give_a_clear_error_not_a_hang(tiny32):
    engine = PreemptingEngine(tiny32, block_size=4, n_blocks=6)
    engine.add(list(range(100, 108)), 12, ignore_eos=True)
    engine.step()
    while engine.allocator.n_free:
        engine.allocator.alloc()                     # someone else takes the rest of the pool
    with pytest.raises(OutOfBlocks, match="held outside the engine"):
        for _ in range(8):
            engine.step()


def test_aborting_a_swapped_group_frees_its_cpu_blocks(tiny32):
    engine, (a, b, c) = _tight(tiny32, "swap")
    while not engine.swapped:
        engine.step()
    victim = engine.swapped[0]
    assert engine.swap_space.cpu.n_used > 0
    engine.abort_group(victim)
    assert not engine.swapped and engine.swap_space.cpu.n_used == 0
    assert all(s.finish_reason == "abort" for s in victim.seqs)
    engine.run()
    assert check_finished(engine, [a, b, c]) == []


# --- with prefix caching on (the engine as it is served) ----------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_prefix_caching_composes_and_recompute_reuses_cached_blocks(tiny32, mode):
    system = list(range(1000, 1012))                                 # a shared 12-token prefix
    trace = [TracedRequest(system + list(range(2000 + 9 * i, 2004 + 9 * i)), 10) for i in range(6)]
    trace += [TracedRequest(system + [42, 43], 8, kind="samples", n=3, seed=9),
              TracedRequest(system + [44, 45, 46], 8, kind="samples", n=2, seed=10)]
    engine = Engine(tiny32, preemption_mode=mode, block_size=4, n_blocks=_fits_alone(trace, 4) + 4,
                    prefix_caching=True)
    groups = drive(engine, trace)
    assert engine.stats.n_preemptions >= 2
    assert check_finished(engine, groups) == []
    reference = SharingEngine(tiny32, block_size=4, n_blocks=256)   # phase 4.1: no cache, no preemption
    ref = [reference.add_group(r.prompt_ids, r.max_new_tokens, r.sampling, ignore_eos=True, n=r.n)
           for r in trace]
    reference.run()
    assert outputs_of(groups) == [g.outputs for g in ref]
    assert engine.cache_stats.tokens_skipped > 0


# --- demos --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["preempt_demo", "stress_demo"])
def test_demos_run_quick_on_the_tiny_model(name):
    from measure.cli import run_demo
    report = run_demo(name, model="tiny", device="cpu", dtype="fp32", quick=True)
    rows = [row for t in report.tables for row in t.rows]
    assert rows and all("✗" not in str(cell) for row in rows for cell in row)
    assert any(r.get("n_preemptions", 0) > 0 for r in report.data.get("sweep", report.data.get("runs", [])))


@pytest.mark.notebook("09_preemption.ipynb")
def test_notebook_runs():
    import re
    from tests.nbrun import run_notebook
    nb = run_notebook("09_preemption.ipynb")
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "preemptions 0, problems []" in text                                   # the unlimited pool
    small = re.findall(r"blocks: \d+ steps, (\d+) preemptions .*problems \[\], outputs equal to the unlimited "
                       r"pool: True", text)
    assert len(small) == 2 and all(int(n) > 0 for n in small)                     # recompute and swap
    packaged = re.findall(r"(\d+) preemption\(s\).*equal to HF generate: True", text)
    assert len(packaged) == 2 and all(int(n) > 0 for n in packaged)              # SmolLM2, both modes
