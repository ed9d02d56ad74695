"""Phase 3.3: PagedCache is a drop-in for DynamicCache; PagedScheduler batches continuously on one pool."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from common.prompts import LONG_PROMPTS, SHORT_PROMPTS, interleaved_latency_prompts
from measure.bench import kv_bytes_per_token
from phases.p2_3_continuous_batching.scheduler import ContinuousScheduler
from phases.p3_1_block_allocator.allocator import BlockAllocator, OutOfBlocks
from phases.p3_3_paged_cache.paged_cache import PagedCache
from phases.p3_3_paged_cache.scheduler import PagedScheduler, blocks_for
from tests.oracles import hf_greedy

DECODE_STEPS = 6


def fragmented_pool(lm, block_size: int, n_blocks: int, keep_every: int = 2) -> BlockAllocator:
    """A pool whose free list is out of order, so a new table gets scattered, non-adjacent blocks."""
    pool = BlockAllocator.for_model(lm, block_size=block_size, n_blocks=n_blocks)
    taken = [pool.alloc() for _ in range(n_blocks)]
    for b in reversed(taken[::keep_every]):  # free 8, 6, 4, ... back in reverse order
        pool.free(b)
    return pool


@torch.inference_mode()
def run_both(lm, prompt_ids, cache, steps=DECODE_STEPS):
    """Prefill + greedy decode steps with DynamicCache and with `cache`; the logits of every pass of each."""
    dyn = DynamicCache()
    out = {"dyn": [], "paged": []}
    for name, kv in (("dyn", dyn), ("paged", cache)):
        ids, n = torch.tensor([prompt_ids]), len(prompt_ids)
        logits = lm.model(ids, position_ids=torch.arange(n).view(1, n), past_key_values=kv, use_cache=True).logits
        out[name].append(logits)
        for _ in range(steps):
            tok = logits[0, -1].argmax().view(1, 1)
            logits = lm.model(tok, position_ids=torch.tensor([[n]]), past_key_values=kv, use_cache=True).logits
            out[name].append(logits)
            n += 1
    return out, dyn


@pytest.mark.parametrize("block_size", [1, 4, 5, 16])
def test_logits_and_kv_equal_dynamic_cache_bit_for_bit(tiny32, block_size):
    prompt = tiny32.prompt_ids(LONG_PROMPTS[0])  # 30-odd tokens: crosses several block boundaries
    pool = fragmented_pool(tiny32, block_size, n_blocks=2 * blocks_for(64, block_size))
    cache = PagedCache(pool)
    out, dyn = run_both(tiny32, prompt, cache)
    assert all(torch.equal(a, b) for a, b in zip(out["dyn"], out["paged"]))
    n = len(prompt) + DECODE_STEPS
    assert cache.get_seq_length() == dyn.get_seq_length() == n
    assert cache.n_blocks == blocks_for(n, block_size)
    ids = cache.table.block_ids
    assert ids != sorted(ids) or block_size == 16  # really scattered across the pool
    for layer in range(tiny32.n_layers):
        k, v = cache.gathered(layer)
        assert torch.equal(k, dyn.layers[layer].keys) and torch.equal(v, dyn.layers[layer].values)
    used_before = pool.n_used
    cache.release()
    assert pool.n_used == used_before - blocks_for(n, block_size) and cache.get_seq_length() == 0
    pool.check_invariants()


def test_every_token_lands_in_the_slot_its_table_names(tiny32):
    pool = fragmented_pool(tiny32, block_size=3, n_blocks=40)
    cache = PagedCache(pool)
    prompt = tiny32.prompt_ids(SHORT_PROMPTS[0])
    _, dyn = run_both(tiny32, prompt, cache, steps=2)
    for pos in range(cache.table.n_filled):
        block, offset = cache.table.physical_pos(pos)
        for layer in range(tiny32.n_layers):
            assert torch.equal(pool.kv_store[block, layer, 0, :, offset], dyn.layers[layer].keys[0, :, pos])
            assert torch.equal(pool.kv_store[block, layer, 1, :, offset], dyn.layers[layer].values[0, :, pos])


def test_generate_with_a_paged_cache_equals_plain_generate(tiny32):
    prompt = tiny32.prompt_ids(SHORT_PROMPTS[1])
    pool = BlockAllocator.for_model(tiny32, block_size=4, n_blocks=32)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = tiny32.model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=PagedCache(pool),
                                    max_new_tokens=8, do_sample=False, pad_token_id=tiny32.pad_token_id)
    assert out[0, len(prompt):].tolist() == hf_greedy(tiny32, prompt, 8)


def test_misuse_fails_clearly(tiny32):
    pool = BlockAllocator.for_model(tiny32, block_size=4, n_blocks=8)
    cache = PagedCache(pool)
    kv = torch.zeros(2, tiny32.n_kv_heads, 3, tiny32.head_dim)
    with pytest.raises(ValueError, match="one sequence"):
        cache.update(kv, kv, 0)
    half = torch.zeros(1, tiny32.n_kv_heads, 3, tiny32.head_dim, dtype=torch.float16)
    with pytest.raises(TypeError, match="pool is torch.float32"):
        cache.update(half, half, 0)
    one = torch.zeros(1, tiny32.n_kv_heads, 3, tiny32.head_dim)
    with pytest.raises(RuntimeError, match="out of step"):
        cache.update(one, one, 1)  # layer 1 before layer 0 opened the pass
    assert pool.n_used == 0
    too_long = torch.zeros(1, tiny32.n_kv_heads, 8 * 4 + 1, tiny32.head_dim)  # 8 blocks of 4 hold 32 tokens
    with pytest.raises(OutOfBlocks):
        cache.update(too_long, too_long, 0)
    assert pool.n_used == 0 and cache.get_seq_length() == 0  # all or nothing


def test_paged_scheduler_equals_hf_generate_on_the_packaged_model(smol32):
    # Prompts and length other phases also check against HF: the memoised oracle runs once per suite.
    # One stops at EOS, one runs to the cap across a block boundary; max_running=1, so the
    # second sequence reuses the blocks the first one gave back.
    prompts = [SHORT_PROMPTS[0], LONG_PROMPTS[0]]
    sched = PagedScheduler(smol32, max_running=1, block_size=16, n_blocks=8)
    for p in prompts:
        sched.add(p, 16)
    done = sched.run()
    assert done[0].finish_reason == "eos" and done[1].finish_reason == "length"
    for seq in done:
        assert seq.output_ids == hf_greedy(smol32, seq.prompt_ids, 16)
    assert sched.allocator.n_free == sched.allocator.n_blocks
    sched.allocator.check_invariants()


def test_paged_scheduler_equals_continuous_scheduler_and_hf(tiny32):
    prompts = interleaved_latency_prompts()[:4]
    dyn, paged = ContinuousScheduler(tiny32, 2), PagedScheduler(tiny32, 2, block_size=4, n_blocks=64)
    for i, p in enumerate(prompts):
        dyn.add(p, 6 + 2 * i)   # different lengths, so slots free up at different steps
        paged.add(p, 6 + 2 * i)
    a, b = dyn.run(), paged.run()
    assert [s.output_ids for s in a] == [s.output_ids for s in b]
    assert all(s.output_ids == hf_greedy(tiny32, s.prompt_ids, s.max_new_tokens) for s in b)
    assert paged.allocator.n_free == paged.allocator.n_blocks
    # KV accounting: a finished sequence held exactly the blocks its tokens needed.
    for s in b:
        n_blocks = blocks_for(len(s.prompt_ids) + len(s.output_ids) - 1, 4)
        assert paged.kv_bytes_at_finish[s.seq_id] == n_blocks * paged.allocator.bytes_per_block


def test_an_exhausted_pool_makes_sequences_wait_not_fail(tiny32):
    prompts = interleaved_latency_prompts()
    max_new = 10
    ids = [tiny32.prompt_ids(p) for p in prompts]
    biggest = max(blocks_for(len(i) + max_new - 1, 4) for i in ids)
    sched = PagedScheduler(tiny32, max_running=4, block_size=4, n_blocks=biggest + 3)  # room for ~1 at a time
    for p in prompts:
        sched.add(p, max_new)
    peak_running = 0
    while sched.has_work:
        sched.step()
        peak_running = max(peak_running, len(sched.running))
        assert sched.allocator.n_used <= sched.allocator.n_blocks
        sched.allocator.check_invariants()
    done = sorted(sched.finished, key=lambda s: s.seq_id)
    assert len(done) == len(prompts) and all(len(s.output_ids) == max_new for s in done)
    assert sched.waited_for_blocks and peak_running < 4
    assert all(s.output_ids == hf_greedy(tiny32, s.prompt_ids, max_new) for s in done)
    assert sched.allocator.n_free == sched.allocator.n_blocks


def test_a_request_no_pool_could_hold_is_refused_up_front(tiny32):
    sched = PagedScheduler(tiny32, max_running=2, block_size=4, n_blocks=6)
    sched.add("Hi", 1)
    with pytest.raises(ValueError, match="whole pool has 6"):
        sched.add(LONG_PROMPTS[0], 50)
    assert [s.seq_id for s in sched.waiting] == [0] and len(sched.sequences) == 1
    sched.add("Hi", 1)  # the queue is intact and ids stay dense
    assert [s.seq_id for s in sched.run()] == [0, 1]


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.tuples(st.integers(1, 12), st.integers(1, 6)), min_size=1, max_size=4),
       block_size=st.integers(1, 5), max_running=st.integers(1, 3), slack=st.integers(0, 6))
def test_any_workload_finishes_without_leaks_and_matches_dynamic_cache(tiny32, lengths, block_size, max_running,
                                                                       slack):
    prompts = [[100 + (7 * i + j) % 50 for j in range(n)] for i, (n, _) in enumerate(lengths)]
    worst = max(blocks_for(n + m - 1, block_size) for n, m in lengths)
    paged = PagedScheduler(tiny32, max_running, block_size=block_size, n_blocks=worst + slack)
    dyn = ContinuousScheduler(tiny32, max_running)
    for p, (_, m) in zip(prompts, lengths):
        paged.add(p, m, ignore_eos=True)
        dyn.add(p, m, ignore_eos=True)
    assert [s.output_ids for s in paged.run()] == [s.output_ids for s in dyn.run()]
    assert paged.allocator.n_free == paged.allocator.n_blocks
    paged.allocator.check_invariants()
    assert all(len(s.output_ids) == s.max_new_tokens for s in paged.finished)  # EOS ignored: full length


def test_snapshot_demo_passes(tiny32):
    from measure.cli import run_demo
    # A pool too small to run all four at once: some sequences wait, and the output is still identical.
    report = run_demo("snapshot", model="tiny", device="cpu", dtype="fp32", quick=True,
                      options={"block_size": 4, "pool_blocks": 16})
    assert report.data["identical"] == report.data["total"] == len(SHORT_PROMPTS) + len(LONG_PROMPTS)
    assert report.data["leaked_blocks"] == 0 and report.data["waited"]
    assert all(row[-1] is True for row in report.tables[0].rows)


def test_tput_demo_runs_and_accounts_kv_exactly(tiny32, tmp_path):
    # Later phases take the `tput` name over (extends="p3_3"), so call this phase's own function.
    from measure.demos import RunConfig
    from measure.tput import plot_tput, tput_options
    from phases.p3_3_paged_cache.demo import tput
    cfg = RunConfig(model="tiny", device="cpu", dtype="fp32", quick=True)
    cfg.options = {o.name: o.default(on_gpu=False) for o in tput_options()}
    report = tput(cfg)
    rows = report.data["rows"]
    assert {r["engine"] for r in rows} == {"dyn", "paged"}
    new = report.data["new_tokens"]
    for r in rows:
        assert r["total_tokens"] == r["batch_size"] * new and r["tok_s"] > 0
    # Batch 1 runs one request: the KV of its prompt + new - 1 tokens, exact bytes vs whole blocks.
    prompt_len = len(tiny32.prompt_ids(interleaved_latency_prompts()[0]))
    stored = prompt_len + new - 1
    dyn1 = next(r for r in rows if r["engine"] == "dyn" and r["batch_size"] == 1)
    paged1 = next(r for r in rows if r["engine"] == "paged" and r["batch_size"] == 1)
    assert dyn1["kv_peak_bytes"] == stored * kv_bytes_per_token(tiny32)
    assert paged1["kv_peak_bytes"] == blocks_for(stored, 16) * 16 * kv_bytes_per_token(tiny32)
    assert any("identical" in n for n in report.tables[1].notes)
    plot_tput(report, tmp_path / "tput.png")
    assert (tmp_path / "tput.png").stat().st_size > 0


@pytest.mark.parametrize("spare_blocks, waits", [(0, False), (-1, True)])
def test_the_tput_pool_is_exactly_big_enough_that_nobody_waits(tiny32, spare_blocks, waits):
    # The harness's own behaviour (warm-up, engine selection, the sweep) is tested in tests/test_harness.py;
    # here: its pool size for a workload, on this phase's engine, with the KV peak the tput table shows.
    from measure.harness import submit, workload_pool_blocks
    from measure.tput import tput_requests
    from phases.p3_3_paged_cache.demo import PagedPeakScheduler
    requests = tput_requests(interleaved_latency_prompts(), 4, new_tokens=5)
    n_blocks = workload_pool_blocks(tiny32, requests, 4) + spare_blocks
    sched = PagedPeakScheduler(tiny32, max_running=4, block_size=4, n_blocks=n_blocks)
    submit(sched, tiny32, requests)
    sched.run()
    assert bool(sched.waited_for_blocks) == waits
    if not waits:   # all four finish in the same step, each holding its worst case: the whole pool
        assert sched.peak_kv_bytes == n_blocks * sched.allocator.bytes_per_block


@pytest.mark.notebook("03_paging.ipynb")
def test_notebook_runs():
    from tests.nbrun import run_notebook
    run_notebook("03_paging.ipynb")
