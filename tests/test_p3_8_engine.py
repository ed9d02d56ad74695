"""Phase 3.8's engine: one mixed forward pass per step, chunked prefill under a token budget, varlen prefill attention.

Oracle: HF `generate` (greedy, fp32), token for token, on packed prompts, on prompts
prefilled in chunks that split blocks and split prompts mid-block while other
sequences decode in the same pass, on prompts that start with blocks another
sequence computed, and on models whose layers have a sliding window or a softcap.
Plus the scheduler's rules: one pass per step within the budget, no token before the
last chunk, admission that counts a partly prefilled sequence, no leaked block.
On CPU the attention runs the PyTorch paths (the Triton kernels' own tests are
tests/test_p3_7_prefill_kernel.py and tests/test_p3_5_kernels.py; one test here runs
the engine with the kernels under Triton's interpreter).
"""

import pytest
import torch

from common.model import TINY_WINDOW, load_model
from phases.p2_2_scheduler.sequence import Status
from phases.p3_4_gather_kernel.dispatch import FORCE_KERNELS_ENV
from phases.p3_6_batched_engine.kv import BlockKV
from phases.p3_8_chunked_prefill.engine import ChunkedPrefillEngine, WholePromptEngine
from tests.oracles import hf_greedy

BLOCK_SIZE = 4
# Budgets (tokens per pass) that cut prompts into chunks of 1-13 tokens: below, at and across the block
# size, so chunks end mid-block and the next chunk starts mid-block.
BUDGETS = [3, 5, 7, 13]
PROMPT_LENGTHS = (1, 3, 9, 14, 22, 30)
NEW_TOKENS = 9
MAX_RUNNING = 3           # fewer slots than prompts: prompts are admitted (and chunked) next to decoding ones


def random_prompts(lengths, seed=0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 40000, (n,), generator=gen).tolist() for n in lengths]


class Recording(ChunkedPrefillEngine):
    """Records every forward pass: (tokens in it, decode rows, prefill rows)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.passes: list[tuple[int, int, int]] = []
        forward = self.runner.forward

        def recorded(input_ids, position_ids, batch, logits_to_keep=1):
            n_decode = getattr(batch, "n_decode", input_ids.numel() if batch.is_decode else 0)
            self.passes.append((input_ids.numel(), n_decode, input_ids.numel() - n_decode))
            return forward(input_ids, position_ids, batch, logits_to_keep)
        self.runner.forward = recorded


class RecordingWhole(Recording, WholePromptEngine):
    """The same records, prompts never cut."""


def run_engine(lm, prompts, max_new_tokens=NEW_TOKENS, whole_prompts=False, **kwargs):
    kwargs = dict(dict(max_running=MAX_RUNNING, block_size=BLOCK_SIZE, n_blocks=128), **kwargs)
    engine = (RecordingWhole if whole_prompts else Recording)(lm, **kwargs)
    seqs = [engine.add(p, max_new_tokens, ignore_eos=True) for p in prompts]
    engine.run()
    assert engine.allocator.n_free == engine.allocator.n_blocks, "blocks leaked"
    engine.allocator.check_invariants()
    return engine, [s.output_ids for s in seqs]


def expected(lm, prompts, max_new_tokens=NEW_TOKENS):
    return [hf_greedy(lm, p, max_new_tokens, ignore_eos=True) for p in prompts]


# --- greedy tokens equal HF generate ---------------------------------------------------------------

@pytest.mark.parametrize("block_size", [BLOCK_SIZE, 16])
def test_packed_prompts_equal_hf_generate(tiny32, block_size):
    """The default budget packs every admitted prompt into one pass (phase 3.6's packing)."""
    prompts = random_prompts(PROMPT_LENGTHS, seed=1)
    engine, outputs = run_engine(tiny32, prompts, block_size=block_size)
    assert outputs == expected(tiny32, prompts)
    assert engine.n_chunks == len(prompts)                         # no prompt was cut


@pytest.mark.parametrize("budget", BUDGETS)
def test_chunked_prompts_with_decodes_alongside_equal_hf_generate(tiny32, budget):
    prompts = random_prompts(PROMPT_LENGTHS)
    engine, outputs = run_engine(tiny32, prompts, max_num_batched_tokens=budget)
    assert outputs == expected(tiny32, prompts)
    assert engine.n_chunks > len(prompts)                          # prompts were cut
    assert engine.n_mixed_passes > 0                               # and chunks shared passes with decode tokens
    assert engine.n_forward_passes == engine.n_steps == len(engine.passes)   # one pass per step
    assert max(n for n, _, _ in engine.passes) <= budget


@pytest.mark.parametrize("budget", [21, 4096])
def test_packaged_model_packed_and_chunked(smol32, budget):
    """SmolLM2 (30 layers, GQA 9:3, its chat template, EOS honoured), blocks of 16: whole prompts packed,
    and chunks of up to 21 tokens (chunks end mid-block, decode tokens share their passes)."""
    prompts = ["What is the capital of France?",
               "Explain in detail how the attention mechanism works in a transformer.",
               "Write a short story about a robot who learns to paint."]
    engine = ChunkedPrefillEngine(smol32, max_running=2, block_size=16, n_blocks=64, max_num_batched_tokens=budget)
    seqs = [engine.add(p, 12) for p in prompts]
    engine.run()
    assert (engine.n_chunks > len(prompts)) == (budget < max(len(s.prompt_ids) for s in seqs))
    for seq in seqs:
        assert seq.output_ids == hf_greedy(smol32, seq.prompt_ids, 12), seq.prompt
    assert engine.allocator.n_free == engine.allocator.n_blocks


def test_whole_prompts_without_chunking_equal_hf_generate(tiny32):
    """WholePromptEngine: a prompt is never cut, one longer than the budget runs alone, whole."""
    prompts = random_prompts(PROMPT_LENGTHS, seed=2)
    engine, outputs = run_engine(tiny32, prompts, max_num_batched_tokens=8, whole_prompts=True)
    assert outputs == expected(tiny32, prompts)
    assert engine.n_chunks == len(prompts)
    assert any(prefill > 8 for _, _, prefill in engine.passes)     # the 14-, 22- and 30-token prompts


class SharedPrefix(BlockKV):
    """A stand-in for prefix caching: a new prompt that starts with the donor's full blocks maps them into
    its table (one more reference each), so its first chunk starts past them."""
    donor = None

    def new_table(self, seq):
        donor, bs = self.donor, self.block_size
        shares = donor is not None and donor.kv is not None    # a donor admitted before `seq`
        super().new_table(seq)
        if not shares:
            return
        table = seq.kv
        n = (min(len(donor.prompt_ids), len(seq.prompt_ids)) - 1) // bs    # keep >= 1 token to compute
        while n and seq.prompt_ids[:n * bs] != donor.prompt_ids[:n * bs]:
            n -= 1
        for block in donor.kv.block_ids[:n]:
            self.allocator.incref(block)
            table.block_ids.append(block)
        table.n_filled = n * bs


class SharedPrefixEngine(ChunkedPrefillEngine):
    def make_kv(self) -> SharedPrefix:
        return SharedPrefix(self.allocator)


@pytest.mark.parametrize("budget", [5, 4096])
def test_prompts_that_start_in_another_sequences_blocks_equal_hf_generate(tiny32, budget):
    shared = random_prompts([5 * BLOCK_SIZE + 1], seed=3)[0]
    prompts = [shared + tail for tail in random_prompts((2, 9, 13), seed=4)]
    engine = SharedPrefixEngine(tiny32, max_running=4, block_size=BLOCK_SIZE, n_blocks=128,
                                max_num_batched_tokens=budget)
    donor = engine.kv.donor = engine.add(shared, 30, ignore_eos=True)
    while donor.status is not Status.DECODING:
        engine.step()
    seqs = [engine.add(p, NEW_TOKENS, ignore_eos=True) for p in prompts]
    starts, claim = {}, engine.claim
    engine.claim = lambda chunk: starts.setdefault(chunk.seq, chunk.start) is None or claim(chunk)
    engine.run()
    starts = [starts[s] for s in seqs]
    assert starts == [5 * BLOCK_SIZE] * len(prompts)               # every first chunk started past the mapped blocks
    assert [s.output_ids for s in seqs] == expected(tiny32, prompts)
    assert donor.output_ids == hf_greedy(tiny32, shared, 30, ignore_eos=True)
    assert engine.allocator.n_free == engine.allocator.n_blocks


# --- the scheduler's rules -----------------------------------------------------------------------------

def test_a_sequence_mid_prefill_holds_its_blocks_and_emits_nothing_until_its_last_chunk(tiny32):
    engine = ChunkedPrefillEngine(tiny32, max_running=2, block_size=BLOCK_SIZE, n_blocks=32, max_num_batched_tokens=7)
    seq = engine.add(random_prompts([20])[0], 3, ignore_eos=True)
    filled = []
    for _ in range(2):
        assert engine.step() == []
        assert seq.status is Status.PREFILLING and not seq.output_ids and seq.timing.first_token is None
        filled.append((seq.kv.n_filled, seq.kv.n_blocks, engine.allocator.n_used))
    assert filled == [(7, 2, 2), (14, 4, 4)]                      # chunks end mid-block; blocks claimed as they go
    outputs = engine.step()                                        # the last 6 tokens: the first token comes out
    assert [o.seq for o in outputs] == [seq] and seq.status is Status.DECODING
    engine.run()
    assert seq.history == [Status.WAITING, Status.PREFILLING, Status.DECODING, Status.DONE]
    assert seq.output_ids == hf_greedy(tiny32, seq.prompt_ids, 3, ignore_eos=True)


def test_decode_tokens_come_first_and_the_rest_of_the_budget_goes_to_the_oldest_prefill(tiny32):
    engine = Recording(tiny32, max_running=4, block_size=BLOCK_SIZE, n_blocks=64, max_num_batched_tokens=6)
    a, b = (engine.add(p, 20, ignore_eos=True) for p in random_prompts((2, 3), seed=5))
    engine.step()                                                  # both prefill whole (5 tokens)
    c, d = (engine.add(p, 2, ignore_eos=True) for p in random_prompts((9, 9), seed=6))
    engine.step()
    # a and b decode (2 tokens), c takes the other 4; d waits: 6 - 2 - 9 (the rest of c) leaves no token for it
    assert engine.passes[-1] == (6, 2, 4)
    assert c.kv.n_filled == 4 and d.status is Status.WAITING
    engine.step()
    assert engine.passes[-1] == (6, 2, 4) and c.kv.n_filled == 8 and d.status is Status.WAITING
    engine.step()                                                  # c's last token, then 3 of d's: d was admitted
    assert engine.passes[-1] == (6, 2, 4) and c.status is Status.DECODING and d.kv.n_filled == 3
    engine.run()
    assert [s.output_ids for s in (a, b, c, d)] == [hf_greedy(tiny32, s.prompt_ids, s.max_new_tokens,
                                                              ignore_eos=True) for s in (a, b, c, d)]


def test_admission_counts_the_worst_case_of_a_partly_prefilled_sequence(tiny32):
    """A holds few blocks while its prefill is under way, but its worst case is promised: B, which fits
    beside what A holds but not beside what A may claim, waits for A to finish."""
    # A: 30 + 4 new tokens -> up to 33 positions = 9 blocks. B: 6 + 4 -> 9 positions = 3 blocks. Pool: 10.
    engine = ChunkedPrefillEngine(tiny32, max_running=2, block_size=BLOCK_SIZE, n_blocks=10,
                                  max_num_batched_tokens=20)
    a = engine.add(random_prompts([30], seed=7)[0], 4, ignore_eos=True)
    b = engine.add(random_prompts([6], seed=8)[0], 4, ignore_eos=True)
    engine.step()                 # A's first 20 tokens; B is not considered: the rest of A takes the budget
    assert a.kv.n_blocks == 5 and b.status is Status.WAITING and b.seq_id not in engine.waited_for_blocks
    engine.step()                 # B fits what A's last 10 tokens leave of the budget, and 5 blocks are free...
    assert b.status is Status.WAITING and b.seq_id in engine.waited_for_blocks   # ...but A may claim 4 of them
    while a.status is not Status.DONE:
        assert b.status is Status.WAITING
        engine.step()
    engine.run()
    assert b.output_ids == hf_greedy(tiny32, b.prompt_ids, 4, ignore_eos=True)
    assert engine.allocator.n_free == engine.allocator.n_blocks


def test_the_prefill_kernel_runs_once_per_layer_per_pass_and_the_plan_once_per_pass(tiny32, monkeypatch):
    from phases.p3_8_chunked_prefill import attention, runner as engine_module
    calls = {"attention": 0, "plan": 0}

    def counting(name, fn):
        def counted(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return counted
    monkeypatch.setattr(attention, "paged_prefill_attention", counting("attention", attention.paged_prefill_attention))
    monkeypatch.setattr(engine_module, "plan_prefill", counting("plan", engine_module.plan_prefill))
    prompts = random_prompts((3, 6, 9, 12))
    engine, outputs = run_engine(tiny32, prompts, max_num_batched_tokens=13)
    assert outputs == expected(tiny32, prompts)
    prefill_passes = sum(1 for _, _, prefill in engine.passes if prefill)
    assert calls == {"attention": prefill_passes * tiny32.n_layers, "plan": prefill_passes}
    assert any(prefill > 4 for _, _, prefill in engine.passes)     # passes held several segments


def test_abort_mid_prefill_gives_the_blocks_back(tiny32):
    engine = ChunkedPrefillEngine(tiny32, block_size=BLOCK_SIZE, n_blocks=32, max_num_batched_tokens=5)
    a = engine.add(random_prompts([25])[0], 5, ignore_eos=True)
    b = engine.add([300, 301, 302], 4, ignore_eos=True)
    engine.step()
    assert a.status is Status.PREFILLING and a.kv.n_blocks > 0
    engine.abort(a)
    assert a.finish_reason == "abort"
    engine.run()
    assert b.output_ids == hf_greedy(tiny32, b.prompt_ids, 4, ignore_eos=True)
    assert engine.allocator.n_free == engine.allocator.n_blocks


def test_bad_budget_is_refused(tiny32):
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="max_num_batched_tokens"):
            ChunkedPrefillEngine(tiny32, n_blocks=8, max_num_batched_tokens=bad)


# --- attention as the model defines it -----------------------------------------------------------------

@pytest.fixture(scope="module")
def window_models():
    return {name: load_model(name, device="cpu", dtype=torch.float32) for name in ("tiny-sliding", "tiny-softcap")}


@pytest.mark.parametrize("budget, chunked", [(5, True), (4096, True), (6, False)])
@pytest.mark.parametrize("name", ["tiny-sliding", "tiny-softcap"])
def test_window_and_softcap_models_equal_hf_generate_past_the_window(window_models, name, budget, chunked):
    lm = window_models[name]
    prompts = random_prompts((3, TINY_WINDOW + 2, 14, 23), seed=9)
    _, outputs = run_engine(lm, prompts, max_new_tokens=10, max_running=2, max_num_batched_tokens=budget,
                            whole_prompts=not chunked)
    assert outputs == expected(lm, prompts, 10)


@pytest.mark.parametrize("name", ["tiny", "tiny-softcap"])
def test_engine_on_the_triton_kernels_under_the_interpreter(window_models, tiny32, monkeypatch, name):
    """The GPU code path (paged decode kernel + varlen prefill kernel, a mixed pass) on CPU: few tokens,
    the interpreter runs every program in Python."""
    monkeypatch.setenv(FORCE_KERNELS_ENV, "1")
    lm = tiny32 if name == "tiny" else window_models[name]
    prompts = random_prompts((2, 11, 17), seed=10)
    engine, outputs = run_engine(lm, prompts, max_new_tokens=4, max_running=2, max_num_batched_tokens=6)
    assert engine.n_mixed_passes > 0
    assert outputs == expected(lm, prompts, 4)


# --- the demo --------------------------------------------------------------------------------------------

def test_prefill_bench_quick_runs_every_section_and_draws(tmp_path):
    from measure.cli import run_demo
    from phases.p3_8_chunked_prefill.demo import pack_lengths, plot_prefill

    report = run_demo("prefill_bench", model="tiny", device="cpu", dtype="fp32", quick=True)
    data = report.data
    assert {r["pack"] for r in data["attention"]} == {"1x24", "3x4-12"}
    assert all(r["max_err"] < 1e-5 for r in data["attention"])        # the loop and the varlen path agree
    assert all(r["tokens"] > 0 for r in data["engine"])
    assert {r["prefix"] for r in data["engine"]} == {0, 8}
    assert len(data["latency"]) == 3 and all(r["n_gaps"] > 0 for r in data["latency"].values())
    for work in data["workload"].values():
        assert set(work) == {"batched", "chunked"}
    notes = " ".join(n for t in report.tables for n in t.notes)
    assert "3/3 outputs identical" in notes
    plot_prefill(report, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0
    assert pack_lengths("16x256") == [256] * 16 and len(pack_lengths("5x1-3")) == 5
    with pytest.raises(ValueError, match="NxL"):
        pack_lengths("16by256")
