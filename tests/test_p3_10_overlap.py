"""Phase 3.10's overlapped decode steps (extras/p3_10_cuda_graphs/overlap.py), on the CPU: the same tokens as HF
`generate` and as the engine without overlap, a row wasted for every sequence that ends on an EOS in flight, no
block leaked, and the mirror of the device rows kept honest. (What the overlap buys in time needs a GPU.)"""

import pytest
import torch

from common.model import load_model
from common.sampling import SamplingParams
from phases.p3_10_cuda_graphs.engine import StaticDecodeEngine
from extras.p3_10_cuda_graphs.overlap import OverlappedDecodeEngine
from tests.oracles import hf_greedy
from tests.test_p3_8_engine import random_prompts
from tests.test_p3_10_engine import BLOCK_SIZE, NEW_TOKENS, PROMPT_LENGTHS, run


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", dtype=torch.float32)


@pytest.mark.parametrize("max_running,buckets,budget", [(4, None, 4096), (4, [8], 5), (2, [1, 2], 7), (7, None, 4096)])
def test_greedy_equals_hf_as_sequences_finish_and_join(tiny, max_running, buckets, budget):
    prompts = random_prompts(PROMPT_LENGTHS, seed=1)
    engine, outputs = run(tiny, prompts, engine_cls=OverlappedDecodeEngine, max_running=max_running,
                          buckets=buckets, max_num_batched_tokens=budget)
    for p, n, out in zip(prompts, NEW_TOKENS, outputs):
        assert out == hf_greedy(tiny, p, n, ignore_eos=True)
    assert engine.n_overlapped_steps > 0
    assert engine.n_wasted_rows == 0          # every end was by length, which the host sees coming
    assert not engine.has_work and engine._in_flight is None


def test_seeded_samples_equal_the_engine_without_overlap(tiny):
    prompts = random_prompts(PROMPT_LENGTHS, seed=3)
    sampling = SamplingParams(temperature=0.9, top_k=50, top_p=0.9, seed=1234)
    _, overlapped = run(tiny, prompts, engine_cls=OverlappedDecodeEngine, sampling=sampling)
    _, plain = run(tiny, prompts, engine_cls=StaticDecodeEngine, sampling=sampling)
    assert overlapped == plain


def test_an_eos_in_flight_costs_one_wasted_row_and_nothing_else(smol32):
    """The packaged model ends its answers on EOS: each such end was launched one step too far."""
    lm = smol32
    prompts = [lm.prompt_ids(p) for p in ("What is 2 + 2?", "Name one fruit.", "What is the capital of France?")]
    engine = OverlappedDecodeEngine(lm, max_running=3, block_size=16, n_blocks=64)
    seqs = [engine.add(p, 30) for p in prompts]
    engine.run()
    assert engine.allocator.n_free == engine.allocator.n_blocks, "blocks leaked"
    for p, s in zip(prompts, seqs):       # what StaticDecodeEngine gives too (test_p3_10_engine.py)
        assert s.output_ids == hf_greedy(lm, p, 30)
    eos_ends = sum(s.finish_reason == "eos" for s in seqs)
    assert eos_ends >= 2
    # Nobody waits, so every step after the first is launched before the previous one is read: each EOS
    # end was found while the next step already ran with its row.
    assert engine.n_wasted_rows == eos_ends


def test_steps_return_the_tokens_of_the_step_before(tiny):
    engine = OverlappedDecodeEngine(tiny, max_running=3, block_size=BLOCK_SIZE, n_blocks=64)
    seqs = [engine.add(p, 6, ignore_eos=True) for p in random_prompts((5, 6, 7), seed=4)]
    assert len(engine.step()) == 3                # the prefill pass, in series: the first tokens
    assert engine.step() == []                    # first decode step launched, nothing read yet
    assert engine._in_flight is not None and engine.runner.buffers.pending == set(engine.runner.buffers.rows)
    out = engine.step()                           # launches the 3rd token's step, reads the 2nd's
    assert [o.seq for o in out] == seqs and all(len(s.output_ids) == 2 for s in seqs)
    engine.run()
    assert all(len(s.output_ids) == 6 for s in seqs) and engine._in_flight is None
    assert engine.allocator.n_free == engine.allocator.n_blocks


def test_a_waiting_request_drains_the_pipeline_then_joins(tiny):
    engine = OverlappedDecodeEngine(tiny, max_running=2, block_size=BLOCK_SIZE, n_blocks=64)
    prompts = random_prompts((4, 5, 6), seed=5)
    seqs = [engine.add(p, n, ignore_eos=True) for p, n in zip(prompts, (3, 8, 4))]
    engine.run()
    for p, n, s in zip(prompts, (3, 8, 4), seqs):
        assert s.output_ids == hf_greedy(tiny, p, n, ignore_eos=True)


def test_abort_mid_flight_delivers_the_pending_tokens(tiny):
    engine = OverlappedDecodeEngine(tiny, max_running=2, block_size=BLOCK_SIZE, n_blocks=64)
    a, b = [engine.add(p, 10, ignore_eos=True) for p in random_prompts((4, 5), seed=6)]
    engine.step()
    engine.step()                                  # a decode step in flight
    engine.abort(a)
    out = engine.step()
    assert [o.seq for o in out if o.seq is a] == [a]     # its token in flight came back with the next step
    engine.run()
    assert b.output_ids == hf_greedy(tiny, b.prompt_ids, 10, ignore_eos=True)
    assert engine.allocator.n_free == engine.allocator.n_blocks


def test_an_overlapped_step_never_reads_a_synchronised_clock(tiny, monkeypatch):
    """On a GPU `now()` synchronises: called while a step is in flight, it would wait for that step and put
    the host back in series with the GPU. Steady overlapped steps must not call it."""
    import phases.p3_6_batched_engine.engine as scheduler
    engine = OverlappedDecodeEngine(tiny, max_running=3, block_size=BLOCK_SIZE, n_blocks=64)
    seqs = [engine.add(p, 12, ignore_eos=True) for p in random_prompts((5, 6, 7), seed=7)]
    engine.step()
    engine.step()                                   # the prefill, then the first launch
    monkeypatch.setattr(scheduler, "now", lambda device=None: pytest.fail("a synchronised clock mid-flight"))
    for _ in range(6):
        assert len(engine.step()) == 3
    monkeypatch.undo()
    engine.run()
    assert all(len(s.output_ids) == 12 for s in seqs)
