"""Phase 3.10's static decode step, eager on CPU: buckets and padding never change a token, the buffers
send only what changed, sampling on the device keeps its promises, and what must be refused is.

Oracles: HF `generate` (greedy, fp32) token for token, and phase 3.8's engine (same scheduler, the
decode pass built from Python lists each step) on the models with windows and softcaps. Runs where
sequences finish and join mid-stream cross bucket boundaries in both directions. The same step
replayed as CUDA graphs is checked in the gpu tier (tests/gpu/test_engine_p3_10_gpu.py).
"""

import traceback

import pytest
import torch

from common.model import load_model
from common.sampling import SamplingParams, filter_logits, filter_rows, sample_rows, sampling_rows, uniform_noise
from phases.p2_2_scheduler.sequence import Status
from phases.p3_4_gather_kernel.dispatch import FORCE_KERNELS_ENV
from phases.p3_8_chunked_prefill.engine import ChunkedPrefillEngine
from phases.p3_10_cuda_graphs.buffers import EMPTY_SLOT
from phases.p3_10_cuda_graphs.engine import StaleGraphs, StaticDecodeEngine, decode_buckets
from tests.oracles import hf_greedy
from tests.test_p3_8_engine import random_prompts

BLOCK_SIZE = 4
PROMPT_LENGTHS = (1, 3, 9, 14, 22, 30, 5)
# Different lengths, so sequences finish one by one and the batch shrinks through the buckets;
# max_running below the number of prompts, so newcomers join while others decode.
NEW_TOKENS = (9, 3, 12, 6, 1, 10, 7)


class SlotChecked(StaticDecodeEngine):
    """Checks, every static step, that the slots computed on the device are the ones the host claimed
    and that padding rows store nothing."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        static_forward = self.runner.static_forward

        def checked(batch):
            logits = static_forward(batch)
            self.check_slots(batch)
            return logits
        self.runner.static_forward = checked

    def check_slots(self, batch):
        rows = self.runner.buffers.rows
        host = [s.kv.block_ids[(s.kv.n_filled - 1) // self.block_size] * self.block_size
                + (s.kv.n_filled - 1) % self.block_size for s in (r.seq for r in rows)]
        device = self.runner.buffers.slot_mapping[:batch.block_tables.shape[0]].tolist()
        assert device[:len(rows)] == host
        assert all(slot == EMPTY_SLOT for slot in device[len(rows):])


def run(lm, prompts, new_tokens=NEW_TOKENS, engine_cls=SlotChecked, sampling=None, **kwargs):
    kwargs = dict(dict(max_running=4, block_size=BLOCK_SIZE, n_blocks=128), **kwargs)
    engine = engine_cls(lm, **kwargs)
    seqs = [engine.add(p, n, sampling or SamplingParams(), ignore_eos=True) for p, n in zip(prompts, new_tokens)]
    engine.run()
    assert engine.allocator.n_free == engine.allocator.n_blocks, "blocks leaked"
    return engine, [s.output_ids for s in seqs]


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", dtype=torch.float32)


@pytest.mark.parametrize("buckets,budget", [(None, 4096), ([8], 4096), ([1, 3, 4], 5), ([2, 16], 7)])
def test_greedy_equals_hf_whatever_the_buckets(tiny, buckets, budget):
    prompts = random_prompts(PROMPT_LENGTHS, seed=1)
    engine, outputs = run(tiny, prompts, buckets=buckets, max_num_batched_tokens=budget)
    for p, n, out in zip(prompts, NEW_TOKENS, outputs):
        assert out == hf_greedy(tiny, p, n, ignore_eos=True)
    assert engine.runner.n_static_steps > 0
    if buckets == [8]:
        assert engine.runner.n_padded_rows > 0      # every step ran padding rows, and no token changed


@pytest.mark.parametrize("model", ["tiny-sliding", "tiny-softcap"])
def test_windows_and_softcaps_equal_phase_3_8(model):
    lm = load_model(model, dtype=torch.float32)
    prompts = random_prompts((3, 17, 26), seed=2)
    new = (12, 12, 12)
    _, static = run(lm, prompts, new, buckets=[4], max_num_batched_tokens=5)
    _, eager = run(lm, prompts, new, engine_cls=ChunkedPrefillEngine, max_num_batched_tokens=5)
    assert static == eager
    for p, n, out in zip(prompts, new, static):
        assert out == hf_greedy(lm, p, n, ignore_eos=True)


def test_seeded_samples_do_not_depend_on_the_batch_or_its_padding(tiny):
    """A sequence's draws are a function of its seed and position: the same whatever it shares a step with."""
    prompts = random_prompts(PROMPT_LENGTHS, seed=3)
    sampling = SamplingParams(temperature=0.9, top_k=50, top_p=0.9, seed=1234)
    _, a = run(tiny, prompts, sampling=sampling, max_running=4)
    _, b = run(tiny, prompts, sampling=sampling, max_running=2, buckets=[2])
    _, c = run(tiny, prompts, sampling=sampling, max_running=4, buckets=[16], max_num_batched_tokens=5)
    alone = [run(tiny, [p], (n,), sampling=sampling, max_running=1)[1][0] for p, n in zip(prompts, NEW_TOKENS)]
    assert a == b == c == alone
    greedy = run(tiny, prompts, max_running=4)[1]
    assert a != greedy                          # it did sample


def test_steady_decoding_sends_only_new_table_entries(tiny):
    engine = StaticDecodeEngine(tiny, max_running=3, block_size=BLOCK_SIZE, n_blocks=64)
    for p in random_prompts((5, 6, 7), seed=4):
        engine.add(p, 20, ignore_eos=True)
    engine.step()                                 # the prefill pass
    engine.step()                                 # first decode step: every row is new
    assert engine.runner.n_static_steps == 1
    sent, syncs = engine.runner.buffers.n_values_sent, engine.runner.buffers.n_syncs
    rows = engine.runner.buffers.rows
    for _ in range(BLOCK_SIZE * 2):
        engine.step()
    steps = engine.runner.buffers.n_syncs - syncs
    assert engine.runner.buffers.rows is rows, "the same sequences every step: no row was placed again"
    assert engine.runner.buffers.longest_blocks == max(s.kv.n_blocks for s in engine.running)
    # No row's token, position or length was sent again (they advance on the device); only each sequence's
    # new blocks (one entry = 3 values, two per sequence over 2 * block_size steps).
    assert engine.runner.buffers.n_values_sent - sent == 3 * 3 * 2
    assert steps == BLOCK_SIZE * 2


def test_sampled_ids_go_back_to_their_sequences_rows_in_any_order(tiny):
    """The hand-off addresses rows by sequence: ids handed back for some of the rows, in another order (as an
    engine that samples a subset of the step's rows would), land in those rows and in their mirrors only."""
    engine = StaticDecodeEngine(tiny, max_running=3, block_size=BLOCK_SIZE, n_blocks=64)
    seqs = [engine.add(p, 8, ignore_eos=True) for p in random_prompts((5, 6, 7), seed=8)]
    engine.step()
    engine.step()                                     # a static step: row i holds seqs[i]
    buffers = engine.runner.buffers
    assert [r.seq for r in buffers.rows] == seqs
    before = buffers.input_ids[:3].tolist()
    buffers.record_sampled([seqs[2], seqs[0]], torch.tensor([11, 22]), [11, 22])
    assert buffers.input_ids[:3].tolist() == [22, before[1], 11]
    assert [r.token for r in buffers.rows] == [22, seqs[1].output_ids[-1], 11]


def test_rows_left_behind_are_inert_padding(tiny):
    """A row a sequence left (finished) keeps no length and no position: as a bucket's padding it reads and
    writes nothing, and its slot lookup stays inside the table whatever length the sequence had reached."""
    engine = StaticDecodeEngine(tiny, max_running=3, block_size=BLOCK_SIZE, n_blocks=64, buckets=[4])
    prompts = random_prompts((5, 6, 7), seed=9)
    seqs = [engine.add(p, n, ignore_eos=True) for p, n in zip(prompts, (12, 3, 9))]
    while seqs[1].status is not Status.DONE:
        engine.step()
    engine.step()                                    # the first static step without it: 2 rows of 3 live
    assert engine.runner.buffers.n_rows == 2
    assert [r.seq for r in engine.runner.buffers.rows] == [seqs[0], seqs[2]]    # the batch's order: one moved up
    assert engine.runner.buffers.seq_lens[2:].tolist() == [0, 0] and engine.runner.buffers.positions[2:].tolist() == [0, 0]
    engine.run()
    for p, n, s in zip(prompts, (12, 3, 9), seqs):
        assert s.output_ids == hf_greedy(tiny, p, n, ignore_eos=True)


def test_decode_buckets_and_their_refusals(tiny):
    assert decode_buckets(6) == [1, 2, 4, 6]
    assert decode_buckets(1) == [1]
    assert decode_buckets(8, [8, 2, 2]) == [2, 8]
    with pytest.raises(ValueError, match="over the largest decode bucket"):
        StaticDecodeEngine(tiny, max_running=8, buckets=[1, 2, 4])
    with pytest.raises(ValueError, match="ints >= 1"):
        decode_buckets(4, [0, 4])
    with pytest.raises(ValueError, match="CUDA"):
        StaticDecodeEngine(tiny, max_running=2, cuda_graphs=True)


def test_a_model_changed_after_the_first_static_step_is_refused_and_loses_nothing():
    lm = load_model("tiny", dtype=torch.float32)
    engine = StaticDecodeEngine(lm, max_running=2, block_size=BLOCK_SIZE, n_blocks=64)
    seq = engine.add(random_prompts((6,), seed=5)[0], 8, ignore_eos=True)
    engine.step()
    engine.step()
    assert engine.runner.n_static_steps == 1
    made = list(seq.output_ids)
    lm.model.to(torch.float64)
    with pytest.raises(StaleGraphs, match="build a new engine"):
        engine.step()
    assert seq.output_ids == made                 # nothing was emitted from a stale replay


def test_device_filters_equal_common_sampling():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 200, generator=gen)
    top_k = torch.tensor([5, 200, 17, 200])
    top_p = torch.tensor([1.0, 0.7, 0.5, 1.0])
    ours = filter_rows(logits, top_k, top_p)
    for i in range(4):
        k = int(top_k[i]) if int(top_k[i]) < 200 else 0
        assert torch.equal(ours[i:i + 1], filter_logits(logits[i:i + 1], k, float(top_p[i])))


def test_device_draws_follow_the_distribution_and_the_seed():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[None].repeat(4000, 1)
    params = [SamplingParams(temperature=1.0)] * 4000
    rows = sampling_rows(params, seeds=[7] * 4000, counters=list(range(4000)), vocab=4, device="cpu")
    ids = sample_rows(logits, rows)
    freq = torch.bincount(ids, minlength=4).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)
    again = sample_rows(logits, rows)
    assert torch.equal(ids, again)                                         # a function of (seed, counter, token)
    u = uniform_noise(torch.tensor([1, 2]), torch.tensor([0, 0]), 1000)
    assert 0 < float(u.min()) and float(u.max()) < 1 and not torch.equal(u[0], u[1])


def test_the_engine_with_the_tuned_kernel_under_the_interpreter(tiny, monkeypatch):
    """The CPU runs above use phase 3.5's CPU attention; here the step runs phase 3.9's Triton kernel."""
    monkeypatch.setenv(FORCE_KERNELS_ENV, "1")
    prompts = random_prompts((3, 9), seed=6)
    _, outputs = run(tiny, prompts, (4, 4), engine_cls=StaticDecodeEngine, buckets=[4])
    for p, out in zip(prompts, outputs):
        assert out == hf_greedy(tiny, p, 4, ignore_eos=True)


HOST_READS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")
CPU_ONLY_CHECKS = "kernel_checks.py"    # the kernels' slot range checks read values only when the pool is on a CPU
CALLER_FRAMES = 8          # how far up from a read to look for those checks (they read one or two frames up)
STEPS_WATCHED = 6


def host_read(name: str, reads: list[str]):
    """A torch.Tensor method that appends `name` to `reads` on each call, except from the CPU-only checks."""
    original = getattr(torch.Tensor, name)

    def counted(self, *args, **kwargs):
        if not any(frame.filename.endswith(CPU_ONLY_CHECKS) for frame in traceback.extract_stack(limit=CALLER_FRAMES)):
            reads.append(name)
        return original(self, *args, **kwargs)
    return counted


SAMPLINGS = [SamplingParams(), SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=1)]


def static_step_reads(engine_cls, lm, sampling, monkeypatch) -> tuple[int, list[str]]:
    """The static steps an engine of `engine_cls` ran after its first, and the host reads they made, with the
    Triton kernel path on. (The kernels' slot range checks read the slots on a CPU only, so they are not counted.)"""
    monkeypatch.setenv(FORCE_KERNELS_ENV, "1")
    engine = engine_cls(lm, max_running=4, block_size=BLOCK_SIZE, n_blocks=64, buckets=[4])
    for n in (5, 6, 7):
        engine.add(list(range(100, 100 + n)), 12, sampling, ignore_eos=True)
    engine.step()                   # prefill
    engine.step()                   # the first static step sends whole rows
    reads = []
    for name in HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, host_read(name, reads))
    steps_before = engine.runner.n_static_steps
    for _ in range(STEPS_WATCHED):
        engine.step()
    steps = engine.runner.n_static_steps - steps_before
    monkeypatch.undo()
    return steps, reads


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "filtered-sample"])
def test_a_static_step_reads_the_device_once(tiny, sampling, monkeypatch):
    """The step's one host transfer is the sampled ids (`tolist`): no `.item()`, no tensor truthiness, no
    `.cpu()` anywhere else in a decode step, greedy or filtered sampling."""
    steps, reads = static_step_reads(StaticDecodeEngine, tiny, sampling, monkeypatch)
    assert steps == STEPS_WATCHED and reads == ["tolist"] * steps


# --- the demos ----------------------------------------------------------------------------------------
def test_graph_bench_and_graph_workload_quick():
    from measure.cli import run_demo
    bench = run_demo("graph_bench", model="tiny", device="cpu", dtype="fp32", quick=True)
    engines = {r["engine"] for r in bench.data["step"]}
    assert engines == {"p3_8 (decode pass from lists)", "p3_10 static, eager"}        # no graph on a CPU
    assert all(r["ms"] > 0 for r in bench.data["step"])
    host = bench.data["host"]                       # the same engines with the model stubbed out
    assert {r["engine"] for r in host} == {"p3_8 (decode pass from lists)", "p3_10 static, eager",
                                           "p3_10 static, overlapped"}
    assert {r["batch"] for r in host} == {1, 3} and all(r["host_ms"] > 0 for r in host)
    work = run_demo("graph_workload", model="tiny", device="cpu", dtype="fp32", quick=True,
                    options={"engines": ["chunked", "graphs"]})
    notes = " ".join(n for t in work.tables for n in t.notes)
    assert "graphs: 4/4 outputs identical to chunked's" in notes


def test_the_host_sections_stub_returns_what_each_decode_pass_returns_and_leaves_prefill_alone(tiny):
    # The stub must give each engine's decode pass the logits shape its caller slices, or the host section
    # would time an error path; prefill passes still run the model (their K/V and first tokens are real).
    from phases.p3_10_cuda_graphs.demo import stub_decode_forward
    for engine in (ChunkedPrefillEngine(tiny, max_running=3, n_blocks=32),
                   StaticDecodeEngine(tiny, max_running=3, n_blocks=32, buckets=[4])):
        stub_decode_forward(engine)
        seqs = [engine.add(list(range(100, 100 + n)), 4, ignore_eos=True) for n in (3, 5, 7)]
        engine.run()
        for s in seqs:
            assert s.output_ids[0] == hf_greedy(tiny, s.prompt_ids, 1, ignore_eos=True)[0]   # from the prefill
            assert s.output_ids[1:] == [0, 0, 0]                                           # from the stub
        assert engine.allocator.n_free == engine.allocator.n_blocks
