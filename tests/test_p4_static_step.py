"""The later engines on phase 3.10's static decode step, padded to buckets: forked samples and beams rewrite
block tables every step, prefix-cache hits map shared blocks into rows, preempted groups come back into new
rows; the buffers must catch each, and no token changes (HF `generate` greedy, fp32, is the oracle).
"""

from __future__ import annotations

import pytest

from common.sampling import SamplingParams
from phases.p4_1_copy_on_write.engine import SharingEngine
from phases.p4_2_beam_search.engine import BeamSearchEngine
from phases.p4_3_prefix_caching.engine import PrefixCachingEngine
from phases.p4_4_preemption.engine import PreemptingEngine
from phases.p5_1_served_engine.engine import ServingEngine
from tests.oracles import hf_greedy
from tests.test_p3_8_engine import random_prompts
from tests.test_p3_10_engine import BLOCK_SIZE, SAMPLINGS, STEPS_WATCHED, static_step_reads
from tests.test_p4_2_beam_search import hf_beam


@pytest.fixture(scope="module")
def tiny(tiny32):
    return tiny32


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_groups_come_back_into_padded_rows_and_equal_hf(tiny, mode):
    """A pool too small for all three: the latest group is preempted and comes back (recomputed into new
    blocks, or swapped back in elsewhere); its rows are refreshed, and every token equals HF's."""
    prompts = [list(range(300 + 10 * i, 306 + 10 * i)) for i in range(3)]
    engine = PreemptingEngine(tiny, preemption_mode=mode, block_size=4, n_blocks=9, watermark_blocks=0,
                              max_running=3, buckets=[8])
    groups = [engine.add_group(p, 10, ignore_eos=True, n=1) for p in prompts]
    engine.run()
    assert engine.stats.n_preemptions >= 1 and engine.runner.n_padded_rows > 0
    for p, g in zip(prompts, groups):
        assert g.seqs[0].output_ids == hf_greedy(tiny, p, 10, ignore_eos=True)
    assert engine.allocator.n_free == engine.allocator.n_blocks


def test_forked_samples_and_beams_are_the_same_padded_or_not(tiny):
    """Samples fork after the prompt (copy-on-write on their first write) and beams fork and reorder every
    step: both rewrite tables the buffers must catch. Padding every step to 16 rows changes nothing."""
    prompt = random_prompts((9,), seed=7)[0]
    sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=5)
    results = []
    for buckets in (None, [16]):
        engine = BeamSearchEngine(tiny, block_size=BLOCK_SIZE, n_blocks=96, max_running=8, buckets=buckets)
        samples = engine.add_group(prompt, 8, sampling, ignore_eos=True, n=3)
        beams = engine.add_beam_search(prompt, 8, beam_width=3)
        engine.run()
        assert engine.allocator.n_free == engine.allocator.n_blocks
        results.append((samples.outputs, beams.best))
    assert results[0] == results[1]
    assert results[0][1] == hf_beam(tiny, prompt, 3, 8)


def buckets_seen(engine) -> list[int]:
    """Spy on an engine's static decode passes: the list fills with the rows each pass ran (its bucket)."""
    seen = []
    replay = engine.runner.replay

    def recording(batch):
        seen.append(batch.block_tables.shape[0])
        return replay(batch)

    engine.runner.replay = recording
    return seen


SHARED_PREFIX = list(range(200, 200 + 3 * BLOCK_SIZE + 1))   # 3 full blocks and a token: later requests hit 3


@pytest.mark.parametrize("buckets", [[1, 2, 4, 8], [1, 3, 8]])
def test_prefix_cache_hits_map_into_padded_rows_and_equal_hf(tiny, buckets):
    """Requests that share a prefix join while others decode, under a small prefill budget: their cached blocks
    enter the table rows the buffers send, the batch moves through several buckets, and every token equals HF's."""
    prompts = [SHARED_PREFIX + [300 + i] * (i + 1) for i in range(6)]
    new_tokens = [3, 9, 5, 12, 2, 7]
    engine = PrefixCachingEngine(tiny, max_running=5, block_size=BLOCK_SIZE, n_blocks=64, buckets=buckets,
                                 max_num_batched_tokens=9)
    seen = buckets_seen(engine)
    seqs = []
    for p, n in zip(prompts, new_tokens):
        seqs.append(engine.add(p, n, ignore_eos=True))
        engine.step()
        engine.step()
    engine.run()
    assert engine.cache_stats.blocks_hit > 0 and engine.runner.n_padded_rows > 0
    assert len(set(seen)) >= 2 and set(seen) <= set(buckets)
    for p, n, s in zip(prompts, new_tokens, seqs):
        assert s.output_ids == hf_greedy(tiny, p, n, ignore_eos=True)
    assert engine.allocator.n_free == engine.allocator.n_blocks


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("engine_name", ["PreemptingEngine", "ServingEngine"])
def test_preemption_and_forks_across_buckets_change_no_token(tiny, mode, engine_name):
    """Seeded samples fork (copy-on-write), a pool too small for everyone preempts, and the batch grows and
    shrinks through buckets 1-8: the outputs equal those of a run without padding, and the greedy ones HF's.
    The server's engine (phase 5) runs the same path."""
    engine_cls = {"PreemptingEngine": PreemptingEngine, "ServingEngine": ServingEngine}[engine_name]
    prompts = [list(range(300 + 10 * i, 306 + 10 * i)) for i in range(4)]
    runs = []
    for buckets in (None, [1, 2, 4, 8]):
        engine = engine_cls(tiny, preemption_mode=mode, block_size=BLOCK_SIZE, n_blocks=14, watermark_blocks=0,
                            max_running=8, buckets=buckets)
        seen = buckets_seen(engine)
        groups = [engine.add_group(p, 10, SamplingParams(temperature=0.8, seed=3), ignore_eos=True, n=2)
                  for p in prompts[:2]]
        groups += [engine.add_group(p, 10, ignore_eos=True, n=1) for p in prompts[2:]]
        engine.run()
        assert engine.stats.n_preemptions >= 1
        assert engine.allocator.n_free == engine.allocator.n_blocks
        runs.append([g.outputs for g in groups])
    assert len(set(seen)) >= 2 and set(seen) <= set(engine.runner.buckets) and engine.runner.n_padded_rows > 0
    assert runs[0] == runs[1]
    for p, outputs in zip(prompts[2:], runs[1][2:]):
        assert outputs[0] == hf_greedy(tiny, p, 10, ignore_eos=True)


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "filtered-sample"])
def test_the_sharing_engines_static_step_reads_the_device_once(tiny, sampling, monkeypatch):
    """Phase 4.1's engine on the static step keeps its one host transfer, the sampled ids."""
    steps, reads = static_step_reads(SharingEngine, tiny, sampling, monkeypatch)
    assert steps == STEPS_WATCHED and reads == ["tolist"] * steps
