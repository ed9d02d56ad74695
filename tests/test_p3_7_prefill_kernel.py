"""Phase 3.7: varlen paged prefill attention (the Triton kernel, its references, the CPU path, the tile plan).

Oracles, in a chain:
- the mask equals transformers' own definition (causal, sliding window);
- the fp32 reference equals SDPA over the same K/V laid out contiguously, and with
  a softcap it equals Gemma 2's own eager attention from transformers;
- the Triton kernel (under the CPU interpreter here) and the CPU path equal the reference.
Every pool slot that is not a sequence's token holds NaN (measure/paged_inputs.py), so reading one
shows up as a NaN in the output. Shapes stay small: the interpreter runs every
program in Python.
"""

import logging
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2_eager_attention

from extras.p3_7_varlen_prefill.contiguous import sdpa_prefill_contiguous
from extras.p3_7_varlen_prefill.cpu_path import paged_prefill_attention_cpu
from measure.paged_inputs import random_prefill_pack
from phases.p3_4_gather_kernel.dispatch import FORCE_KERNELS_ENV
from phases.p3_7_varlen_prefill import ops
from phases.p3_7_varlen_prefill.kernel import paged_prefill_attention_triton
from phases.p3_7_varlen_prefill.plan import plan_prefill, query_tiles
from phases.p3_7_varlen_prefill.reference import paged_prefill_attention_reference, visible_keys

REPO_ROOT = Path(__file__).resolve().parent.parent
N_KV_HEADS = 2
HEAD_DIM = 16
BLOCK_M = 16              # the smallest query tile tl.dot takes: more tiles, more boundaries, less interpreter time
# Four segments: a fresh one, one of length 1 after a context, one spanning two query tiles after
# a context, and a fresh one spanning three. No length is a multiple of the block sizes used.
SEG_LENS = [5, 1, 20, 33]
CONTEXT_LENS = [0, 7, 21, 0]
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# The references compute in fp32 and round once to the output dtype; so does the kernel (in another
# order; the interpreter truncates fp32 -> bf16 where a GPU rounds): about one output ulp.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def close(a, b, dtype=torch.float32):
    torch.testing.assert_close(a.float(), b.float(), **TOL[dtype])


def pack(block_size=4, group=2, dtype=torch.float32, seg_lens=SEG_LENS, context_lens=CONTEXT_LENS, seed=0,
         head_dim=HEAD_DIM):
    return random_prefill_pack(seg_lens, context_lens, block_size, N_KV_HEADS, group, head_dim, dtype=dtype,
                               seed=seed)


def plan_of(p):
    return plan_prefill(p.cu_seqlens_q, p.context_lens, BLOCK_M)


def reference_fp32(p, **kw):
    """The oracle on the same (rounded) inputs, in fp32 throughout."""
    return paged_prefill_attention_reference(p.q.float(), p.kv_store.float(), *p.args()[2:], **kw)


# --- the mask and the references -------------------------------------------------------------------

@pytest.mark.parametrize("window", [None, 1, 3, 8])
def test_visible_keys_follow_transformers_masks(window):
    q_pos, k_pos = torch.arange(5, 17), torch.arange(17)        # queries after a 5-token context
    hf = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    expected = hf(0, 0, q_pos[:, None], k_pos[None, :])         # transformers' mask_function(b, h, q_idx, kv_idx)
    assert torch.equal(visible_keys(q_pos, k_pos, window), expected)
    if window is not None:
        # w keys each, itself included (fewer near the start of the sequence)
        assert torch.equal(visible_keys(q_pos, k_pos, window).sum(1), (q_pos + 1).clamp(max=window))


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_reference_equals_sdpa_on_contiguous_kv(group, window):
    p = pack(group=group, seed=group)
    ref = paged_prefill_attention_reference(*p.args(), sliding_window=window)
    assert ref.shape == p.q.shape and ref.dtype == p.q.dtype and torch.isfinite(ref).all()
    close(ref, sdpa_prefill_contiguous(p.q, p.k, p.v, p.cu_seqlens_q, p.context_lens, sliding_window=window))


def test_reference_softcap_equals_gemma2_attention():
    """With a softcap (and a window) the reference computes what Gemma 2's own attention does."""
    softcap, window, scale = 2.0, 6, 0.3
    p = pack(group=2, seed=11)
    ref = paged_prefill_attention_reference(*p.args(), scale, sliding_window=window, softcap=softcap)
    module = SimpleNamespace(num_key_value_groups=2, training=False)
    for s, (start, end) in enumerate(zip(p.cu_seqlens_q.tolist(), p.cu_seqlens_q[1:].tolist())):
        context, total = CONTEXT_LENS[s], CONTEXT_LENS[s] + end - start
        q_pos, k_pos = torch.arange(context, total), torch.arange(total)
        visible = sliding_window_causal_mask_function(window)(0, 0, q_pos[:, None], k_pos[None, :])
        additive = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))[None, None]
        out, _ = gemma2_eager_attention(module, p.q[start:end].transpose(0, 1)[None], p.k[s:s + 1, :, :total],
                                        p.v[s:s + 1, :, :total], additive, scaling=scale, softcap=softcap)
        close(ref[start:end], out[0])                           # [T, H, D]


# --- the CPU path ---------------------------------------------------------------------------------

@pytest.mark.parametrize("window, softcap", [(None, None), (5, None), (None, 3.0), (5, 3.0)])
@pytest.mark.parametrize("dtype_name", DTYPES)
def test_cpu_path_equals_reference(dtype_name, window, softcap):
    dtype = DTYPES[dtype_name]
    # group 3: not a power of two (SmolLM2: 9 over 3). A context of 1 token: the least that is not fresh.
    p = pack(group=3, dtype=dtype, context_lens=[1, 7, 21, 0], seed=5)
    kw = dict(sliding_window=window, softcap=softcap, plan=plan_of(p))
    ref = paged_prefill_attention_reference(*p.args(), **kw)
    for new_kv in (None, (p.new_k, p.new_v)):                   # from the pool, or fresh segments' K/V as given
        out = paged_prefill_attention_cpu(*p.args(), new_kv=new_kv, **kw)
        assert out.dtype == dtype and out.shape == p.q.shape
        close(out, ref, dtype)


# --- the Triton kernel, under the interpreter --------------------------------------------------------

@pytest.mark.parametrize("dtype_name, block_size, block_n, group", [
    ("fp32", 4, 16, 1),       # pool blocks smaller than the key tile: a tile reads 4 blocks
    ("fp32", 32, 16, 2),      # larger: a block holds two key tiles
    ("fp32", 12, 32, 3),      # a block size that is no power of two, tiles straddling blocks unevenly
    ("fp16", 8, 32, 4),
    ("bf16", 16, 16, 2),
    ("bf16", 4, 32, 4),
])
def test_kernel_equals_reference(dtype_name, block_size, block_n, group):
    dtype = DTYPES[dtype_name]
    p = pack(block_size, group, dtype, seed=block_size + group)
    plan = plan_of(p)
    out = paged_prefill_attention_triton(*p.args(), plan=plan, block_n=block_n)
    assert out.shape == p.q.shape and out.dtype == dtype and torch.isfinite(out).all()
    close(out, paged_prefill_attention_reference(*p.args(), plan=plan), dtype)
    close(out, reference_fp32(p), dtype)


@pytest.mark.parametrize("window, softcap", [(5, None), (None, 2.5), (20, 2.5)])
def test_kernel_window_and_softcap_and_never_reads_keys_before_the_window(window, softcap):
    p = pack(block_size=8, group=2, seg_lens=[3, 24, 6], context_lens=[40, 50, 0], seed=17)
    plan = plan_of(p)
    kw = dict(scale=0.2, sliding_window=window, softcap=softcap, plan=plan)
    ref = paged_prefill_attention_reference(*p.args(), **kw)
    if window is not None:
        # Poison every key before the earliest one any query of the segment sees: the kernel
        # must skip those key tiles (a NaN read there would reach the output through 0 * NaN).
        for s, context in enumerate([40, 50, 0]):
            for position in range(max(context - window + 1, 0)):
                block, offset = p.slot(s, position)
                p.kv_store[block, p.layer_idx, :, :, offset] = float("nan")
    out = paged_prefill_attention_triton(*p.args(), block_n=16, **kw)
    assert torch.isfinite(out).all()
    close(out, ref)


def test_kernel_and_cpu_path_take_empty_segments_a_strided_query_and_an_empty_pack():
    p = pack(block_size=4, group=2, seg_lens=[3, 0, 17, 0], context_lens=[2, 5, 0, 0], seed=23)
    plan = plan_of(p)
    assert plan.tiles.tolist() == [[0, 0], [2, 0], [2, 16]]    # an empty segment has no tiles
    ref = paged_prefill_attention_reference(*p.args(), plan=plan)
    # The engine's query arrives as [1, H, N, D]; its [N, H, D] view is not contiguous.
    q_strided = p.q.transpose(0, 1).contiguous().transpose(0, 1)
    assert not q_strided.is_contiguous()
    args = (q_strided, *p.args()[1:])
    for out in (paged_prefill_attention_triton(*args, plan=plan, block_n=16),
                paged_prefill_attention_cpu(*args, plan=plan)):
        assert out.is_contiguous()
        close(out, ref)

    empty = pack(seg_lens=[0, 0], context_lens=[3, 0], seed=1)
    for path in (paged_prefill_attention_triton, paged_prefill_attention_cpu, paged_prefill_attention_reference):
        assert path(*empty.args()).shape == (0, N_KV_HEADS * 2, HEAD_DIM)


def test_the_kernel_reads_only_its_layer_and_its_sequences_blocks():
    p = pack(block_size=4, group=2, seed=29)
    plan = plan_of(p)
    before = paged_prefill_attention_triton(*p.args(), plan=plan, block_n=16)
    p.kv_store[:, 1 - p.layer_idx] = 1e4                       # another layer
    assert torch.equal(paged_prefill_attention_triton(*p.args(), plan=plan, block_n=16), before)


# --- the plan -------------------------------------------------------------------------------------

def test_query_tiles_cut_each_segment_and_never_straddle_two():
    assert query_tiles([0, 1, 16, 17, 32, 0], 16) == [(1, 0), (2, 0), (3, 0), (3, 16), (4, 0), (4, 16)]
    assert query_tiles([], 16) == []
    plan = plan_prefill([0, 5, 5, 70], [3, 0, 9], block_m=32)
    assert plan.seg_starts == (0, 5, 5) and plan.seg_lens == (5, 0, 65) and plan.total_lens == (8, 0, 74)
    assert plan.tiles.dtype == torch.int32 and plan.tiles.tolist() == [[0, 0], [2, 0], [2, 32], [2, 64]]
    assert plan_prefill([0], []).tiles.shape == (0, 2) and plan_prefill([0], []).n_tokens == 0
    from_tensors = plan_prefill(torch.tensor([0, 5, 5, 70], dtype=torch.int32), torch.tensor([3, 0, 9]), 32)
    assert from_tensors.seg_starts == plan.seg_starts and from_tensors.context_lens == plan.context_lens
    assert torch.equal(from_tensors.tiles, plan.tiles)


@pytest.mark.parametrize("cu, context, block_m, message", [
    ([1, 5], [0], 16, "must start at 0"),
    ([], [], 16, "must start at 0"),
    ([0, 5, 3], [0, 0], 16, "non-decreasing"),
    ([0, 5], [0, 0], 16, "context_lens has 2 entries"),
    ([0, 5], [-1], 16, ">= 0"),
    ([0, 5], [0], 8, "block_m must be a power of two >= 16"),
    ([0, 5], [0], 24, "block_m must be a power of two >= 16"),
])
def test_plan_refuses_a_bad_layout(cu, context, block_m, message):
    with pytest.raises(ValueError, match=message):
        plan_prefill(cu, context, block_m)


# --- bad input --------------------------------------------------------------------------------------

def _bad_inputs():
    """(name, change) pairs: each change turns a good call's arguments into a bad one."""
    def with_(**kw):
        return lambda args: {**args, **kw}
    return [
        ("q must be \\[n_tokens", lambda a: {**a, "q": a["q"][None]}),
        ("head_dim", lambda a: {**a, "q": a["q"][..., :8]}),
        ("multiple of n_kv_heads", lambda a: {**a, "q": a["q"][:, :3]}),
        ("plan was made for", lambda a: {**a, "q": a["q"][:-1]}),
        ("cu_seqlens_q must be 1-d with 5", lambda a: {**a, "cu_seqlens_q": a["cu_seqlens_q"][:-1]}),
        ("context_lens must be int32 or int64", lambda a: {**a, "context_lens": a["context_lens"].float()}),
        ("plan was made for other", lambda a: {**a, "context_lens": a["context_lens"] + 1}),
        ("block_tables rows hold at most", lambda a: {**a, "block_tables": a["block_tables"][:, :3]}),
        ("block ids outside the pool", lambda a: {**a, "block_tables": a["block_tables"] - 100}),
        ("block_tables must be int32 or int64", lambda a: {**a, "block_tables": a["block_tables"].float()}),
        ("layer_idx", with_(layer_idx=7)),
        ("sliding_window must be", with_(sliding_window=0)),
        ("softcap must be", with_(softcap=-1.0)),
        ("fp32/fp16/bf16", lambda a: {**a, "q": a["q"].double()}),
    ]


@pytest.mark.parametrize("message, change", _bad_inputs(), ids=[m for m, _ in _bad_inputs()])
@pytest.mark.parametrize("path", [paged_prefill_attention_triton, paged_prefill_attention_cpu,
                                  paged_prefill_attention_reference])
def test_bad_input_raises_clearly(path, message, change):
    p = pack(block_size=4, group=2, seed=31)
    good = dict(zip(("q", "kv_store", "layer_idx", "block_tables", "cu_seqlens_q", "context_lens"), p.args()))
    good["plan"] = plan_of(p)
    with pytest.raises(ValueError, match=message):
        path(**change(good))


def test_kernel_refuses_what_tl_dot_cannot_take():
    p = pack(block_size=4, group=2, seed=37)
    plan = plan_of(p)
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        paged_prefill_attention_triton(*p.args(), plan=plan, block_n=24)
    with pytest.raises(ValueError, match="must be >= 16 for tl.dot"):
        paged_prefill_attention_triton(*p.args(), plan=plan, block_n=8)
    with pytest.raises(ValueError, match="must share a dtype"):
        paged_prefill_attention_triton(p.q.half(), *p.args()[1:], plan=plan)
    small = pack(block_size=4, group=2, seed=37, head_dim=8)
    with pytest.raises(ValueError, match="must be >= 16 for tl.dot"):
        paged_prefill_attention_triton(*small.args(), plan=plan_of(small))
    odd = pack(block_size=4, group=2, seed=37, head_dim=24)
    with pytest.raises(ValueError, match="head_dim must be a power of two"):
        paged_prefill_attention_triton(*odd.args(), plan=plan_of(odd))
    close(paged_prefill_attention_cpu(*odd.args()), paged_prefill_attention_reference(*odd.args()))  # CPU path: any


# --- the dispatcher ---------------------------------------------------------------------------------

def test_dispatcher_takes_the_cpu_path_says_so_once_and_the_kernel_when_forced(monkeypatch, caplog):
    monkeypatch.setenv(FORCE_KERNELS_ENV, "0")
    monkeypatch.setattr("phases.p3_4_gather_kernel.dispatch._announced", set())
    p = pack(block_size=4, group=2, seed=41)
    plan = ops.plan_prefill(p.cu_seqlens_q, p.context_lens, BLOCK_M)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            out = ops.paged_prefill_attention(*p.args(), plan=plan)
    messages = [r.getMessage() for r in caplog.records if ops.PREFILL_FEATURE in r.getMessage()]
    assert messages == [f"no GPU: {ops.PREFILL_FEATURE} uses the PyTorch reference path"]
    close(out, paged_prefill_attention_reference(*p.args()))
    close(ops.paged_prefill_attention(*p.args(), plan=plan, new_kv=(p.new_k, p.new_v)), out)

    calls = []
    monkeypatch.setattr("phases.p3_7_varlen_prefill.kernel.paged_prefill_attention_triton",
                        lambda *a, **kw: calls.append(a) or paged_prefill_attention_triton(*a, **kw))
    monkeypatch.setenv(FORCE_KERNELS_ENV, "1")
    close(ops.paged_prefill_attention(*p.args(), plan=plan), out)
    assert len(calls) == 1


# --- compiled for an H100, without one ----------------------------------------------------------------

H100_SHARED_BYTES = 227 * 1024   # the most shared memory one program may use on an H100


def test_kernel_compiles_for_an_h100_without_spilling():
    """Triton compiles for sm_90 ahead of time with the ptxas in its wheel; no GPU needed to build.
    Runs in its own process: this one has the kernel under the interpreter."""
    script = ("import torch\n"
              "from measure.prefill_aot_check import compile_prefill_kernel as c\n"
              "for cost in (c(torch.bfloat16, 128, window=True, softcap=True), c(torch.float32, 128)):\n"
              "    print(cost.registers, cost.spill_bytes, cost.shared_bytes)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for line in done.stdout.split("\n")[-3:-1]:
        registers, spill_bytes, shared_bytes = map(int, line.split())
        assert spill_bytes == 0 and 0 < shared_bytes <= H100_SHARED_BYTES, line


def test_varlen_bench_quick_runs_on_the_cpu():
    """The phase's demo: one row per (pack, prefix), the loop and the varlen call agreeing."""
    from measure.cli import run_demo
    report = run_demo("varlen_bench", "tiny", "cpu", "fp32", quick=True)
    rows = report.data["attention"]
    assert len(rows) == 4 and all(r["max_err"] < 1e-4 for r in rows)
