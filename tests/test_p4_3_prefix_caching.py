"""Prefix caching: hits skip prefill without changing a single output token; eviction and refcounts stay right."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from phases.p3_1_block_allocator.allocator import AllocatorError, OutOfBlocks
from phases.p3_8_chunked_prefill.engine import ChunkedPrefillEngine
from phases.p4_3_prefix_caching import block_hash
from phases.p4_3_prefix_caching.block_hash import ROOT_HASH, chain_hashes
from phases.p4_3_prefix_caching.engine import PrefixCachingEngine
from phases.p4_3_prefix_caching.evictor import Evictor
from phases.p4_3_prefix_caching.prefix_cache import PrefixCachingAllocator
from tests.oracles import hf_greedy

BS = 4  # small blocks: many block boundaries in short prompts


def _random_ids(n, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (n,), generator=gen).tolist()


def _prefill_sizes(engine):
    """Record the token count of every prefill pass the engine runs."""
    sizes, forward = [], engine.runner.forward

    def spy(input_ids, position_ids, batch, logits_to_keep=1):
        if not batch.is_decode:
            sizes.append(input_ids.shape[1])
        return forward(input_ids, position_ids, batch, logits_to_keep)
    engine.runner.forward = spy
    return sizes


def _holders(engine, block_id):
    return sum(s.kv.block_ids.count(block_id) for s in engine.running)


# --- hashing ------------------------------------------------------------------------------
def test_a_block_hash_covers_every_token_before_it():
    a = chain_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], BS)
    assert len(a) == 2                                   # the partial third block has no hash
    assert a == chain_hashes([1, 2, 3, 4, 5, 6, 7, 8], BS)  # deterministic, tail-independent
    b = chain_hashes([0, 2, 3, 4, 5, 6, 7, 8], BS)
    assert a[1] != b[1]                                  # same block tokens, different prefix
    assert chain_hashes([1, 2, 3, 4, 5, 6, 7, 8], BS, parent_hash=a[0], start_block=1) == a[1:]  # extend a chain
    assert block_hash.hash_block(ROOT_HASH, (1, 2, 3, 4)) == a[0]


# --- the allocator: three block states, eviction order --------------------------------------
def _cache_chain(alloc, tokens):
    """Alloc and register one block per BS tokens, chained; return the block ids."""
    ids, parent = [], None
    for i, h in enumerate(chain_hashes(tokens, alloc.block_size)):
        b = alloc.alloc()
        parent = alloc.register(b, h, tuple(tokens[i * alloc.block_size:(i + 1) * alloc.block_size]), parent)
        ids.append(b)
    return ids


def test_eviction_is_lru_then_longest_prefix_first():
    alloc = PrefixCachingAllocator(6, n_layers=1, n_kv_heads=1, head_dim=2, block_size=2, dtype=torch.float32)
    a = _cache_chain(alloc, [1, 2, 3, 4, 5, 6])        # 3 blocks: 0, 2 and 4 tokens before them
    b = _cache_chain(alloc, [7, 8, 9, 10])             # 2 blocks
    alloc.tick()
    for blk in a:
        alloc.free(blk)                                # a's blocks last used at time 1 ...
    alloc.tick()
    for blk in reversed(b):
        alloc.free(blk)                                # ... b's at time 2 (freed in any order)
    alloc.check_invariants()
    assert alloc.n_free == 6 and alloc.n_evictable == 5 and alloc.n_uncached_free == 1
    # LRU first (a before b); within a release, the deepest block first
    assert alloc.evictor.eviction_order() == [a[2], a[1], a[0], b[1], b[0]]
    fresh = alloc.alloc()                              # a truly free block is taken before any eviction
    assert alloc.n_evictions == 0 and fresh not in a + b
    assert [alloc.alloc() for _ in range(2)] == [a[2], a[1]]
    assert alloc.n_evictions == 2
    # the evicted blocks' hashes are forgotten: a's prompt now hits only its first block
    hashes = chain_hashes([1, 2, 3, 4, 5, 6], 2)
    assert [e.block_id for e in alloc.match_prefix([1, 2, 3, 4, 5, 6], hashes, 3).entries] == [a[0]]
    alloc.check_invariants()


def test_a_revived_block_is_not_evicted_and_counts_its_owners():
    alloc = PrefixCachingAllocator(3, n_layers=1, n_kv_heads=1, head_dim=2, block_size=2, dtype=torch.float32)
    (blk,) = _cache_chain(alloc, [1, 2])
    alloc.free(blk)
    assert alloc.refcount(blk) == 0 and alloc.n_evictable == 1
    with pytest.raises(AllocatorError):
        alloc.incref(blk)                              # a cached-free block is revived with acquire()
    entry = alloc.cached_entry(blk)
    assert alloc.acquire(entry) == blk and alloc.acquire(entry) == blk
    assert alloc.refcount(blk) == 2 and alloc.n_evictable == 0
    others = [alloc.alloc(), alloc.alloc()]
    with pytest.raises(OutOfBlocks):
        alloc.alloc()                                  # the only cached block is in use: nothing to evict
    alloc.free(blk)
    alloc.free(blk)
    with pytest.raises(AllocatorError, match="cannot free"):
        alloc.free(blk)                                # double free still caught
    assert alloc.alloc() == blk and alloc.n_evictions == 1
    with pytest.raises(AllocatorError, match="evicted"):
        alloc.acquire(entry)                           # a stale entry cannot be revived
    for b in others + [blk]:
        alloc.free(b)
    alloc.check_invariants()
    assert alloc.n_free == alloc.n_blocks


def test_evictor_skips_stale_entries():
    ev = Evictor()
    for blk, t in ((1, 5), (2, 3), (3, 3)):
        ev.add(blk, t, tokens_before=blk)
    ev.remove(2)
    ev.add(2, 9, tokens_before=0)
    assert ev.eviction_order() == [3, 1, 2] and [ev.pop() for _ in range(3)] == [3, 1, 2]
    with pytest.raises(IndexError):
        ev.pop()


# --- the engine: hits, outputs unchanged ----------------------------------------------------
def test_second_request_hits_k_blocks_and_prefills_only_the_rest(tiny32):
    engine = PrefixCachingEngine(tiny32, max_running=4, block_size=BS, n_blocks=64)
    sizes = _prefill_sizes(engine)
    shared = _random_ids(3 * BS + 2, seed=1)             # 3 full blocks + 2 tokens in common
    first = engine.add(shared + _random_ids(5, seed=2), 3, ignore_eos=True)
    engine.step()
    computed = first.kv.block_ids[:3]
    engine.run()
    second = engine.add(shared + _random_ids(6, seed=3), 3, ignore_eos=True)
    engine.step()
    assert second.kv.block_ids[:3] == computed and second.kv.n_blocks == 5   # 3 mapped in + 2 new
    assert engine.cache_stats.blocks_hit == 3
    assert sizes == [len(first.prompt_ids), len(second.prompt_ids) - 3 * BS]
    engine.run()
    for seq in (first, second):
        assert seq.output_ids == hf_greedy(tiny32, seq.prompt_ids, 3, ignore_eos=True)
    assert engine.allocator.n_free == engine.allocator.n_blocks
    engine.allocator.check_invariants()


def test_an_identical_prompt_still_computes_its_last_token(tiny32):
    engine = PrefixCachingEngine(tiny32, max_running=4, block_size=BS, n_blocks=64)
    sizes = _prefill_sizes(engine)
    prompt = _random_ids(3 * BS, seed=4)                 # exactly 3 full blocks
    a = engine.add(prompt, 4, ignore_eos=True)
    engine.run()
    b = engine.add(prompt, 4, ignore_eos=True)
    engine.run()
    # (len - 1) // BS = 2 blocks may hit: the last block is recomputed so its last logits exist
    assert engine.cache_stats.blocks_hit == 2 and sizes == [3 * BS, BS]
    assert a.output_ids == b.output_ids == hf_greedy(tiny32, prompt, 4, ignore_eos=True)


def test_caching_on_equals_caching_off_tiny_many_shared_prefixes(tiny32):
    systems = [_random_ids(n, seed=10 + n) for n in (9, 14)]
    prompts = [systems[i % 2] + _random_ids(1 + i, seed=20 + i) for i in range(10)]
    outputs = []
    for cls in (ChunkedPrefillEngine, PrefixCachingEngine):
        engine = cls(tiny32, max_running=3, block_size=BS, n_blocks=48)
        seqs = [engine.add(p, 7, ignore_eos=True) for p in prompts]
        engine.run()
        outputs.append([s.output_ids for s in seqs])
        assert engine.allocator.n_free == engine.allocator.n_blocks
    assert outputs[0] == outputs[1]
    assert outputs[1] == [hf_greedy(tiny32, p, 7, ignore_eos=True) for p in prompts]
    stats = engine.cache_stats
    assert stats.blocks_hit > 0 and stats.tokens_skipped == stats.blocks_hit * BS
    assert 0 < stats.hit_rate <= 1


def test_packaged_model_shared_system_prompt(smol32):
    from common.prompts import format_prompt
    system = ("You are a careful assistant for a public library. Answer in one short sentence, "
              "be polite, and never invent facts about opening hours, fees or the catalogue.")
    questions = ["What is a library card?", "Can I borrow a book?", "What does a librarian do?"]
    ids = [smol32.tokenizer(format_prompt(smol32.tokenizer, q, system=system), add_special_tokens=False)["input_ids"]
           for q in questions]
    outputs = []
    for cls in (ChunkedPrefillEngine, PrefixCachingEngine):
        engine = cls(smol32, max_running=3, block_size=16, n_blocks=64)
        seqs = [engine.add(ids[0], 12)]
        engine.step()                                  # the first prefill puts the system prompt in the cache
        seqs += [engine.add(p, 12) for p in ids[1:]]
        engine.run()                                   # the other two map it in, next to the first one decoding
        outputs.append([s.output_ids for s in seqs])
    n_system_blocks = len(smol32.tokenizer(format_prompt(smol32.tokenizer, "x", system=system),
                                           add_special_tokens=False)["input_ids"]) // 16
    assert n_system_blocks >= 2 and engine.cache_stats.blocks_hit >= 2 * n_system_blocks
    assert outputs[0] == outputs[1] == [hf_greedy(smol32, p, 12) for p in ids]


def test_admission_counts_only_the_blocks_a_request_really_takes(tiny32):
    prefix = _random_ids(3 * BS, seed=5)
    admitted_at = {}
    for cls in (ChunkedPrefillEngine, PrefixCachingEngine):
        engine = cls(tiny32, max_running=4, block_size=BS, n_blocks=8)
        engine.add(prefix + [7], 5, ignore_eos=True)  # worst case 13 + 4 tokens: 5 blocks
        engine.step()                                      # A holds 4 blocks, may claim 1 more
        b = engine.add(prefix + [9], 5, ignore_eos=True)
        engine.step()
        admitted_at[cls] = b.kv is not None
        engine.run()
        assert engine.allocator.n_free == engine.allocator.n_blocks
    # B's worst case is 5 blocks and only 3 are allocatable; 3 of its 5 are A's, in use: it needs 2
    assert admitted_at == {ChunkedPrefillEngine: False, PrefixCachingEngine: True}


def test_a_hash_collision_is_a_miss_with_correct_output(tiny32, monkeypatch):
    monkeypatch.setattr(block_hash, "hash_block", lambda parent_hash, tokens: 0)  # every block collides
    engine = PrefixCachingEngine(tiny32, max_running=1, block_size=BS, n_blocks=64)
    p1, p2 = _random_ids(3 * BS + 1, seed=6), _random_ids(3 * BS + 1, seed=7)
    seqs = [engine.add(p, 5, ignore_eos=True) for p in (p1, p2, p1)]
    engine.run()
    for seq in seqs:
        assert seq.output_ids == hf_greedy(tiny32, seq.prompt_ids, 5, ignore_eos=True)
    # p2 finds p1's first block under "its" hash; the tokens differ, so it is a miss.
    # The repeat of p1 hits block 0, then block 1's lookup finds block 0's entry again: a miss too.
    assert engine.cache_stats.blocks_hit == 1 and engine.cache_stats.collisions == 2
    assert engine.allocator.n_register_conflicts > 0
    engine.allocator.check_invariants()


# --- random request streams on a small pool ------------------------------------------------------
_PREFIXES = [[300, 301, 302, 303, 304, 305, 306, 307, 308], [300, 301, 302, 309, 310]]
_request = st.tuples(st.sampled_from([0, 1, None]),                       # shared prefix (or none)
                     st.lists(st.integers(300, 303), min_size=1, max_size=5),  # suffix from 4 tokens: overlaps
                     st.integers(1, 4),                                    # max_new_tokens
                     st.integers(0, 5))                                    # step at which it arrives


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=st.lists(_request, min_size=1, max_size=6), max_running=st.integers(1, 3),
       n_blocks=st.integers(9, 12))
def test_random_streams_keep_refcounts_right_and_outputs_unchanged(tiny32, requests, max_running, n_blocks):
    prompts = [(_PREFIXES[p] if p is not None else []) + suffix for p, suffix, _, _ in requests]
    reference = ChunkedPrefillEngine(tiny32, max_running=len(prompts), block_size=2, n_blocks=64)
    expected = [reference.add(p, n, ignore_eos=True)
                for p, (_, _, n, _) in zip(prompts, requests)]
    reference.run()

    engine = PrefixCachingEngine(tiny32, max_running=max_running, block_size=2, n_blocks=n_blocks)
    alloc, pending, seqs, step = engine.allocator, sorted(range(len(prompts)), key=lambda i: requests[i][3]), {}, 0
    while pending or engine.has_work:
        while pending and requests[pending[0]][3] <= step:
            i = pending.pop(0)
            seqs[i] = engine.add(prompts[i], requests[i][2], ignore_eos=True)
        if engine.has_work:
            engine.step()
        step += 1
        alloc.check_invariants()
        for blk in range(alloc.n_blocks):              # refcount == number of tables holding the block
            assert alloc.refcount(blk) == _holders(engine, blk)
    assert alloc.owned_ids() == [] and alloc.n_free == alloc.n_blocks   # no leak: free or cached-free
    assert not engine.kv.chains
    assert [seqs[i].output_ids for i in range(len(prompts))] == [s.output_ids for s in expected]


def test_refuses_a_plain_allocator(tiny32):
    from phases.p3_1_block_allocator.allocator import BlockAllocator
    with pytest.raises(TypeError, match="PrefixCachingAllocator"):
        PrefixCachingEngine(tiny32, allocator=BlockAllocator.for_model(tiny32, block_size=BS, n_blocks=8))


def test_composes_with_copy_on_write_sharing(tiny32):
    """n samples per prompt over cached prefixes: the same samples as phase 4.1's engine, and cache hits."""
    from common.sampling import SamplingParams
    from phases.p4_1_copy_on_write.engine import SharingEngine

    system = _random_ids(13, seed=8)
    prompts = [system + _random_ids(k, seed=30 + k) for k in (2, 5, 3, 6)]
    params = SamplingParams(temperature=0.8, seed=7)
    outputs = []
    for cls in (SharingEngine, PrefixCachingEngine):
        engine = cls(tiny32, max_running=4, block_size=BS, n_blocks=40)
        groups = [engine.add_group(p, 6, params, ignore_eos=True, n=2) for p in prompts]
        engine.run()
        outputs.append([g.outputs for g in groups])
    assert outputs[0] == outputs[1]
    assert engine.cache_stats.blocks_hit > 0
    engine.allocator.check_invariants()
    assert engine.allocator.owned_ids() == []


def test_caching_off_is_phase_4_1_step_for_step(tiny32):
    """prefix_caching=False: the same tokens, steps, passes, copies and blocks as SharingEngine."""
    from common.sampling import SamplingParams
    from phases.p4_1_copy_on_write.engine import SharingEngine
    system = _random_ids(9, seed=12)
    runs = []
    for engine in (SharingEngine(tiny32, max_running=6, block_size=BS, n_blocks=30),
                   PrefixCachingEngine(tiny32, prefix_caching=False, max_running=6, block_size=BS, n_blocks=30)):
        reqs = [engine.add(system + _random_ids(3, seed=40), 5, ignore_eos=True),
                engine.add_group(system + [77], 6, SamplingParams(temperature=0.9, seed=1), ignore_eos=True, n=2),
                engine.add_group(system + [88, 89], 5, ignore_eos=True, n=2),
                engine.add(system + _random_ids(2, seed=41), 7, ignore_eos=True)]
        used = []
        while engine.has_work:
            engine.step()
            used.append(engine.allocator.n_used)
        runs.append(([r.output_ids if hasattr(r, "output_ids") else r.outputs for r in reqs], used, engine.n_steps,
                      engine.n_forward_passes, engine.n_copied, engine.n_prefill_tokens))
    assert runs[0] == runs[1]
    assert engine.cache_stats.blocks_hit == 0


def test_a_failed_forward_pass_publishes_nothing(tiny32, monkeypatch):
    """Blocks are named in the cache only after the pass that writes their K/V: if it fails, a later request
    computes them again rather than read K/V that were never written."""
    engine = PrefixCachingEngine(tiny32, max_running=2, block_size=BS, n_blocks=32)
    prompt = _random_ids(3 * BS + 1, seed=13)
    first = engine.add(prompt, 3, ignore_eos=True)


    def failing(*args, **kwargs):
        raise RuntimeError("injected failure")
    engine.runner.forward = failing                  # the pass fails after the prefill claimed its blocks
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    del engine.runner.forward
    engine.abort(first)
    assert engine.allocator.n_cached == 0 and engine.allocator.n_free == engine.allocator.n_blocks
    second = engine.add(prompt, 3, ignore_eos=True)
    engine.run()
    assert engine.cache_stats.blocks_hit == 0
    assert second.output_ids == hf_greedy(tiny32, prompt, 3, ignore_eos=True)


# --- the demo -------------------------------------------------------------------------------------
def test_prefix_demo_quick_runs_both_modes_and_plots(tmp_path):
    from common.prompts import shared_prefix_len, translation_system_prompt
    from measure.cli import run_demo
    from phases.p4_3_prefix_caching.demo import plot_prefix

    report = run_demo("prefix_demo", model="tiny", device="cpu", dtype="fp32", quick=True)
    runs = report.data["runs"]
    assert [r["caching"] for r in runs] == [False, True]
    off, on = runs
    assert off["tokens_skipped"] == 0 and on["tokens_skipped"] > 0 and on["hit_rate"] > 0
    assert on["prefill_tokens"] + on["tokens_skipped"] == off["prefill_tokens"]
    assert report.tables[-1].rows[0][-1] == "4/4"       # fp32: identical outputs with and without the cache
    plot_prefix(report, tmp_path / "prefix.png")
    assert (tmp_path / "prefix.png").stat().st_size > 0
    assert translation_system_prompt(5).count("English:") == 5
    with pytest.raises(ValueError, match="shots"):
        translation_system_prompt(99)
    assert shared_prefix_len([[1, 2, 3], [1, 2, 4], [1, 2]]) == 2


@pytest.mark.notebook("08_prefix_cache.ipynb")
def test_notebook_runs():
    from tests.nbrun import run_notebook
    run_notebook("08_prefix_cache.ipynb")
