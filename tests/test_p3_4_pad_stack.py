"""The blog's road not taken (extras/p3_4_gather_kernel/pad_stack.py): one pass over a padded stack of every sequence's
gathered K/V gives HF's tokens, and `stack_bench` times it against phase 3.3's N passes."""

import torch

from common.model import load_model
from phases.p3_3_paged_cache.scheduler import PagedScheduler
from extras.p3_4_gather_kernel.pad_stack import PadStackScheduler
from tests.oracles import hf_greedy
from tests.test_p3_8_engine import random_prompts


def test_pad_and_stack_equals_hf_and_phase_3_3():
    lm = load_model("tiny", dtype=torch.float32)
    prompts = random_prompts((3, 9, 14, 22, 30), seed=8)      # different lengths: the stack is padded
    outputs = {}
    for cls in (PagedScheduler, PadStackScheduler):
        engine = cls(lm, max_running=3, block_size=4, n_blocks=128)
        seqs = [engine.add(p, 9, ignore_eos=True) for p in prompts]
        engine.run()
        assert engine.allocator.n_free == engine.allocator.n_blocks, "blocks leaked"
        outputs[cls] = [s.output_ids for s in seqs]
    assert outputs[PadStackScheduler] == outputs[PagedScheduler]
    for p, out in zip(prompts, outputs[PadStackScheduler]):
        assert out == hf_greedy(lm, p, 9, ignore_eos=True)


def test_stack_bench_quick():
    from measure.cli import run_demo
    report = run_demo("stack_bench", model="tiny", device="cpu", dtype="fp32", quick=True)
    (row,) = report.data["rows"]
    assert row["n_calls_ms"] > 0 and row["pad_stack_ms"] > 0 and row["padding_per_token"] >= 0
