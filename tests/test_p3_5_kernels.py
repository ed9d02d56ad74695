"""Phase 3.5 kernels: paged decode attention (and its split-KV variant) and the K/V store.

Oracles: the Triton kernel (under the CPU interpreter) equals the PyTorch
reference, and the reference equals SDPA on the same K/V laid out contiguously.
Shapes stay small: the interpreter runs every program in Python.
"""

import logging

import pytest
import torch

from measure.paged_inputs import random_paged_batch
from extras.p3_5_paged_attention.contiguous import sdpa_decode_contiguous
from phases.p3_4_gather_kernel.dispatch import FORCE_KERNELS_ENV
from phases.p3_4_gather_kernel.reference import gather_reference
from phases.p3_5_paged_attention import ops
from extras.p3_5_paged_attention.cpu_path import (paged_decode_attention_gather_bmm, paged_decode_attention_gather_sdpa,
                                                  write_kv_reference)
from extras.p3_5_paged_attention.split_kv import paged_decode_attention_split
from phases.p3_5_paged_attention.kernels import paged_decode_attention_triton, write_kv_triton
from phases.p3_5_paged_attention.reference import paged_decode_attention_reference
from tests.test_p3_4_gather_kernel import run_fresh_without_interpret_env

LAYER = 1
N_KV_HEADS = 2
HEAD_DIM = 16
# fp32 agrees to rounding; fp16/bf16 outputs are rounded once to the output dtype (the
# interpreter truncates fp32 -> bf16 where a GPU rounds to nearest: up to one bf16 ulp).
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def make_case(block_size, group, dtype=torch.float32, lens=None, seed=0):
    lens = lens or [1, block_size - 1, 2 * block_size + 1, 3 * block_size]
    batch = random_paged_batch(lens, block_size, N_KV_HEADS, HEAD_DIM, dtype=dtype, seed=seed)
    q = torch.randn(len(lens), N_KV_HEADS * group, HEAD_DIM, generator=torch.Generator().manual_seed(seed + 1))
    return q.to(dtype), batch


def close(a, b, dtype):
    torch.testing.assert_close(a.float(), b.float(), **TOL[dtype])


@pytest.mark.parametrize("block_size", [4, 8, 16])
@pytest.mark.parametrize("group", [1, 2, 3, 4])  # 3: a group that is not a power of two (SmolLM2: 9 over 3)
def test_kernel_equals_reference_equals_sdpa(block_size, group):
    q, b = make_case(block_size, group, seed=block_size + group)
    scale = HEAD_DIM ** -0.5
    ref = paged_decode_attention_reference(q, b.kv_store, LAYER, b.block_tables, b.seq_lens, scale)
    k, v = gather_reference(b.kv_store, LAYER, b.block_tables, b.seq_lens)
    close(ref, sdpa_decode_contiguous(q, k, v, b.seq_lens, scale), torch.float32)
    out = paged_decode_attention_triton(q, b.kv_store, LAYER, b.block_tables, b.seq_lens, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    close(out, ref, torch.float32)
    cpu = paged_decode_attention_gather_bmm(q, b.kv_store, LAYER, b.block_tables, b.seq_lens, scale)
    close(cpu, ref, torch.float32)  # the engine's CPU path, on the same boundary-length cases


def test_cpu_path_takes_a_non_contiguous_query_and_refuses_a_plan_made_for_other_tables():
    from extras.p3_5_paged_attention.cpu_path import plan_decode
    q, b = make_case(4, 2, lens=[3, 9], seed=23)
    ref = paged_decode_attention_reference(q, b.kv_store, LAYER, b.block_tables, b.seq_lens)
    q_strided = q.transpose(0, 1).contiguous().transpose(0, 1)        # same values, other strides
    close(paged_decode_attention_gather_bmm(q_strided, b.kv_store, LAYER, b.block_tables, b.seq_lens), ref,
          torch.float32)
    other = plan_decode(b.kv_store, b.block_tables[:1], b.seq_lens[:1])
    with pytest.raises(ValueError, match="plan was made for other tables"):
        paged_decode_attention_gather_bmm(q, b.kv_store, LAYER, b.block_tables, b.seq_lens, plan=other)


def test_real_model_shapes():
    """SmolLM2-135M's layout: 3 KV heads (not a power of two), 9 query heads, head_dim 64, blocks of 16."""
    batch = random_paged_batch([1, 17, 40], 16, n_kv_heads=3, head_dim=64, dtype=torch.bfloat16, seed=13)
    q = torch.randn(3, 9, 64, generator=torch.Generator().manual_seed(14)).to(torch.bfloat16)
    ref = paged_decode_attention_reference(q, batch.kv_store, LAYER, batch.block_tables, batch.seq_lens)
    out = paged_decode_attention_triton(q, batch.kv_store, LAYER, batch.block_tables, batch.seq_lens)
    close(out, ref, torch.bfloat16)
    k, v = torch.randn(2, 2, 3, 64).to(torch.bfloat16).unbind(0)
    pools = [batch.kv_store.clone(), batch.kv_store.clone()]
    write_kv_reference(pools[0], LAYER, k, v, torch.tensor([5, 33]))
    write_kv_triton(pools[1], LAYER, k, v, torch.tensor([5, 33]))
    assert torch.equal(pools[0], pools[1])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_dtypes(dtype):
    q, b = make_case(8, 2, dtype=dtype, seed=3)
    ref = paged_decode_attention_reference(q, b.kv_store, LAYER, b.block_tables, b.seq_lens)
    out = paged_decode_attention_triton(q, b.kv_store, LAYER, b.block_tables, b.seq_lens)
    assert out.dtype == dtype and ref.dtype == dtype
    close(out, ref, dtype)
    k, v = gather_reference(b.kv_store, LAYER, b.block_tables, b.seq_lens)
    close(ref, sdpa_decode_contiguous(q, k, v, b.seq_lens), dtype)
    # And both stay near the fp32 answer on the same (rounded) inputs.
    exact = paged_decode_attention_reference(q.float(), b.kv_store.float(), LAYER, b.block_tables, b.seq_lens)
    close(out, exact, dtype)


@pytest.mark.parametrize("blocks_per_split", [1, 2, 3])
def test_split_kv_equals_single_pass(blocks_per_split):
    # Lengths chosen so some sequences leave whole splits empty.
    q, b = make_case(4, 2, lens=[1, 5, 13, 24], seed=blocks_per_split)
    single = paged_decode_attention_triton(q, b.kv_store, LAYER, b.block_tables, b.seq_lens)
    split = paged_decode_attention_split(q, b.kv_store, LAYER, b.block_tables, b.seq_lens,
                                         blocks_per_split=blocks_per_split)
    close(split, single, torch.float32)


@pytest.mark.parametrize("path", [paged_decode_attention_gather_sdpa, paged_decode_attention_gather_bmm])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_paths_equal_reference(dtype, path):
    q, b = make_case(8, 3, dtype=dtype, lens=[1, 9, 30], seed=15)
    ref = paged_decode_attention_reference(q, b.kv_store, LAYER, b.block_tables, b.seq_lens)
    out = path(q, b.kv_store, LAYER, b.block_tables, b.seq_lens)
    assert out.dtype == dtype
    close(out, ref, dtype)


def test_length_zero_gives_zeros_everywhere():
    q, b = make_case(4, 2, lens=[0, 6], seed=5)
    ref = paged_decode_attention_reference(q, b.kv_store, LAYER, b.block_tables, b.seq_lens)
    for out in (ref, paged_decode_attention_gather_sdpa(q, b.kv_store, LAYER, b.block_tables, b.seq_lens),
                paged_decode_attention_gather_bmm(q, b.kv_store, LAYER, b.block_tables, b.seq_lens),
                paged_decode_attention_triton(q, b.kv_store, LAYER, b.block_tables, b.seq_lens),
                paged_decode_attention_split(q, b.kv_store, LAYER, b.block_tables, b.seq_lens, blocks_per_split=1)):
        assert not out[0].any() and torch.isfinite(out).all()
        close(out, ref, torch.float32)


@pytest.mark.parametrize("path", [paged_decode_attention_triton, paged_decode_attention_gather_bmm])
def test_attention_ignores_other_sequences_and_padding(path):
    # Changing blocks that belong to nobody, or table entries past a length, changes nothing.
    q, b = make_case(4, 2, lens=[3, 9], seed=6)
    before = path(q, b.kv_store, LAYER, b.block_tables, b.seq_lens)
    used = {i for ids in b.block_ids for i in ids}
    spare = [i for i in range(b.kv_store.shape[0]) if i not in used]
    b.kv_store[spare] = 1e4
    b.kv_store[:, 0] = -1e4  # another layer
    tables = b.block_tables.clone()
    tables[0, 1:] = spare[0]
    after = path(q, b.kv_store, LAYER, tables, b.seq_lens)
    assert torch.equal(before, after)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_lands_exactly_at_the_slots(dtype):
    block_size, n_tokens = 4, 6
    b = random_paged_batch([12], block_size, N_KV_HEADS, HEAD_DIM, dtype=dtype, seed=7)
    gen = torch.Generator().manual_seed(8)
    k = torch.randn(n_tokens, N_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(n_tokens, N_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    n_slots = b.kv_store.shape[0] * block_size
    slots = torch.randperm(n_slots, generator=gen)[:n_tokens]
    slots[2] = -1  # a padding token: stores nothing
    pools = [b.kv_store.clone(), b.kv_store.clone()]
    write_kv_reference(pools[0], LAYER, k, v, slots)
    write_kv_triton(pools[1], LAYER, k, v, slots)
    assert torch.equal(pools[0], pools[1])

    expected = b.kv_store.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[slot // block_size, LAYER, 0, :, slot % block_size] = k[t]
            expected[slot // block_size, LAYER, 1, :, slot % block_size] = v[t]
    assert torch.equal(pools[1], expected)  # the slots changed, nothing else did


def test_write_then_attend_matches_contiguous_sdpa():
    """The engine's step in miniature: store a new token's K/V, then attend over the whole sequence."""
    block_size, n_prev = 4, 6
    b = random_paged_batch([n_prev + 1], block_size, N_KV_HEADS, HEAD_DIM, seed=9)
    k_new, v_new, q = torch.randn(3, 1, N_KV_HEADS, HEAD_DIM).unbind(0)
    slot = torch.tensor([b.block_ids[0][n_prev // block_size] * block_size + n_prev % block_size])
    ops.write_kv(b.kv_store, LAYER, k_new, v_new, slot)
    q = q.repeat_interleave(2, dim=1)  # [1, 4 heads, D], group 2
    out = ops.paged_decode_attention(q, b.kv_store, LAYER, b.block_tables, b.seq_lens)
    k, v = gather_reference(b.kv_store, LAYER, b.block_tables, b.seq_lens)
    assert torch.equal(k[0, :, n_prev], k_new[0])
    close(out, sdpa_decode_contiguous(q, k, v, b.seq_lens), torch.float32)


def test_dispatcher_reference_path_says_so_once(monkeypatch, caplog):
    monkeypatch.setenv(FORCE_KERNELS_ENV, "0")
    monkeypatch.setattr("phases.p3_4_gather_kernel.dispatch._announced", set())
    q, b = make_case(4, 2, seed=10)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            out = ops.paged_decode_attention(q, b.kv_store, LAYER, b.block_tables, b.seq_lens)
    msgs = [r.getMessage() for r in caplog.records if "paged attention" in r.getMessage()]
    assert msgs == ["no GPU: paged attention uses the PyTorch reference path"]
    monkeypatch.setenv(FORCE_KERNELS_ENV, "1")
    close(ops.paged_decode_attention(q, b.kv_store, LAYER, b.block_tables, b.seq_lens), out, torch.float32)
    pool = b.kv_store.clone()
    ops.write_kv(pool, LAYER, b.kv_store[0, 0, 0].transpose(0, 1)[:2], b.kv_store[0, 0, 1].transpose(0, 1)[:2],
                 torch.tensor([5, 6]))
    assert torch.equal(pool[1, LAYER, 0, :, 1], b.kv_store[0, 0, 0, :, 0])


def test_bad_input_gets_a_clear_error():
    q, b = make_case(4, 2, seed=11)
    pool, tables, lens = b.kv_store, b.block_tables, b.seq_lens
    with pytest.raises(ValueError, match="q must be"):
        paged_decode_attention_triton(q[:, None], pool, LAYER, tables, lens)
    with pytest.raises(ValueError, match="batch"):
        paged_decode_attention_reference(q[:2], pool, LAYER, tables, lens)
    with pytest.raises(ValueError, match="head_dim"):
        paged_decode_attention_triton(q[..., :8], pool, LAYER, tables, lens)
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        paged_decode_attention_triton(q[:, :3], pool, LAYER, tables, lens)
    odd_q, odd = make_case(6, 1, seed=12)
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        paged_decode_attention_triton(odd_q, odd.kv_store, LAYER, odd.block_tables, odd.seq_lens)
    with pytest.raises(ValueError, match="blocks_per_split"):
        paged_decode_attention_split(q, pool, LAYER, tables, lens, blocks_per_split=0)
    k = torch.zeros(2, N_KV_HEADS, HEAD_DIM)
    with pytest.raises(ValueError, match="v must be"):
        write_kv_triton(pool, LAYER, k, k[:, :1], torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="slot_mapping must lie"):
        write_kv_reference(pool, LAYER, k, k, torch.tensor([0, 10_000]))
    with pytest.raises(ValueError, match="int32 or int64"):
        write_kv_triton(pool, LAYER, k, k, torch.tensor([0.0, 1.0]))


def test_kernels_run_when_triton_was_imported_before_the_interpreter_switch():
    """torch._dynamo imports triton when a model loads; tl.sum/tl.max/tl.zeros must still work after."""
    code = ("import sys, torch, torch._dynamo\n"
            "assert 'triton.language' in sys.modules\n"
            "from measure.paged_inputs import random_paged_batch\n"
            "from phases.p3_5_paged_attention.kernels import paged_decode_attention_triton\n"
            "from phases.p3_5_paged_attention.reference import paged_decode_attention_reference\n"
            "b = random_paged_batch([3, 9], 4, 2, 16)\n"
            "q = torch.randn(2, 4, 16)\n"
            "args = (q, b.kv_store, 1, b.block_tables, b.seq_lens)\n"
            "torch.testing.assert_close(paged_decode_attention_triton(*args), paged_decode_attention_reference(*args))\n"
            "print('ok')\n")
    assert run_fresh_without_interpret_env(code, timeout_s=180).strip() == "ok"


def test_attn_bench_demo_quick(tmp_path):
    from measure.cli import run_demo
    from phases.p3_5_paged_attention.demo import plot_attn
    report = run_demo("attn_bench", model="tiny", device="cpu", dtype="fp32", quick=True)
    rows = report.data["rows"]
    assert len(rows) == 4 and all(r["ref_err"] < 1e-4 for r in rows)
    assert rows[0]["kernel_err"] is not None and rows[0]["kernel_err"] < 1e-4  # checked under the interpreter
    assert all(r["kernel_ms"] is None for r in rows)  # never timed on a CPU
    plot_attn(report, tmp_path / "a.png")
    assert (tmp_path / "a.png").stat().st_size > 0


def test_per_pass_plans_give_the_same_answers_as_planning_per_call():
    from extras.p3_5_paged_attention.cpu_path import plan_decode, plan_write
    q, b = make_case(4, 3, lens=[1, 9, 30], seed=21)
    plan = plan_decode(b.kv_store, b.block_tables, b.seq_lens)
    for layer in range(b.kv_store.shape[1]):  # one plan serves every layer
        assert torch.equal(paged_decode_attention_gather_bmm(q, b.kv_store, layer, b.block_tables, b.seq_lens),
                           paged_decode_attention_gather_bmm(q, b.kv_store, layer, b.block_tables, b.seq_lens,
                                                             plan=plan))
    gen = torch.Generator().manual_seed(22)
    k = torch.randn(5, N_KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(5, N_KV_HEADS, HEAD_DIM, generator=gen)
    slots = torch.tensor([3, -1, 17, 8, -1])  # two padding tokens store nothing
    planned, unplanned = b.kv_store.clone(), b.kv_store.clone()
    write_kv_reference(planned, LAYER, k, v, slots, plan=plan_write(planned, slots))
    write_kv_reference(unplanned, LAYER, k, v, slots)
    assert torch.equal(planned, unplanned) and not torch.equal(planned, b.kv_store)
    with pytest.raises(ValueError, match="slot_mapping must lie in"):
        plan_write(b.kv_store, torch.tensor([b.kv_store.shape[0] * b.kv_store.shape[4]]))


# --- what a layer asks besides causality: a sliding window (Mistral, Gemma 2/3), a softcap (Gemma 2) ---------
# (window, softcap): a window of one key (the query itself), windows shorter and longer than a block, a softcap
# small enough to bend these random scores, and both at once.
WINDOW_SOFTCAP_CASES = [(1, None), (3, None), (6, None), (None, 1.5), (5, 2.0)]


def test_decode_visible_follows_transformers_sliding_window_mask():
    from transformers.masking_utils import sliding_window_causal_mask_function
    from phases.p3_5_paged_attention.reference import decode_visible
    lens = torch.tensor([0, 1, 4, 9])
    for window in (1, 3, 8):
        hf = sliding_window_causal_mask_function(window)
        # the one query of a sequence of length n sits at position n - 1
        expected = torch.stack([hf(0, 0, torch.tensor(n - 1), torch.arange(12)) for n in lens.tolist()])
        assert torch.equal(decode_visible(lens, 12, window), expected)


@pytest.mark.parametrize("window, softcap", WINDOW_SOFTCAP_CASES)
def test_window_and_softcap_on_every_path(window, softcap):
    """Kernel, split-KV and the CPU path equal the reference; the reference equals SDPA with a window mask
    (SDPA has no softcap), and differs from plain causal attention (the case really changes something)."""
    q, b = make_case(4, 2, lens=[1, 4, 7, 13, 24], seed=31)
    q = q * 4   # larger scores: a softcap of 1.5-2 bends them a lot
    args = (q, b.kv_store, LAYER, b.block_tables, b.seq_lens)
    kw = dict(sliding_window=window, softcap=softcap)
    ref = paged_decode_attention_reference(*args, **kw)
    if softcap is None:
        k, v = gather_reference(b.kv_store, LAYER, b.block_tables, b.seq_lens)
        close(ref, sdpa_decode_contiguous(q, k, v, b.seq_lens, sliding_window=window), torch.float32)
        close(ref, paged_decode_attention_gather_sdpa(*args, sliding_window=window), torch.float32)
    for out in (paged_decode_attention_triton(*args, **kw),
                paged_decode_attention_split(*args, blocks_per_split=1, **kw),
                paged_decode_attention_split(*args, blocks_per_split=3, **kw),
                paged_decode_attention_gather_bmm(*args, **kw),
                ops.paged_decode_attention(*args, **kw)):
        close(out, ref, torch.float32)
    assert not torch.allclose(ref, paged_decode_attention_reference(*args), atol=1e-3)


@pytest.mark.parametrize("blocks_per_split", [None, 1, 2])
def test_decode_kernel_never_reads_keys_before_the_window(blocks_per_split):
    """Every slot before each sequence's window holds NaN: a kernel that loads one comes out NaN."""
    window = 5
    q, b = make_case(4, 2, lens=[3, 9, 22], seed=33)
    clean = paged_decode_attention_reference(q, b.kv_store, LAYER, b.block_tables, b.seq_lens,
                                             sliding_window=window)
    for row, n in enumerate(b.seq_lens.tolist()):
        for pos in range(max(n - window, 0)):
            block = int(b.block_tables[row, pos // 4])
            b.kv_store[block, LAYER, :, :, pos % 4] = float("nan")
    args = (q, b.kv_store, LAYER, b.block_tables, b.seq_lens)
    out = (paged_decode_attention_triton(*args, sliding_window=window) if blocks_per_split is None else
           paged_decode_attention_split(*args, blocks_per_split=blocks_per_split, sliding_window=window))
    assert torch.isfinite(out).all()
    close(out, clean, torch.float32)


@pytest.mark.parametrize("kw, message", [(dict(sliding_window=0), "sliding_window"),
                                         (dict(sliding_window=2.5), "sliding_window"),
                                         (dict(softcap=0.0), "softcap"), (dict(softcap=-1.0), "softcap")])
def test_a_bad_window_or_softcap_is_refused(kw, message):
    q, b = make_case(4, 2, seed=34)
    args = (q, b.kv_store, LAYER, b.block_tables, b.seq_lens)
    for path in (paged_decode_attention_reference, paged_decode_attention_triton, paged_decode_attention_gather_bmm):
        with pytest.raises(ValueError, match=message):
            path(*args, **kw)
