"""Speculative decoding: greedy outputs equal plain decoding and HF `generate` for every proposer, sampling keeps
the target's distribution, rejected guesses give their slots and blocks back, bad input is refused."""

import dataclasses
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.sampling import SamplingParams
from phases.p3_1_block_allocator.allocator import BlockAllocator
from phases.p3_2_block_table.block_table import BlockTable
from phases.p4_5_speculative_decoding.acceptance import Proposal, _accept_greedy, accept
from phases.p4_5_speculative_decoding.engine import SpeculativeEngine, Verify
from phases.p4_5_speculative_decoding.proposers import (DraftProposer, NgramProposer, common_prefix, lookup,
                                                        self_draft, truncate)
from tests.oracles import hf_greedy

# chi-square critical values at significance 0.001 (df -> value): a correct sampler fails 1 run in 1,000.
CHI2_CRIT_0001 = {3: 16.27, 4: 18.47, 5: 20.52}


pytestmark = pytest.mark.usefixtures("one_thread")   # many tiny passes: one thread is faster


class Scripted:
    """A proposer that knows each prompt's true greedy continuation and guesses it, each token wrong with
    probability `wrong`, and a random length 0..k: any acceptance from none to all, on any model."""

    name = "scripted"

    def __init__(self, truth: dict[tuple, list[int]], wrong: float, seed: int = 0, vocab: int = 100):
        self.truth, self.wrong, self.rng, self.vocab = truth, wrong, random.Random(seed), vocab
        self.n_proposed = 0

    def propose(self, seqs, k, seeds):
        out = []
        for s in seqs:
            true = self.truth[tuple(s.prompt_ids)][len(s.output_ids):len(s.output_ids) + self.rng.randint(0, k)]
            guess = [t if self.rng.random() >= self.wrong else (t + 1 + self.rng.randrange(self.vocab - 1))
                     % self.vocab for t in true]
            self.n_proposed += len(guess)
            out.append(Proposal(guess))
        return out

    def release(self, seq):
        pass


def _prompts(lm, n: int, shared_prefix: int = 0, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, lm.vocab_size) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(3, lm.vocab_size) for _ in range(rng.randint(3, 20))] for _ in range(n)]


def _run(engine, prompts, new_tokens):
    seqs = [engine.add(p, new_tokens, ignore_eos=True) for p in prompts]
    engine.run()
    pool = engine.allocator
    pool.check_invariants()
    assert pool.n_free == pool.n_blocks, f"{pool.n_blocks - pool.n_free} blocks leaked"
    return [s.output_ids for s in seqs]


# --- proposers and the rollback, alone ---------------------------------------------------------------
def test_ngram_lookup_takes_the_latest_occurrence_of_the_longest_suffix():
    assert lookup([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], k=2) == [7, 5]      # latest "1 2 3", not the first
    assert lookup([5, 6, 1, 8, 8, 2, 6], k=3) == [1, 8, 8]                  # only "6" recurs: n = 1
    assert lookup([1, 2, 3, 4], k=3) == []                                 # nothing recurs
    assert lookup([4, 1, 2], k=5, max_n=2) == []
    assert lookup([1, 2, 1, 2], k=4) == [1, 2]                              # what followed, up to the end
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(max_n=1, min_n=2)


def test_truncate_gives_back_exactly_the_blocks_past_the_kept_tokens():
    pool = BlockAllocator(8, 1, 1, 4, block_size=4)
    table = BlockTable(4)
    table.append_slots(pool, 10)                            # 3 blocks
    assert truncate(table, pool, 9) == 0 and table.n_blocks == 3 and table.n_filled == 9
    assert truncate(table, pool, 4) == 2 and table.n_blocks == 1 and pool.n_free == 7
    assert table.append_slots(pool, 2) == table.slot_mapping(4, 6)        # refills past the cut
    with pytest.raises(ValueError, match="cut"):
        truncate(table, pool, 7)
    table.release(pool)
    assert pool.n_free == pool.n_blocks


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert common_prefix([], [1]) == 0 and common_prefix([5], [6]) == 0


def test_greedy_acceptance_keeps_the_matching_prefix_plus_one():
    assert _accept_greedy([4, 5, 6], [4, 5, 9, 1]) == [4, 5, 9]
    assert _accept_greedy([4, 5, 6], [4, 5, 6, 1]) == [4, 5, 6, 1]           # all kept: the bonus token
    assert _accept_greedy([7], [4, 5]) == [4]
    assert _accept_greedy([], [3]) == [3]


# --- sampling keeps the target's distribution ---------------------------------------------------------------
@dataclasses.dataclass
class _Row:
    sampling: SamplingParams
    output_ids: list


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def _first_tokens(p_logits, q, n, seed, draft_from_q=True, pass_q=True, two=False, claimed_q=None):
    """Run `accept` on n independent trials of one proposal (one token, or two), each with its own seed.
    claimed_q: the distribution `accept` is told the drafts came from (default: q, the true one)."""
    told = q if claimed_q is None else claimed_q
    gen = torch.Generator().manual_seed(seed)
    m = 2 if two else 1
    seqs, proposals, rows = [], [], []
    for i in range(n):
        drafts = torch.multinomial(q, m, replacement=True, generator=gen).tolist() if draft_from_q else [2] * m
        seqs.append(_Row(SamplingParams(temperature=1.0), []))
        proposals.append(Proposal(drafts, told.expand(m, -1) if pass_q else None))
        rows.append(p_logits)
    logits = torch.cat(rows)                                      # [n * (m + 1), V]
    return accept(seqs, proposals, logits, seeds=[seed * 1_000_003 + i for i in range(n)])


@pytest.mark.parametrize("kind", ["draft", "point", "drawn-but-weighed-as-point"])
def test_rejection_sampling_emits_tokens_distributed_as_the_target(kind):
    vocab = 5
    p_logits = torch.tensor([[1.0, 0.2, -0.5, 2.0, 0.0]] * 2)      # rows for position 1 and the bonus
    p = p_logits[0].softmax(-1)
    q = torch.tensor([0.05, 0.5, 0.2, 0.05, 0.2])                 # a draft that is badly off
    n = 20_000
    out = _first_tokens(p_logits, q, n, seed=7, draft_from_q=(kind != "point"), pass_q=(kind == "draft"))
    first = torch.bincount(torch.tensor([t[0] for t in out]), minlength=vocab).float()
    assert _chi2(first, p) < CHI2_CRIT_0001[vocab - 1], (first / n, p)
    # After an accepted guess the bonus token is drawn from the next row: also p.
    bonus = torch.bincount(torch.tensor([t[1] for t in out if len(t) == 2]), minlength=vocab).float()
    assert _chi2(bonus, p) < CHI2_CRIT_0001[vocab - 1]
    accepted = sum(len(t) == 2 for t in out) / n
    # acceptance: sum min(p, q) (1 - total variation) when q is known; sum q * p when a draw is weighed as
    # certain (less); p(d) for a fixed guess d
    expected = {"draft": float(torch.minimum(p, q).sum()), "point": float(p[2]),
                "drawn-but-weighed-as-point": float((q * p).sum())}[kind]
    assert abs(accepted - expected) < 0.02


def test_the_distribution_test_can_fail():
    """The same check rejects a wrong rule: drafts drawn from q, weighed as if drawn from the uniform distribution.
    (Weighing them as certain, a point mass, is NOT wrong: it keeps p too, and only accepts less often.)"""
    vocab = 5
    p_logits = torch.tensor([[1.0, 0.2, -0.5, 2.0, 0.0]] * 2)
    q = torch.tensor([0.05, 0.5, 0.2, 0.05, 0.2])
    out = _first_tokens(p_logits, q, 20_000, seed=8, claimed_q=torch.full((vocab,), 1 / vocab))
    first = torch.bincount(torch.tensor([t[0] for t in out]), minlength=vocab).float()
    assert _chi2(first, p_logits[0].softmax(-1)) > CHI2_CRIT_0001[vocab - 1]


def test_two_guesses_keep_the_distribution_at_each_position():
    vocab = 4
    p_logits = torch.tensor([[0.5, 1.5, 0.0, -1.0], [2.0, 0.0, 0.3, 0.1], [0.0, 0.0, 1.0, 0.0]])
    q = torch.tensor([0.4, 0.2, 0.2, 0.2])
    out = _first_tokens(p_logits, q, 20_000, seed=9, two=True)
    for pos in (0, 1):
        got = torch.bincount(torch.tensor([t[pos] for t in out if len(t) > pos]), minlength=vocab).float()
        assert _chi2(got, p_logits[pos].softmax(-1)) < CHI2_CRIT_0001[vocab - 1], pos


def test_seeded_acceptance_draws_are_reproducible():
    p_logits = torch.tensor([[1.0, 0.2, -0.5, 2.0, 0.0]] * 2)
    q = torch.tensor([0.05, 0.5, 0.2, 0.05, 0.2])
    assert _first_tokens(p_logits, q, 200, seed=3) == _first_tokens(p_logits, q, 200, seed=3)


# --- the engine: greedy outputs exact, KV rolled back, nothing leaked --------------------------------------
def _truth(lm, prompts, new_tokens):
    return {tuple(p): hf_greedy(lm, p, new_tokens, ignore_eos=True) for p in prompts}


@pytest.mark.parametrize("n_seqs,wrong,k", [(1, 0.0, 4), (1, 0.5, 3), (5, 0.2, 4), (8, 0.9, 2), (6, 1.0, 5)])
def test_greedy_outputs_equal_hf_at_any_acceptance(tiny32, n_seqs, wrong, k):
    prompts = _prompts(tiny32, n_seqs, seed=n_seqs)
    truth = _truth(tiny32, prompts, 24)
    proposer = Scripted(truth, wrong, seed=k)
    engine = SpeculativeEngine(tiny32, speculative=proposer, num_speculative_tokens=k, n_blocks=64, block_size=4)
    assert _run(engine, prompts, 24) == [truth[tuple(p)] for p in prompts]
    stats = engine.spec_stats
    assert stats.proposed > 0
    if wrong == 1.0:
        assert stats.accepted == 0
    if wrong == 0.0:
        assert stats.accepted == stats.proposed and engine.n_steps < 24


def test_greedy_exact_with_prefix_cache_hits_and_a_preemption(tiny32):
    prompts = _prompts(tiny32, 6, shared_prefix=12, seed=5)
    truth = _truth(tiny32, prompts, 40)
    engine = SpeculativeEngine(tiny32, speculative=Scripted(truth, 0.3, seed=1), num_speculative_tokens=4,
                               n_blocks=36, block_size=4, max_running=6)
    assert _run(engine, prompts, 40) == [truth[tuple(p)] for p in prompts]
    assert engine.stats.n_preemptions > 0, "the pool was meant to run dry"
    assert engine.kv.stats.blocks_hit > 0, "the shared prefix was meant to hit the cache"
    assert engine.spec_stats.accepted > 0 and engine.spec_stats.blocks_rolled_back > 0


def test_swap_mode_preemption_with_speculation(tiny32):
    prompts = _prompts(tiny32, 6, seed=11)
    truth = _truth(tiny32, prompts, 40)
    engine = SpeculativeEngine(tiny32, speculative=Scripted(truth, 0.3, seed=2), preemption_mode="swap",
                               n_blocks=30, block_size=4, prefix_caching=False)
    assert _run(engine, prompts, 40) == [truth[tuple(p)] for p in prompts]
    assert engine.stats.n_preemptions > 0


def test_only_accepted_tokens_are_published_to_the_prefix_cache(tiny32):
    prompts = _prompts(tiny32, 4, shared_prefix=8, seed=6)
    truth = _truth(tiny32, prompts, 30)
    engine = SpeculativeEngine(tiny32, speculative=Scripted(truth, 0.6, seed=3), n_blocks=80, block_size=4)
    published = []
    register = engine.allocator.register

    def spy(block_id, h, tokens, parent=None):
        published.append(tokens)
        return register(block_id, h, tokens, parent=parent)

    engine.allocator.register = spy
    seqs = [engine.add(p, 30, ignore_eos=True) for p in prompts]
    engine.run()
    assert published and engine.spec_stats.accepted < engine.spec_stats.proposed   # rejections happened
    blocks = {tuple(s.all_ids[i:i + 4]) for s in seqs for i in range(0, len(s.all_ids) - 3, 4)}
    assert all(tokens in blocks for tokens in published), "a block holding a rejected guess was published"


def test_guesses_never_copy_a_shared_block(tiny32):
    """Samples of one prompt share its last, partly filled block; copy-on-write happens for their real tokens
    only, so speculation copies exactly as many blocks as plain decoding."""
    prompt = _prompts(tiny32, 1, seed=9)[0] + [7, 7]     # a partial last block at block_size 8
    copies = []
    for speculative in (None, NgramProposer(max_n=1)):
        engine = SpeculativeEngine(tiny32, speculative=speculative, n_blocks=64, block_size=8)
        engine.add_group(prompt, 20, SamplingParams(temperature=1.0, seed=4), ignore_eos=True, n=3)
        engine.run()
        assert engine.allocator.n_free == engine.allocator.n_blocks
        copies.append(engine.n_copied)
    assert copies[0] == copies[1] == 2


def test_guesses_never_evict_a_cached_block(tiny32):
    """A finished request's blocks stay cached (cached-free). A later request's guesses take only truly free
    blocks: with none left, a step evicts exactly what plain decoding's step evicts."""
    first, second = _prompts(tiny32, 2, seed=21)
    truth = _truth(tiny32, [first, second], 24)
    evicted = []
    for speculative in (None, Scripted(truth, 1.0, seed=6)):
        engine = SpeculativeEngine(tiny32, speculative=speculative, num_speculative_tokens=8, block_size=4,
                                   n_blocks=-(-(len(first) + 23) // 4) + -(-len(second) // 4) - 1)
        assert _run(engine, [first], 24) == [truth[tuple(first)]]    # its full blocks stay in the cache
        engine.add(second, 24, ignore_eos=True)
        engine.step()                                                # the prefill: no block is truly free now
        assert engine.allocator.n_uncached_free == 0 < engine.allocator.n_free
        for _ in range(6):
            before = engine.allocator.n_evictions
            engine.step()
            evicted.append(engine.allocator.n_evictions - before)
    assert evicted[:6] == evicted[6:]
    assert engine.spec_stats.proposed > 0


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), n_seqs=st.integers(1, 6), wrong=st.floats(0, 1), k=st.integers(1, 6),
       n_blocks=st.integers(24, 60), caching=st.booleans(), block_size=st.sampled_from([1, 2, 4, 8]))
def test_no_block_leaks_under_any_pattern_of_rejections(tiny32, seed, n_seqs, wrong, k, n_blocks, caching,
                                                        block_size):
    prompts = _prompts(tiny32, n_seqs, shared_prefix=seed % 9, seed=seed)
    truth = _truth(tiny32, prompts, 12)
    n_blocks = max(n_blocks, -(-(20 + 9 + 12) // block_size) + 1)            # the longest request fits alone
    engine = SpeculativeEngine(tiny32, speculative=Scripted(truth, wrong, seed=seed), num_speculative_tokens=k,
                               n_blocks=n_blocks, block_size=block_size, prefix_caching=caching, max_running=4)
    assert _run(engine, prompts, 12) == [truth[tuple(p)] for p in prompts]


@pytest.mark.parametrize("proposer", ["scripted", "draft"])
def test_seeded_sampled_requests_are_reproducible(tiny32, proposer):
    """Seeded sampling with speculation: the same tokens run after run (the draft samples its guesses from its
    own distribution q, which acceptance weighs)."""
    prompts = _prompts(tiny32, 3, seed=12)
    truth = _truth(tiny32, prompts, 16)
    runs = []
    for _ in range(2):
        speculative = Scripted(truth, 0.3, seed=5) if proposer == "scripted" else "draft"
        engine = SpeculativeEngine(tiny32, speculative=speculative, draft_layers=1, n_blocks=64, block_size=4)
        seqs = [engine.add(p, 16, SamplingParams(temperature=0.8, top_k=20, seed=100 + i), ignore_eos=True)
                for i, p in enumerate(prompts)]
        engine.run()
        runs.append([s.output_ids for s in seqs])
        assert engine.spec_stats.proposed > 0 and engine.allocator.n_free == engine.allocator.n_blocks
    assert runs[0] == runs[1]


def test_a_verification_is_a_chunk_of_the_mixed_pass(tiny32):
    prompts = _prompts(tiny32, 2, seed=13)
    truth = _truth(tiny32, prompts, 8)
    engine = SpeculativeEngine(tiny32, speculative=Scripted(truth, 0.0, seed=0), n_blocks=32, block_size=4)
    for p in prompts:
        engine.add(p, 8, ignore_eos=True)
    engine.step()                                   # the prefills
    batch = engine.schedule()
    verify = [c for c in batch.chunks if isinstance(c, Verify)]
    for c in verify:
        assert c.ids == [c.seq.all_ids[-1]] + c.proposal.tokens and c.length == len(c.proposal) + 1
        assert c.seq.kv.n_filled == c.start + c.length and list(c.rows_kept) == list(range(c.length))
    assert len(verify) + len(batch.decode) == 2
    engine.run_batch(batch)


# --- the packaged model: real proposers, exact against HF ----------------------------------------------
PACKAGED_PROMPTS = ["Repeat exactly: the cat sat on the mat, the cat sat on the mat, the cat sat on the mat.",
                    "What is the capital of France?",
                    "Write a Python function that returns the sum of a list."]


@pytest.mark.parametrize("speculative", ["ngram", "draft"])
def test_packaged_model_greedy_equals_hf(smol32, speculative):
    prompts = [smol32.prompt_ids(p) for p in PACKAGED_PROMPTS]
    engine = SpeculativeEngine(smol32, speculative=speculative, draft_layers=24, n_blocks=128)
    seqs = [engine.add(p, 24) for p in prompts]
    engine.run()
    assert [s.output_ids for s in seqs] == [hf_greedy(smol32, p, 24) for p in prompts]
    assert engine.spec_stats.accepted > 0
    assert engine.allocator.n_free == engine.allocator.n_blocks
    if speculative == "draft":
        pool = engine.proposer.allocator
        assert pool.kv_store.shape[1] == 24                                   # a pool for 24 layers only
        assert not engine.proposer.states and pool.n_free == pool.n_blocks       # released as they finished


# --- bad input ----------------------------------------------------------------------------------------------
def refused_before_a_pool_is_taken(make_engine, monkeypatch) -> None:
    """`make_engine()` raises a ValueError naming num_speculative_tokens, and no KV pool was made first."""
    pools = []
    monkeypatch.setattr(BlockAllocator, "__init__", lambda *a, **kw: pools.append(a))
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        make_engine()
    assert pools == []


@pytest.mark.parametrize("k", [0, -1, True, 2.0])
def test_bad_number_of_speculative_tokens_is_refused_before_a_pool_is_taken(tiny32, k, monkeypatch):
    refused_before_a_pool_is_taken(
        lambda: SpeculativeEngine(tiny32, speculative="ngram", num_speculative_tokens=k, n_blocks=8), monkeypatch)


def test_unknown_method_and_bad_self_draft_are_refused(tiny32):
    with pytest.raises(ValueError, match="speculative must be one of"):
        SpeculativeEngine(tiny32, speculative="eagle", n_blocks=8)
    for n in (0, tiny32.n_layers, True):
        with pytest.raises(ValueError, match="self-draft"):
            self_draft(tiny32, n)


def test_a_draft_with_another_vocabulary_or_tokenizer_is_refused(tiny32):
    other_size = dataclasses.replace(tiny32, vocab_size=tiny32.vocab_size + 1)
    with pytest.raises(ValueError, match="vocabulary"):
        DraftProposer(tiny32, other_size, n_blocks=8)

    class OtherTokenizer:
        def get_vocab(self):
            return {"a": 0}

    with pytest.raises(ValueError, match="tokenizer"):
        DraftProposer(tiny32, dataclasses.replace(tiny32, tokenizer=OtherTokenizer()), n_blocks=8)


def test_spec_demo_quick_runs_and_every_output_equals_plain():
    from measure.cli import run_demo
    report = run_demo("spec_demo", model="tiny", device="cpu", quick=True)
    assert report.meta["dtype"] == "float32"                      # the demo's CPU default
    assert report.data["acceptance"] and report.data["speed"]
    assert all(r["identical"] == r["n"] for r in report.data["acceptance"])
    assert all(r["identical"] == r["batch"] and r["plain_tok_s"] > 0 for r in report.data["speed"])
    assert any(r["proposed"] > 0 for r in report.data["acceptance"])


# --- the parts around the engine's own ----------------------------------------------------------------------
def test_the_verifying_parts_wrap_the_parts_the_engine_would_run_without_them(tiny32):
    engine = SpeculativeEngine(tiny32, speculative="ngram", n_blocks=64, block_size=4)
    plain = SpeculativeEngine(tiny32, n_blocks=64, block_size=4)
    runner, sampler = engine.runner.inner, engine.sampler.inner
    assert (type(runner), type(sampler)) == (type(plain.runner), type(plain.sampler))
    forward, calls = runner.forward, []
    runner.forward = lambda *a, **kw: (calls.append(1), forward(*a, **kw))[1]   # a spy on the runner that runs
    engine.add([5, 6, 7, 8] * 4, 8)
    engine.run()
    assert calls and engine.n_forward_passes == runner.n_forward_passes > 0


@dataclasses.dataclass
class _Seq:
    seq_id: int
    all_ids: list
    sampling: SamplingParams = SamplingParams()


def test_a_full_draft_pool_gives_up_idle_sequences_first(tiny32):
    """A preempted sequence keeps its draft state (its tokens do not change), until the draft's pool runs dry:
    then the states of the sequences not proposing go back before a proposing one goes without."""
    proposer = DraftProposer(tiny32, self_draft(tiny32, 1), n_blocks=6, block_size=4)
    idle, asking = _Seq(0, list(range(10, 27))), _Seq(1, list(range(40, 57)))     # 17 tokens: 5 blocks each
    proposer.propose([idle], 2, [0])
    assert proposer.allocator.n_free < 5
    tokens = proposer.propose([asking], 2, [1])[0].tokens
    assert len(tokens) == 2 and list(proposer.states) == [1] and proposer.n_out_of_blocks == 0
    proposer.release(asking)
    assert proposer.allocator.n_free == proposer.allocator.n_blocks
