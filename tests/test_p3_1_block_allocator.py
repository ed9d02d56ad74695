"""Phase 3.1: the block allocator hands out every block once, counts owners, never leaks, and refuses misuse."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from phases.p3_1_block_allocator import (DEFAULT_CPU_KV_BUDGET, AllocatorError, BlockAllocator, OutOfBlocks,
                                         blocks_for, budget_n_blocks, bytes_per_block)
from phases.p3_1_block_allocator.budget import MiB

SMALL = dict(n_layers=2, n_kv_heads=2, head_dim=8, block_size=4)


def small_pool(n_blocks=4, **kw):
    return BlockAllocator(n_blocks, **{**SMALL, **kw}, dtype=torch.float32)


# --- shape and sizes ----------------------------------------------------------------
@given(n_tokens=st.integers(0, 10 ** 6), block_size=st.integers(1, 4096))
def test_blocks_for_rounds_tokens_up_to_whole_blocks(n_tokens, block_size):
    n = blocks_for(n_tokens, block_size)
    assert n == math.ceil(n_tokens / block_size)
    assert n * block_size >= n_tokens > (n - 1) * block_size or n == n_tokens == 0   # no spare block


def test_pool_is_one_tensor_of_the_documented_shape():
    a = BlockAllocator(5, n_layers=3, n_kv_heads=2, head_dim=8, block_size=4, dtype=torch.bfloat16)
    assert a.kv_store.shape == (5, 3, 2, 2, 4, 8)
    assert a.kv_store.dtype == torch.bfloat16
    assert a.bytes_per_block == 3 * 2 * 2 * 4 * 8 * 2
    assert a.bytes_per_block * a.n_blocks == a.kv_store.numel() * a.kv_store.element_size()
    assert (a.n_blocks, a.n_free, a.n_used, a.block_size) == (5, 5, 0, 4)


def test_alloc_takes_from_the_front_and_free_returns_to_the_back():
    a = small_pool(4)
    assert [a.alloc() for _ in range(3)] == [0, 1, 2]
    a.free(1)
    a.free(0)
    # block 3 was never used, so it comes first; then the freed ones in the order they came back
    assert [a.alloc() for _ in range(3)] == [3, 1, 0]


def test_refcounts_share_a_block_until_the_last_owner_frees_it():
    a = small_pool(2)
    b = a.alloc()
    assert a.refcount(b) == 1
    a.incref(b)
    a.incref(b)
    assert a.refcount(b) == 3 and a.n_used == 1
    a.free(b)
    a.free(b)
    assert a.refcount(b) == 1 and b in a.owned_ids()
    a.free(b)
    assert a.refcount(b) == 0 and a.n_free == 2 and a.owned_ids() == []


def test_can_alloc_and_out_of_blocks():
    a = small_pool(2)
    assert a.can_alloc(2) and not a.can_alloc(3)
    a.alloc(), a.alloc()
    assert not a.can_alloc(1) and a.can_alloc(0)
    with pytest.raises(OutOfBlocks, match="all 2 blocks"):
        a.alloc()
    assert not issubclass(OutOfBlocks, AllocatorError)  # a scheduler catches one, never the other
    a.check_invariants()


# --- misuse ------------------------------------------------------------------------
def test_double_free_names_the_block():
    a = small_pool()
    b = a.alloc()
    a.free(b)
    with pytest.raises(AllocatorError, match=rf"block {b}.*double free"):
        a.free(b)


def test_free_of_a_block_never_handed_out():
    a = small_pool()
    with pytest.raises(AllocatorError, match="block 2.*never handed out"):
        a.free(2)


@pytest.mark.parametrize("bad", [-1, 4, 100])
def test_ids_out_of_range_are_refused(bad):
    a = small_pool(4)
    for op in (a.free, a.incref, a.refcount):
        with pytest.raises(AllocatorError, match=rf"block {bad} does not exist"):
            op(bad)


@pytest.mark.parametrize("bad", [1.0, "1", None, True])
def test_non_integer_ids_are_refused(bad):
    with pytest.raises(AllocatorError, match="must be an int"):
        small_pool().free(bad)


def test_incref_of_a_free_block_is_refused():
    a = small_pool()
    with pytest.raises(AllocatorError, match="cannot incref block 0"):
        a.incref(0)


@pytest.mark.parametrize("field", ["n_blocks", "n_layers", "n_kv_heads", "head_dim", "block_size"])
@pytest.mark.parametrize("value", [0, -3])
def test_sizes_below_one_are_refused(field, value):
    kw = dict(n_blocks=2, **SMALL)
    kw[field] = value
    with pytest.raises(AllocatorError, match=field):
        BlockAllocator(**kw)


# --- sizing ------------------------------------------------------------------------
def test_bytes_per_block_formula_for_smollm2():
    # 30 layers * 2 (K, V) * 3 KV heads * 16 tokens * 64 dims * 2 bytes (bf16)
    assert bytes_per_block(30, 3, 64, 16, torch.bfloat16) == 368_640


def test_cpu_budget_divided_by_bytes_per_block():
    per = bytes_per_block(30, 3, 64, 16, torch.bfloat16)
    assert budget_n_blocks(30, 3, 64, 16, torch.bfloat16, "cpu") == DEFAULT_CPU_KV_BUDGET // per
    assert budget_n_blocks(30, 3, 64, 16, torch.float32, "cpu", cpu_budget_bytes=10 * per) == 5
    with pytest.raises(ValueError, match="does not hold even one block"):
        budget_n_blocks(30, 3, 64, 16, torch.bfloat16, "cpu", cpu_budget_bytes=per - 1)
    with pytest.raises(ValueError, match="cpu_budget_bytes"):
        budget_n_blocks(30, 3, 64, 16, torch.bfloat16, "cpu", cpu_budget_bytes=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_budget_is_a_fraction_of_free_memory():
    free, _ = torch.cuda.mem_get_info()
    per = bytes_per_block(30, 3, 64, 16, torch.bfloat16)
    n = budget_n_blocks(30, 3, 64, 16, torch.bfloat16, "cuda", memory_fraction=0.5)
    assert abs(n - free * 0.5 // per) <= free * 0.05 // per  # free memory moves a little between reads


def test_for_model_matches_the_model_and_its_budget(tiny32):
    a = BlockAllocator.for_model(tiny32, block_size=8, cpu_budget_bytes=1 * MiB)
    assert a.kv_store.shape == (a.n_blocks, tiny32.n_layers, 2, tiny32.n_kv_heads, 8, tiny32.head_dim)
    assert a.kv_store.dtype == tiny32.dtype
    assert a.n_blocks == MiB // a.bytes_per_block
    assert BlockAllocator.for_model(tiny32, n_blocks=3).n_blocks == 3


# --- properties ----------------------------------------------------------------------
# An op: ("alloc",), ("free", k) or ("incref", k), k picking one of the currently owned blocks.
ops = st.lists(st.one_of(st.just(("alloc", 0)), st.tuples(st.sampled_from(["free", "incref"]),
                                                            st.integers(0, 1000))), max_size=60)


@settings(max_examples=80, deadline=None)
@given(n_blocks=st.integers(1, 8), script=ops)
def test_random_ops_keep_refcounts_exact_and_never_leak(n_blocks, script):
    a = small_pool(n_blocks)
    owners: dict[int, int] = {}  # the test's own count of owners per block
    for op, k in script:
        if op == "alloc":
            if len(owners) == n_blocks:
                with pytest.raises(OutOfBlocks):
                    a.alloc()
                continue
            b = a.alloc()
            assert b not in owners, f"block {b} handed out while still owned"
            owners[b] = 1
        elif owners:
            b = sorted(owners)[k % len(owners)]
            if op == "incref":
                a.incref(b)
                owners[b] += 1
            else:
                a.free(b)
                owners[b] -= 1
                if owners[b] == 0:
                    del owners[b]
        a.check_invariants()
        assert a.n_used == len(owners)
        assert a.owned_ids() == sorted(owners)
        assert all(a.refcount(b) == c for b, c in owners.items())
    for b, c in list(owners.items()):
        for _ in range(c):
            a.free(b)
    assert a.n_free == n_blocks and a.owned_ids() == []
    a.check_invariants()


# --- workload and demo ---------------------------------------------------------------------
def test_workload_lengths_are_the_schedulers_real_counts(tiny32):
    from common.prompts import interleaved_latency_prompts
    from phases.p3_1_block_allocator.demo import latency_workload_lengths
    prompts = interleaved_latency_prompts()[:3]
    got = latency_workload_lengths(tiny32, max_new_tokens=4, max_running=2, prompts=prompts)
    assert [w["prompt"] for w in got] == prompts
    assert [w["prompt_tokens"] for w in got] == [len(tiny32.prompt_ids(p)) for p in prompts]
    assert all(1 <= w["generated_tokens"] <= 4 for w in got)


def test_alloc_demo_quick():
    from measure.cli import run_demo
    report = run_demo("alloc_demo", model="tiny", device="cpu", dtype="fp32", quick=True,
                      options={"cpu_budget_mb": 2})
    d = report.data
    assert d["pool_blocks"] == 2 * MiB // d["bytes_per_block"]
    bs = d["block_size"]
    for s in d["sequences"]:
        assert s["paged_blocks"] == blocks_for(s["tokens"], bs) and 0 <= s["tail_waste"] < bs
        assert s["static_slots"] == d["static_tokens"]
    totals = {row[0]: row for row in report.tables[-1].rows}
    assert totals["paged"][-1] < totals["static reservation"][-1]
