"""Phase 3.10 on the tier's device: decode steps replayed as CUDA graphs equal HF `generate`, and phase 3.9's tuned
decode kernel, compiled, equals its reference.

fp32, TF32 off (`no_tf32`). On CUDA every decode-only step of the engine is a graph replay
(one graph per bucket and split count, captured at first use); the runs below make the batch
grow and shrink through the buckets (sequences finish one by one, newcomers join), and the
later engines (copy-on-write samples, beams, prefix caching, preemption) run on the same path
by inheritance (tests/gpu/test_engines_gpu.py). Off CUDA (ENGINE_TEST_DEVICE=cpu) the same
tests check the eager static step.
"""

from __future__ import annotations

import pytest
import torch

from measure.paged_inputs import random_paged_batch
from phases.p3_5_paged_attention.reference import paged_decode_attention_reference
from phases.p3_9_tuned_decode_kernel.decode_kernel import LaunchConfig, launch_config, tiled_decode_attention
from phases.p3_10_cuda_graphs.engine import StaleGraphs, StaticDecodeEngine
from extras.p3_10_cuda_graphs.overlap import OverlappedDecodeEngine
from tests.gpu.conftest import tier_runs_on_cuda
from tests.gpu.test_engine_p3_8_gpu import TOL, random_prompts
from tests.oracles import hf_greedy, run_ignoring_eos

pytestmark = pytest.mark.gpu

ON_CUDA = tier_runs_on_cuda()
PROMPT_LENGTHS = (1, 6, 11, 19, 4, 30)
NEW_TOKENS = (6, 2, 9, 4, 7, 3)     # finish one by one: the batch crosses bucket boundaries downwards


@pytest.mark.parametrize("engine_cls", [StaticDecodeEngine, OverlappedDecodeEngine])
@pytest.mark.parametrize("buckets,budget", [(None, 4096), (None, 7), ([8], 7)])
def test_graph_decode_equals_hf_generate(tier_lm, no_tf32, buckets, budget, engine_cls):
    """Budget 4096: four prompts in one pass, then decode-only steps as they finish (buckets 4, 2, 1);
    budget 7: chunks beside decodes (mixed passes), decode-only steps between; [8]: every step padded.
    OverlappedDecodeEngine: the same, with step N+1 launched before step N's ids are read (pinned copy, event)."""
    engine = engine_cls(tier_lm, max_running=4, block_size=4, n_blocks=256, buckets=buckets,
                        max_num_batched_tokens=budget)
    prompts = random_prompts(PROMPT_LENGTHS, seed=11)
    outputs = run_ignoring_eos(engine, prompts, NEW_TOKENS)
    for p, n, out in zip(prompts, NEW_TOKENS, outputs):
        assert out == hf_greedy(tier_lm, p, n, ignore_eos=True)
    assert engine.runner.n_static_steps > 0
    if engine_cls is OverlappedDecodeEngine:
        assert engine.n_overlapped_steps > 0
    if ON_CUDA:
        assert engine.runner.cuda_graphs and engine.runner.graphs
        if budget == 4096 and buckets is None:
            assert len(engine.runner.graphs) >= 2      # the batch shrank through several buckets, each its own graph


@pytest.mark.skipif(not ON_CUDA, reason="CUDA graphs need a CUDA device")
def test_graphs_captured_up_front_and_a_changed_dtype_is_refused(tier_tiny, no_tf32):
    from common.model import load_model
    lm = load_model("tiny", device="cuda", dtype=torch.float32)
    engine = StaticDecodeEngine(lm, max_running=4, block_size=4, n_blocks=64)
    from phases.p3_10_cuda_graphs.demo import capture_all
    assert capture_all(engine.runner) == len(engine.runner.buckets)
    prompt = random_prompts((7,), seed=12)[0]
    seq = engine.add(prompt, 5, ignore_eos=True)
    engine.run()
    assert seq.output_ids == hf_greedy(lm, prompt, 5, ignore_eos=True)
    engine.add(prompt, 5, ignore_eos=True)
    engine.step()
    lm.model.to(torch.float16)
    with pytest.raises(StaleGraphs):
        engine.step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_splits", [1, 4])
@pytest.mark.parametrize("tile_blocks", [1, 4])
def test_tuned_kernel_compiled_equals_reference(gpu_device, dtype, n_splits, tile_blocks):
    lens = [1, 15, 16, 17, 250, 0]
    b = random_paged_batch(lens, 16, 8, 128, dtype=dtype, device=gpu_device, seed=n_splits)
    q = torch.randn(len(lens), 16, 128, generator=torch.Generator().manual_seed(1)).to(gpu_device, dtype)
    ref = paged_decode_attention_reference(q.float(), b.kv_store.float(), 1, b.block_tables, b.seq_lens)
    out = tiled_decode_attention(q, b.kv_store, 1, b.block_tables, b.seq_lens, n_splits=n_splits,
                                 config=LaunchConfig(tile_blocks, launch_config(128, dtype).num_warps),
                                 sliding_window=None)   # its warps: 2 in fp32 spill ~15 KB per thread (aot_check)
    torch.testing.assert_close(out.float(), ref, **TOL[dtype])
    windowed = tiled_decode_attention(q, b.kv_store, 1, b.block_tables, b.seq_lens, n_splits=n_splits,
                                      sliding_window=40, softcap=30.0)
    ref_w = paged_decode_attention_reference(q.float(), b.kv_store.float(), 1, b.block_tables, b.seq_lens,
                                             sliding_window=40, softcap=30.0)
    torch.testing.assert_close(windowed.float(), ref_w, **TOL[dtype])
