"""Tensor parallelism: phase 4.5's engine on 2 workers (gloo, on this CPU) makes the same tokens, the same schedule
step by step, and the same seeded draws as on one; a pass message decodes to its batch; a killed worker fails
the engine with a clear error, and leaves no process behind."""

import multiprocessing
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from common.model import load_model
from common.sampling import SamplingParams
from measure.collectives import count_messages
from measure.harness import drive, outputs_of
from measure.workload import TracedRequest, burst
from phases.p3_1_block_allocator.allocator import blocks_for
from phases.p3_6_batched_engine.attention import PagedBatch, Segment
from phases.p3_8_chunked_prefill.attention import MixedBatch
from phases.p3_10_cuda_graphs.attention import StaticDecodeBatch
from phases.p4_5_speculative_decoding.acceptance import Proposal
from phases.p4_7_tensor_parallel import TensorParallelEngine, WorkerDied, launch
from phases.p4_7_tensor_parallel.message import HEADER_LEN, SWAP_OUT, decode_pass, encode_pass, payload_len
from tests.oracles import hf_greedy, run_ignoring_eos

PACKAGED_PROMPTS = ["What is the capital of France?", "Name three colours.", "Count from one to five."]
PACKAGED_NEW_TOKENS = 16



def served(lm, group=None, **kwargs) -> TensorParallelEngine:
    """Phase 4.6's engine (chunked prefill, prefix caching, preemption, speculation when asked) on `lm`; over the
    group's workers when one is given, phase 4.5's engine on one device otherwise."""
    return TensorParallelEngine(lm, group, cuda_graphs=False, **kwargs)


def trace_with_everything(vocab: int) -> list[TracedRequest]:
    """Requests that share a long prefix (prefix hits), arrive at different steps, and ask for seeded samples."""
    prefix = list(range(100, 124))
    shared = [TracedRequest(prefix + list(range(300 + 5 * i, 304 + 5 * i)), 9, arrival_step=2 * i) for i in range(4)]
    samples = [TracedRequest(list(range(500 + 9 * i, 511 + 9 * i)), 8, arrival_step=1, kind="samples", n=2, seed=i)
               for i in range(2)]
    return shared + samples + burst(vocab, 4, (5, 30), (4, 12), seed=11)


def run_recorded(engine, trace) -> tuple[list, list]:
    """(each request's outputs, the schedule: after every step, each sequence's state and KV length)."""
    steps = []

    def record(_):
        steps.append(sorted((s.seq_id, s.status.name, len(s.output_ids), s.kv.n_filled if s.kv else -1)
                            for s in engine.sequences))
    groups = drive(engine, trace, on_step=record)
    assert engine.allocator.n_free == engine.allocator.n_blocks, "blocks leaked"
    return outputs_of(groups), steps


class Echo:
    """Guesses that the sequence's last k tokens come again: always k guesses, so every decode step verifies."""
    name = "echo"

    def propose(self, seqs, k, seeds):
        return [Proposal(s.all_ids[-k:]) for s in seqs]

    def release(self, seq):
        pass


# --- no worker started ------------------------------------------------------------------------------
def test_a_pass_message_decodes_to_the_batch_it_encoded():
    store = torch.zeros(8, 2, 2, 1, 4, 16)
    tables = torch.tensor([[3, 1, 0], [2, 5, 6]], dtype=torch.int32)
    lens = torch.tensor([5, 11], dtype=torch.int32)
    mixed = MixedBatch(kv_store=store, slot_mapping=torch.arange(7), block_tables=tables, seq_lens=lens,
                       is_decode=False, segments=[Segment(1, 6, 5, 1)], n_decode=1,
                       cu_seqlens_q=torch.tensor([0, 6], dtype=torch.int32),
                       context_lens=torch.tensor([5], dtype=torch.int32))
    static = StaticDecodeBatch(kv_store=store, slot_mapping=torch.tensor([4, 9]), block_tables=tables, seq_lens=lens,
                               is_decode=True, n_splits=3)
    decode = PagedBatch(kv_store=store, slot_mapping=torch.tensor([4, 9]), block_tables=tables, seq_lens=lens,
                        is_decode=True)
    cases = [(mixed, torch.arange(7)[None], torch.tensor([0, 6]), "engine_varlen_pool"),
             (static, torch.tensor([[7], [8]]), 1, "engine_static_decode"),
             (decode, torch.tensor([[7], [8]]), 1, "engine_paged_pool")]
    for batch, ids, keep, attention in cases:
        head, payload = encode_pass(ids, ids + 100, batch, keep, attention)
        assert head.shape == (HEADER_LEN,) and payload.numel() == payload_len(head.tolist())
        other_pool = torch.ones(8, 2, 2, 1, 4, 16)
        got = decode_pass(head.tolist(), payload, other_pool)
        assert type(got.batch) is type(batch) and got.attention == attention
        assert got.batch.kv_store is other_pool                      # the worker's own pool, not the driver's
        assert torch.equal(got.input_ids, ids) and torch.equal(got.position_ids, ids + 100)
        for name in ("slot_mapping", "block_tables", "seq_lens"):
            assert torch.equal(getattr(got.batch, name), getattr(batch, name).to(getattr(got.batch, name).dtype))
        assert got.batch.segments == batch.segments and got.batch.is_decode == batch.is_decode
        assert torch.equal(torch.as_tensor(got.logits_to_keep), torch.as_tensor(keep))
        if batch is mixed:                                            # the packed row's layout, rebuilt
            assert got.batch.n_decode == 1 and torch.equal(got.batch.cu_seqlens_q, mixed.cu_seqlens_q)
            assert torch.equal(got.batch.context_lens, mixed.context_lens)


# --- two workers on tiny (GQA 4:2, one KV head each) ---------------------------------------------------
class TestTinyOnTwoWorkers:
    @pytest.fixture(scope="class")
    def tp(self):
        group, lm = launch("tiny", 2, device="cpu", dtype="fp32")
        yield group, lm
        group.close()

    def test_each_worker_holds_half_the_heads_and_half_the_pool(self, tp, tiny32):
        group, lm = tp
        engine = served(lm, group, n_blocks=32)
        assert (lm.n_heads, lm.n_kv_heads) == (2, 1) and group.info.kv_heads == (0, 1)
        whole = served(tiny32, n_blocks=32)
        assert engine.allocator.kv_store.numel() * 2 == whole.allocator.kv_store.numel()
        assert group.alive() == [True, True]

    @pytest.mark.parametrize("mode", ["recompute", "swap"])
    def test_same_tokens_and_schedule_as_one_worker_under_chunks_hits_and_preemption(
            self, tp, tiny32, mode):
        group, lm = tp
        trace = trace_with_everything(tiny32.vocab_size)
        # a pool that runs dry (preemption), a budget that cuts prompts (chunked prefill), caching on (hits)
        kwargs = dict(preemption_mode=mode, block_size=4, n_blocks=26, max_num_batched_tokens=16)
        one, one_steps = run_recorded(served(tiny32, **kwargs), trace)
        messages = count_messages(group)
        engine = served(lm, group, **kwargs)
        two, two_steps = run_recorded(engine, trace)
        assert two == one and two_steps == one_steps
        assert engine.stats.n_preemptions >= 1 and engine.cache_stats.blocks_hit >= 1
        assert engine.n_copied >= 1                              # the samples' copy-on-write reached the workers
        assert messages.n.get(SWAP_OUT, 0) == (engine.swap_space.out.n_swaps if mode == "swap" else 0)
        for out, r in zip(two, trace):
            if r.kind == "plain":
                assert out[0] == hf_greedy(tiny32, r.prompt_ids, r.max_new_tokens, ignore_eos=True)

    def test_phase_3_6s_batched_engine_runs_on_two_workers_and_equals_hf(self, tp, tiny32):
        from phases.p3_6_batched_engine.engine import BatchedPagedEngine

        group, lm = tp
        prompts = [list(range(20 + 5 * i, 31 + 7 * i)) for i in range(4)]
        engine = BatchedPagedEngine(lm, n_blocks=32, block_size=4, max_running=3)
        group.setup(engine.allocator.n_blocks, engine.block_size, 0)   # the workers' pools, as 4.6's engine would
        assert run_ignoring_eos(engine, prompts, 9) == [hf_greedy(tiny32, p, 9, ignore_eos=True) for p in prompts]

    def test_seeded_samples_equal_one_worker(self, tp, tiny32):
        group, lm = tp
        sampling = SamplingParams(temperature=1.0, top_p=0.9, seed=7)
        prompts = [list(range(40 + 3 * i, 52 + 3 * i)) for i in range(3)]

        def draw(engine):
            groups = [engine.add_group(p, 10, sampling, ignore_eos=True, n=3) for p in prompts]
            engine.run()
            return [g.outputs for g in groups]
        assert draw(served(lm, group, n_blocks=64)) == draw(served(tiny32, n_blocks=64))

    @pytest.mark.parametrize("speculative", ["ngram", "echo"])
    def test_speculation_equals_one_worker(self, tp, tiny32, speculative):
        group, lm = tp
        prompts = [[5, 6, 7, 8] * 4, list(range(60, 75)) * 2]
        proposer = (lambda: Echo()) if speculative == "echo" else (lambda: "ngram")
        one = served(tiny32, speculative=proposer(), n_blocks=64)
        two = served(lm, group, speculative=proposer(), n_blocks=64)
        for engine in (one, two):
            for p in prompts:
                engine.add(p, 12, ignore_eos=True)
            engine.run()
        assert [s.output_ids for s in two.sequences] == [s.output_ids for s in one.sequences]
        assert (two.spec_stats.proposed, two.spec_stats.accepted) == (one.spec_stats.proposed, one.spec_stats.accepted)
        assert one.spec_stats.proposed > 0 or speculative == "ngram"

    def test_draft_speculation_and_cuda_graphs_are_refused(self, tp):
        group, lm = tp
        with pytest.raises(ValueError, match="draft"):
            TensorParallelEngine(lm, group, speculative="draft", n_blocks=16)
        with pytest.raises(ValueError, match="cuda_graphs"):
            TensorParallelEngine(lm, group, cuda_graphs=True, n_blocks=16)     # as a GPU engine would have it

    def test_an_engine_on_another_model_is_refused(self, tp, tiny32):
        group, _ = tp
        with pytest.raises(ValueError, match="launch"):
            TensorParallelEngine(tiny32, group, n_blocks=16)


# --- every test architecture: biases, untied embeddings, windows, softcaps, per-head norms ----------------
@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-softcap", "tiny-sliding", "tiny-qwen3"])
def test_every_test_architecture_makes_one_workers_tokens_on_two(name):
    one_lm = load_model(name, device="cpu", dtype=torch.float32)
    prompts = [list(range(40 + 9 * i, 52 + 9 * i + 3 * i)) for i in range(3)]   # longer than tiny's window
    expected = run_ignoring_eos(served(one_lm, n_blocks=32, block_size=4), prompts, 10)
    group, lm = launch(name, 2, device="cpu", dtype="fp32")
    try:
        assert run_ignoring_eos(served(lm, group, n_blocks=32, block_size=4), prompts, 10) == expected
    finally:
        group.close()


# --- two workers on the packaged model: 3 KV heads cut 2 + 1 --------------------------------------------
class TestPackagedOnTwoWorkers:
    def test_uneven_heads_and_fp32_tokens_equal_hf_generate_with_preemption(self, smol32):
        group, lm = launch("smollm2-135m", 2, device="cpu", dtype="fp32")
        try:
            assert (lm.n_heads, lm.n_kv_heads) == (6, 2)                  # rank 0: two KV-head groups of three
            ids = [smol32.prompt_ids(p) for p in PACKAGED_PROMPTS]
            n_blocks = sum(blocks_for(len(p), 8) for p in ids) + 2         # decoding runs dry: preemption
            engine = served(lm, group, block_size=8, n_blocks=n_blocks)
            seqs = [engine.add(p, PACKAGED_NEW_TOKENS) for p in ids]
            engine.run()
            assert engine.stats.n_preemptions >= 1
            for seq in seqs:
                assert seq.output_ids == hf_greedy(smol32, seq.prompt_ids, PACKAGED_NEW_TOKENS)
        finally:
            group.close()


# --- a worker dies -------------------------------------------------------------------------------------
def test_a_pass_that_fails_on_the_driver_ends_the_group():
    """After the pass is broadcast, the workers wait in collectives the driver will never join: an error in the
    driver's own forward cannot be retried, so it is WorkerDied (the served engine fails everything), not a
    request's failure, and no process is left behind."""
    group, lm = launch("tiny", 2, device="cpu", dtype="fp32")
    try:
        engine = served(lm, group, n_blocks=32)
        engine.add(list(range(10, 20)), 4, ignore_eos=True)

        def broken(*args, **kwargs):
            raise RuntimeError("the driver's shard failed mid-pass")
        lm.model.shard.forward = broken
        with pytest.raises(WorkerDied, match="out of step.*mid-pass"):
            engine.step()
        with pytest.raises(WorkerDied, match="out of step"):
            group.check()                     # the group stays broken: it runs nothing more
    finally:
        group.close()
    assert multiprocessing.active_children() == []


def test_a_killed_worker_fails_the_engine_clearly_and_leaves_no_process():
    group, lm = launch("tiny", 2, device="cpu", dtype="fp32")
    try:
        engine = served(lm, group, n_blocks=32)
        engine.add(list(range(10, 20)), 4, ignore_eos=True)
        engine.run()
        worker = group.processes[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(5)
        engine.add(list(range(30, 40)), 4, ignore_eos=True)
        start = time.monotonic()
        with pytest.raises(WorkerDied, match="rank 1"):
            for _ in range(10):
                engine.step()
        assert time.monotonic() - start < 30
        assert group.alive() == [True, False]
    finally:
        group.close()
    assert multiprocessing.active_children() == []
    assert not dist.is_initialized()


