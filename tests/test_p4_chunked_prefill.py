"""Phases 4.1-4.4 on phase 3.8's chunked prefill: samples, beams, prefix caching and preemption stay correct when a
prompt (or a recomputed sequence) is prefilled a chunk at a time, beside decode tokens, under a small token budget.

Budgets 3, 5 and 7 with blocks of 4 split prompts mid-block and chunks across block boundaries.
"""

from __future__ import annotations

import pytest
import torch

from common.sampling import GREEDY
from phases.p2_2_scheduler.sequence import Status
from phases.p4_1_copy_on_write.block_ops import check_refcounts
from phases.p4_2_beam_search.engine import BeamSearchEngine
from phases.p4_3_prefix_caching.engine import PrefixCachingEngine
from phases.p4_4_preemption.engine import PREEMPTED, PreemptingEngine
from tests.oracles import hf_greedy
from tests.test_p4_2_beam_search import hf_beam

BS = 4
BUDGETS = [3, 5, 7]
MAX_NEW = 8


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_checked(engine) -> None:
    """Step to the end; after every step each block's refcount equals the tables holding it; nothing leaks."""
    while engine.has_work:
        engine.step()
        check_refcounts(engine.allocator, [s.kv for s in engine.running])
    assert engine.allocator.n_free == engine.allocator.n_blocks


@pytest.mark.parametrize("budget", BUDGETS)
def test_samples_beams_and_plain_requests_in_chunks_equal_hf(tiny32, budget):
    """A group's prompt is prefilled once, in chunks, and forks after its last chunk; beams open there too."""
    engine = BeamSearchEngine(tiny32, max_running=8, block_size=BS, n_blocks=128, max_num_batched_tokens=budget)
    prompts = [random_ids(n, seed=n) for n in (14, 9, 22)]
    samples = engine.add_group(prompts[0], MAX_NEW, GREEDY, ignore_eos=True, n=3)
    beams = engine.add_beam_search(prompts[1], MAX_NEW, beam_width=2)
    plain = engine.add(prompts[2], MAX_NEW, ignore_eos=True)
    run_checked(engine)
    assert engine.runner.n_chunks > len(prompts)              # some prompt really was cut
    assert samples.outputs == [hf_greedy(tiny32, prompts[0], MAX_NEW, ignore_eos=True)] * 3
    assert beams.best == hf_beam(tiny32, prompts[1], 2, MAX_NEW)
    assert plain.output_ids == hf_greedy(tiny32, prompts[2], MAX_NEW, ignore_eos=True)


def test_a_prompt_mid_prefill_is_already_a_prefix_hit(tiny32):
    """The blocks a chunk filled are published after its pass, so a request admitted before the prompt's last
    chunk has run maps them in."""
    engine = PrefixCachingEngine(tiny32, max_running=4, block_size=BS, n_blocks=64, max_num_batched_tokens=2 * BS)
    shared = random_ids(6 * BS, seed=1)
    first = engine.add(shared + random_ids(3, seed=2), 4, ignore_eos=True)     # 27 tokens: 4 chunks of 8 at most
    second = engine.add(shared + random_ids(5, seed=3), 4, ignore_eos=True)
    while second.kv is None:            # it waits until the budget has room beside the rest of first's prefill
        filled_before = first.kv.n_filled if first.kv is not None else 0
        engine.step()
    assert filled_before == 6 * BS < len(first.prompt_ids)   # looked up while first was mid-prefill
    assert second.kv.block_ids[:6] == first.kv.block_ids[:6] and engine.cache_stats.blocks_hit == 6
    run_checked(engine)
    for seq in (first, second):
        assert seq.output_ids == hf_greedy(tiny32, seq.prompt_ids, 4, ignore_eos=True)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_request_preempted_mid_prefill_is_recomputed_and_equals_hf(tiny32, mode):
    """A decodes and grows; B's long prompt is being prefilled in chunks when the pool runs dry: B, the latest,
    is preempted PREFILLING. It has no decode state, so even in swap mode it is dropped and recomputed."""
    engine = PreemptingEngine(tiny32, preemption_mode=mode, block_size=BS, n_blocks=8, watermark_blocks=0,
                              max_num_batched_tokens=BS + 1)
    a = engine.add(random_ids(BS, seed=4), 20, ignore_eos=True)          # up to 6 blocks
    b = engine.add(random_ids(6 * BS, seed=5), 2, ignore_eos=True)       # up to 7 blocks, a 6-block prompt
    run_checked(engine)
    went = [(x, y) for x, y in zip(b.history, b.history[1:])]
    assert (Status.PREFILLING, PREEMPTED) in went
    assert engine.summary()["n_swapped_out"] == 0
    # what B's pool held when it was dropped and was computed again is booked as recomputation
    assert engine.stats.n_recomputed == 1 and engine.stats.tokens_recomputed > 0
    for seq in (a, b):
        assert seq.output_ids == hf_greedy(tiny32, seq.prompt_ids, seq.max_new_tokens, ignore_eos=True)


@pytest.mark.parametrize("budget", [3, 6])
def test_a_recomputed_group_forks_its_prompt_from_the_lead_across_chunks(tiny32, budget):
    """Samples preempted after they forked are recomputed a chunk at a time: the lead's prompt blocks are forked
    into the other members once claimed."""
    engine = PreemptingEngine(tiny32, block_size=BS, n_blocks=10, watermark_blocks=0, prefix_caching=False,
                              max_num_batched_tokens=budget)
    first = engine.add(random_ids(3, seed=6), 24, ignore_eos=True)
    samples = engine.add_group(random_ids(10, seed=7), 10, GREEDY, ignore_eos=True, n=2)
    run_checked(engine)
    assert samples.request_id in engine.preempted_ids and engine.stats.tokens_recomputed > 0
    assert first.output_ids == hf_greedy(tiny32, first.prompt_ids, 24, ignore_eos=True)
    assert samples.outputs == [hf_greedy(tiny32, samples.prompt_ids, 10, ignore_eos=True)] * 2


# --- every later engine on a model whose attention is not plain causal ----------------------------------------
@pytest.fixture(scope="module")
def window_models():
    from common.model import load_model
    return {name: load_model(name, device="cpu", dtype=torch.float32) for name in ("tiny-sliding", "tiny-softcap")}


@pytest.mark.parametrize("name", ["tiny-sliding", "tiny-softcap"])
def test_window_and_softcap_models_equal_hf_in_every_later_engine(window_models, name):
    """Past the window (7 tokens), with samples, a prefix-cache hit, chunks of 5, and, in the last engines, a pool
    small enough to preempt: every engine from 4.1 to the server's gives HF generate's tokens."""
    from common.model import TINY_WINDOW
    from phases.p4_1_copy_on_write.engine import SharingEngine
    from phases.p5_1_served_engine.engine import ServingEngine
    lm = window_models[name]
    shared = random_ids(3 * BS, seed=9)
    prompts = [shared + random_ids(n, seed=10 + n) for n in (2, TINY_WINDOW, 11)]
    expected = [hf_greedy(lm, p, MAX_NEW, ignore_eos=True) for p in prompts]
    for cls, kwargs in [(SharingEngine, {}), (PrefixCachingEngine, {}),
                        (PreemptingEngine, dict(n_blocks=10, watermark_blocks=0)),
                        (ServingEngine, dict(n_blocks=10, watermark_blocks=0))]:
        engine = cls(lm, max_running=4, block_size=BS, max_num_batched_tokens=5, **{"n_blocks": 64, **kwargs})
        first = engine.add_group(prompts[0], MAX_NEW, GREEDY, ignore_eos=True, n=2)
        engine.step()
        later = [engine.add(p, MAX_NEW, ignore_eos=True) for p in prompts[1:]]
        run_checked(engine)
        assert first.outputs == [expected[0]] * 2, cls.__name__
        assert [s.output_ids for s in later] == expected[1:], cls.__name__
        if cls is PreemptingEngine:
            assert engine.stats.n_preemptions >= 1 and engine.cache_stats.blocks_hit >= 1
