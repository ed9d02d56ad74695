"""Every engine, p0 to p5, on the tier's device: greedy tokens equal Hugging Face `generate`, token for token.

fp32 with TF32 off (the `no_tf32` fixture), on two models: `tiny` (2 layers,
GQA 4:2, head_dim 16) and `dummy:qwen3-0.6b` (Qwen3-0.6B's 28 layers, GQA
16:8, head_dim 128, random weights). Prompts are token ids of lengths that
are not multiples of the block size; EOS is ignored (a dummy model has none),
so every request runs to its cap. Paged engines must give every block back.
On CUDA the paged engines run the compiled Triton kernels (K/V store, paged
decode attention); the oracle runs HF's own attention.
"""

from __future__ import annotations

import pytest
import torch

from common.sampling import GREEDY
from phases.p3_1_block_allocator.allocator import blocks_for
from phases.p0_generate import generate_ids as p0_generate_ids
from phases.p1_kv_cache import generate_ids as p1_generate_ids
from phases.p2_1_naive_batching.generate import generate_batch
from phases.p2_2_scheduler.scheduler import Scheduler
from phases.p2_3_continuous_batching.scheduler import ContinuousScheduler
from phases.p3_3_paged_cache.scheduler import PagedScheduler
from phases.p3_6_batched_engine.engine import BatchedPagedEngine
from phases.p4_1_copy_on_write.engine import SharingEngine
from phases.p4_2_beam_search.engine import BeamSearchEngine
from phases.p4_3_prefix_caching.engine import PrefixCachingEngine
from phases.p4_4_preemption.engine import PreemptingEngine
from tests.oracles import hf_greedy
from tests.test_p4_2_beam_search import _run_checked, hf_beam

pytestmark = pytest.mark.gpu

BLOCK_SIZE = 4            # small blocks: short prompts still cross several block boundaries
PROMPT_LENGTHS = (1, 6, 11)
# Few: on a CPU (ENGINE_TEST_DEVICE=cpu) each forward pass of Qwen3-0.6B's shapes in fp32 takes
# about a second, and every token of every engine is one pass (or a share of one).
NEW_TOKENS = 4
MAX_RUNNING = 2           # fewer slots than prompts: later requests are admitted next to running ones
POOL_BLOCKS = 64          # plenty: only the preemption test runs short of blocks
N_SAMPLES = 2
BEAM_WIDTH = 3
BEAM_PROMPT_LENGTHS = (6, 13)
TOKEN_RANGE = (100, 40_000)   # ordinary ids inside both models' vocabularies


def random_prompts(lengths, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(*TOKEN_RANGE, (n,), generator=gen).tolist() for n in lengths]


def expected(lm, prompts) -> list[list[int]]:
    """HF greedy `generate` of each prompt alone (memoised per model and prompt: engines share it)."""
    return [hf_greedy(lm, p, NEW_TOKENS, ignore_eos=True) for p in prompts]


def assert_no_leak(allocator) -> None:
    assert allocator.n_free == allocator.n_blocks, f"{allocator.n_blocks - allocator.n_free} blocks never came back"
    allocator.check_invariants()


# --- one runner per engine: prompts in, greedy outputs out (in prompt order) ---------------------
def run_p0(lm, prompts):
    return [p0_generate_ids(lm, p, NEW_TOKENS, ignore_eos=True).output_ids for p in prompts]


def run_p1(lm, prompts):
    return [p1_generate_ids(lm, p, NEW_TOKENS, ignore_eos=True).output_ids for p in prompts]


def run_p2_1(lm, prompts):
    return generate_batch(lm, prompts, NEW_TOKENS, ignore_eos=True).output_ids


def _run_scheduler(sched, prompts):
    for p in prompts:
        sched.add(p, NEW_TOKENS, ignore_eos=True)
    return [s.output_ids for s in sched.run()]   # in seq_id order = prompt order


def run_p2_2(lm, prompts):
    return _run_scheduler(Scheduler(lm, max_running=MAX_RUNNING), prompts)


def run_p2_3(lm, prompts):
    return _run_scheduler(ContinuousScheduler(lm, max_running=MAX_RUNNING), prompts)


def run_p3_3(lm, prompts):
    sched = PagedScheduler(lm, max_running=MAX_RUNNING, block_size=BLOCK_SIZE, n_blocks=POOL_BLOCKS)
    outputs = _run_scheduler(sched, prompts)
    assert_no_leak(sched.allocator)
    return outputs


def run_p3_6(lm, prompts):
    engine = BatchedPagedEngine(lm, max_running=MAX_RUNNING, block_size=BLOCK_SIZE, n_blocks=POOL_BLOCKS)
    seqs = [engine.add(p, NEW_TOKENS, ignore_eos=True) for p in prompts]
    engine.run()
    assert_no_leak(engine.allocator)
    return [s.output_ids for s in seqs]


def run_p4_1(lm, prompts):
    """N_SAMPLES greedy samples per prompt over shared blocks: every sample is the greedy answer."""
    engine = SharingEngine(lm, max_running=N_SAMPLES * MAX_RUNNING, block_size=BLOCK_SIZE, n_blocks=POOL_BLOCKS)
    groups = [engine.add_group(p, NEW_TOKENS, ignore_eos=True, n=N_SAMPLES) for p in prompts]
    engine.run()
    assert_no_leak(engine.allocator)
    # Prompts that end mid-block are shared there: each sample but the last copies it on its first write.
    assert engine.n_copied > 0
    for g in groups:
        assert len(g.outputs) == N_SAMPLES and all(o == g.outputs[0] for o in g.outputs)
    return [g.outputs[0] for g in groups]


def run_p5(lm, prompts):
    """The engine the phase-5 server drives (the last of the line, prefix caching on), one sample each."""
    from phases.p5_1_served_engine.engine import ServingEngine
    engine = ServingEngine(lm, max_running=MAX_RUNNING, block_size=BLOCK_SIZE, n_blocks=POOL_BLOCKS)
    groups = [engine.add_group(p, NEW_TOKENS, GREEDY, True, n=1) for p in prompts]
    engine.run()
    assert_no_leak(engine.allocator)
    return [g.seqs[0].output_ids for g in groups]


ENGINES = {"p0": run_p0, "p1": run_p1, "p2_1": run_p2_1, "p2_2": run_p2_2, "p2_3": run_p2_3, "p3_3": run_p3_3,
           "p3_6": run_p3_6, "p4_1": run_p4_1, "p5": run_p5}


@pytest.mark.parametrize("engine", list(ENGINES))
def test_engine_equals_hf_generate(tier_lm, no_tf32, engine):
    prompts = random_prompts(PROMPT_LENGTHS)
    assert all(n % BLOCK_SIZE for n in PROMPT_LENGTHS)
    assert ENGINES[engine](tier_lm, prompts) == expected(tier_lm, prompts)


def test_beam_search_equals_hf_beam_search(tier_lm, no_tf32):
    engine = BeamSearchEngine(tier_lm, block_size=BLOCK_SIZE, n_blocks=POOL_BLOCKS)
    prompts = random_prompts(BEAM_PROMPT_LENGTHS, seed=1)
    groups = [engine.add_beam_search(p, NEW_TOKENS, beam_width=BEAM_WIDTH) for p in prompts]
    _run_checked(engine)   # refcounts right after every step, every block back at the end
    for g in groups:
        assert g.best == hf_beam(tier_lm, g.prompt_ids, BEAM_WIDTH, NEW_TOKENS)


def test_prefix_caching_hits_and_changes_no_token(tier_lm, no_tf32):
    shared = random_prompts([3 * BLOCK_SIZE + 2], seed=2)[0]           # 3 full blocks + 2 tokens in common
    prompts = [shared + suffix for suffix in random_prompts((1, 3), seed=3)]
    engine = PrefixCachingEngine(tier_lm, max_running=len(prompts), block_size=BLOCK_SIZE, n_blocks=POOL_BLOCKS)
    seqs = [engine.add(prompts[0], NEW_TOKENS, ignore_eos=True)]
    engine.step()                                                      # its prefill fills the cache
    seqs += [engine.add(p, NEW_TOKENS, ignore_eos=True) for p in prompts[1:]]
    engine.run()
    assert engine.cache_stats.blocks_hit >= 3 * (len(prompts) - 1)     # every later prompt mapped the 3 blocks in
    assert [s.output_ids for s in seqs] == expected(tier_lm, prompts)
    assert_no_leak(engine.allocator)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_changes_no_token(tier_lm, no_tf32, mode):
    prompts = random_prompts((11, 7, 10), seed=4)
    # Room for every prompt and one block more: all three are admitted, then their second decode
    # step needs two new blocks (11 -> 13 and 7 -> 9 tokens cross a boundary) and only one is free.
    n_blocks = sum(blocks_for(len(p), BLOCK_SIZE) for p in prompts) + 1
    engine = PreemptingEngine(tier_lm, preemption_mode=mode, block_size=BLOCK_SIZE, n_blocks=n_blocks)
    seqs = [engine.add(p, NEW_TOKENS, ignore_eos=True) for p in prompts]
    engine.run()
    assert engine.stats.n_preemptions >= 1
    if mode == "swap":
        assert engine.swap_space.out.n_swaps >= 1 and engine.swap_space.cpu.n_used == 0
    assert [s.output_ids for s in seqs] == expected(tier_lm, prompts)
    assert_no_leak(engine.allocator)


def test_tf32_is_off_inside_the_tier(no_tf32):
    assert torch.backends.cuda.matmul.allow_tf32 is False and torch.backends.cudnn.allow_tf32 is False
