"""Phase 3.9's tuned decode kernel (under the CPU interpreter) equals phase 3.5's fp32 reference.

Every launch setting the tuner tries is a different kernel: tiles of 1, 2 and 4
blocks, several splits (more splits than a sequence has blocks included), GQA
groups that are and are not powers of two, windows and softcaps, and padding rows
of length 0 (a CUDA-graph bucket's spare rows) that must come out as zeros. Then the split rule, and the
sweep's choice of a launch config.
"""

import pytest
import torch

from measure.paged_inputs import random_paged_batch
from phases.p3_5_paged_attention.reference import paged_decode_attention_reference
from extras.p3_9_tuned_decode_kernel.launch_configs import DEFAULT_CONFIG, LaunchConfig, launch_config
from phases.p3_9_tuned_decode_kernel.decode_kernel import tiled_decode_attention
from phases.p3_9_tuned_decode_kernel.split_rule import MAX_SPLITS, choose_splits
from measure.decode_tuning import best_config
from tests.test_p3_5_kernels import HEAD_DIM, LAYER, N_KV_HEADS, close


def case(block_size, group, lens, dtype=torch.float32, seed=0):
    batch = random_paged_batch(lens, block_size, N_KV_HEADS, HEAD_DIM, dtype=dtype, seed=seed)
    q = torch.randn(len(lens), N_KV_HEADS * group, HEAD_DIM, generator=torch.Generator().manual_seed(seed + 1))
    return q.to(dtype), batch


@pytest.mark.parametrize("tile_blocks", [1, 2, 4])
@pytest.mark.parametrize("n_splits", [1, 3])
@pytest.mark.parametrize("group", [1, 3])
def test_tiled_kernel_equals_reference(tile_blocks, n_splits, group):
    block_size = 8
    q, b = case(block_size, group, [1, 7, 17, 40], seed=tile_blocks + 10 * n_splits + group)
    ref = paged_decode_attention_reference(q, b.kv_store, LAYER, b.block_tables, b.seq_lens, HEAD_DIM ** -0.5)
    out = tiled_decode_attention(q, b.kv_store, LAYER, b.block_tables, b.seq_lens, n_splits=n_splits,
                                 config=LaunchConfig(tile_blocks=tile_blocks))
    assert out.shape == q.shape and out.dtype == q.dtype
    close(out, ref, torch.float32)


@pytest.mark.parametrize("window,softcap", [(5, None), (None, 2.0), (9, 3.0)])
def test_window_and_softcap(window, softcap):
    q, b = case(16, 2, [3, 20, 37], seed=3)
    ref = paged_decode_attention_reference(q, b.kv_store, LAYER, b.block_tables, b.seq_lens, 0.3,
                                           sliding_window=window, softcap=softcap)
    for n_splits in (1, 2):
        out = tiled_decode_attention(q, b.kv_store, LAYER, b.block_tables, b.seq_lens, 0.3, n_splits=n_splits,
                                     sliding_window=window, softcap=softcap)
        close(out, ref, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_pools(dtype):
    q, b = case(16, 2, [5, 33], dtype=dtype, seed=5)
    ref = paged_decode_attention_reference(q.float(), b.kv_store.float(), LAYER, b.block_tables, b.seq_lens)
    close(tiled_decode_attention(q, b.kv_store, LAYER, b.block_tables, b.seq_lens, n_splits=2), ref, dtype)


def test_padding_rows_of_length_zero_read_nothing_and_give_zeros():
    q, b = case(8, 2, [9, 30, 1], seed=7)
    lens = b.seq_lens.clone()
    lens[1] = 0                                    # a bucket's spare row: its table is stale, its length 0
    for n_splits in (1, 4):
        out = tiled_decode_attention(q, b.kv_store, LAYER, b.block_tables, lens, n_splits=n_splits)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        ref = paged_decode_attention_reference(q[[0, 2]], b.kv_store, LAYER, b.block_tables[[0, 2]], lens[[0, 2]])
        close(out[[0, 2]], ref, torch.float32)


def test_bad_split_count_is_refused():
    q, b = case(8, 1, [4], seed=1)
    with pytest.raises(ValueError, match="n_splits"):
        tiled_decode_attention(q, b.kv_store, LAYER, b.block_tables, b.seq_lens, n_splits=0)


def test_launch_config_keeps_the_measured_default_where_it_compiles_without_spilling():
    """DEFAULT_CONFIG for 16-bit pools up to head_dim 128; more warps on the same tile for fp32 and head_dim 256
    (measure/decode_aot_check.py: where the default spills), and the most warps past the table."""
    for head_dim in (16, 64, 128):
        assert launch_config(head_dim, torch.bfloat16) == launch_config(head_dim, torch.float16) == DEFAULT_CONFIG
    wider = [launch_config(128, torch.float32), launch_config(256, torch.bfloat16), launch_config(256, torch.float32)]
    assert all(c.tile_blocks == DEFAULT_CONFIG.tile_blocks and c.num_warps > DEFAULT_CONFIG.num_warps for c in wider)
    assert launch_config(512, torch.float32) == launch_config(256, torch.float32)


def test_a_head_dim_below_the_smallest_dot_is_refused_before_launch():
    b = random_paged_batch([3, 5], 4, N_KV_HEADS, 8, seed=0)
    q = torch.randn(2, 2 * N_KV_HEADS, 8)
    with pytest.raises(ValueError, match="head_dim 8 is below 16"):
        tiled_decode_attention(q, b.kv_store, LAYER, b.block_tables, b.seq_lens)


def test_split_rule():
    sms = 132
    assert choose_splits(256, 8, sms, 128) == 1            # 2048 programs fill the GPU
    assert choose_splits(1, 8, sms, 1) == 1                # one block: nothing to split
    one = choose_splits(1, 8, sms, 4096)
    assert one == MAX_SPLITS and one & (one - 1) == 0       # a power of two, capped
    assert choose_splits(4, 8, sms, 256) == 2              # capped by the context: 256 blocks / 128 per split
    assert choose_splits(16, 8, sms, 4096) == 1            # 128 programs: about one per SM already
    assert choose_splits(4, 8, 0, 4096) == 1               # CPU


def test_best_config_totals_the_large_cells_and_says_none_without_any():
    row = lambda batch, warps, ms: dict(kernel="p3_9", batch=batch, context=512, tile_blocks=4,  # noqa: E731
                                        num_warps=warps, num_stages=3, splits=1, ms=ms)
    assert best_config([row(2, 2, 1.0), row(2, 4, 2.0)]) is None          # a quick run: no batch >= 32
    best = best_config([row(32, 2, 1.0), row(32, 4, 0.5), row(64, 2, 1.0), row(64, 4, 0.6), row(2, 2, 0.0)])
    assert best == dict(tile_blocks=4, num_warps=4, num_stages=3, total_ms=1.1)


def test_decode_bench_quick_runs_on_the_cpu():
    """The phase's demo: the kernel section's table, its kernels checked against the reference on the first cell."""
    from measure.cli import run_demo
    report = run_demo("decode_bench", "tiny", "cpu", "fp32", quick=True)
    assert report.tables and all(t.rows for t in report.tables)
