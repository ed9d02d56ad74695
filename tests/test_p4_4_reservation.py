"""Orca's reservations beside paged allocation (reservation.py, rate_sweep): each reservation claimed at
admission and never outgrown, its size per policy, paged admitting at least as many, the same tokens under
every policy, and the rate sweep end to end; Orca for requests of several sequences (nothing shared) and
share_sweep; block_sweep end to end."""

import pytest

from measure.harness import drive_timed
from measure.rate_bench import sustained_rate
from measure.workload import DATASET_MEANS, burst, dataset_lengths, rate_trace
from phases.p3_1_block_allocator.allocator import OutOfBlocks, blocks_for
from phases.p4_4_preemption.engine import PreemptingEngine
from extras.p4_4_preemption.reservation import RESERVATION_POLICIES, ReservingEngine, reserved_tokens

BLOCK = 4
CONTEXT = 64

pytestmark = pytest.mark.usefixtures("one_thread")   # many tiny passes: one thread is faster


def engine(lm, policy: str, n_blocks: int):
    """The paged engine (vLLM's policy) or a reserving one, on a pool of `n_blocks`."""
    if policy == "paged":
        return PreemptingEngine(lm, prefix_caching=False, block_size=BLOCK, n_blocks=n_blocks, max_running=64)
    return ReservingEngine(lm, policy, context_limit=CONTEXT, block_size=BLOCK, n_blocks=n_blocks, max_running=64)


def trace(lm, n=12):
    return burst(lm.vocab_size, n, prompt_len=(3, 14), output_len=(2, 24), seed=1)


def run(e, reqs) -> tuple[list[list[int]], int]:
    """Every request at once, stepped to the end: (outputs in request order, most requests running at once)."""
    seqs = [e.add(r.prompt_ids, r.max_new_tokens, ignore_eos=True) for r in reqs]
    peak = 0
    while e.has_work:
        e.step()
        peak = max(peak, len(e.running))
    return [s.output_ids for s in seqs], peak


def test_reserved_tokens_per_policy():
    assert [reserved_tokens("pow2", n, 2048) for n in (1, 2, 25, 32, 33)] == [1, 2, 32, 32, 64]
    assert reserved_tokens("pow2", 1500, 1024 + 512) == 1536   # capped by the context limit
    assert reserved_tokens("oracle", 25, 2048) == 25
    assert reserved_tokens("max", 25, 2048) == 2048


@pytest.mark.parametrize("policy,tokens", [("oracle", 17), ("pow2", 32), ("max", CONTEXT)])
def test_each_policy_claims_its_reservation_at_admission(tiny32, policy, tokens):
    e = engine(tiny32, policy, n_blocks=64)
    seq = e.add(list(range(100, 107)), 10, ignore_eos=True)    # final length 7 + 10 = 17
    e.step()                                                   # admitted and prefilled
    assert seq.kv.n_blocks == blocks_for(tokens, BLOCK) == e.admission.blocks_to_admit(seq)
    assert e.allocator.n_used == blocks_for(tokens, BLOCK)
    e.run()
    assert e.allocator.n_free == e.allocator.n_blocks          # the whole reservation back at the end


@pytest.mark.parametrize("policy", RESERVATION_POLICIES)
def test_a_request_never_writes_past_its_reservation(tiny32, policy):
    e = engine(tiny32, policy, n_blocks=40)
    claimed: dict[int, list[int]] = {}
    claim = e.kv.append_slots

    def watched(seq, n):
        # every slot lies in the blocks the table held when the request was admitted (before its first write)
        claimed.setdefault(seq.seq_id, list(seq.kv.block_ids))
        slots = claim(seq, n)
        assert {s // BLOCK for s in slots} <= set(claimed[seq.seq_id])
        assert seq.kv.block_ids == claimed[seq.seq_id]          # the table never grew
        return slots

    e.kv.append_slots = watched
    reqs = trace(tiny32)
    run(e, reqs)
    assert len(claimed) == len(reqs) and e.stats.n_preemptions == 0
    assert all(len(b) == blocks_for(reserved_tokens(policy, len(r.prompt_ids) + r.max_new_tokens, CONTEXT), BLOCK)
               for b, r in zip(claimed.values(), reqs))


def test_a_write_past_the_reservation_is_refused(tiny32):
    e = engine(tiny32, "oracle", n_blocks=16)
    seq = e.add(list(range(100, 105)), 3, ignore_eos=True)     # 8 tokens: 2 blocks
    e.admit()
    e.kv.append_slots(seq, 8)
    with pytest.raises(OutOfBlocks, match="never extended"):
        e.kv.append_slots(seq, 1)


def test_paged_admits_at_least_as_many_as_oracle_and_each_reservation_fewer(tiny32):
    reqs = trace(tiny32, n=16)
    first, peak = {}, {}
    for policy in ("paged",) + RESERVATION_POLICIES:
        e = engine(tiny32, policy, n_blocks=48)
        for r in reqs:
            e.add(r.prompt_ids, r.max_new_tokens, ignore_eos=True)
        e.step()
        first[policy] = len(e.running)
        peak[policy] = max(first[policy], run(e, [])[1])
    assert first["paged"] >= first["oracle"] >= first["pow2"] >= first["max"]
    assert peak["paged"] >= peak["oracle"] and first["paged"] > first["max"]


def test_outputs_under_every_policy_equal_the_paged_engine(tiny32):
    reqs = trace(tiny32)
    paged = engine(tiny32, "paged", n_blocks=24)               # small enough that paged preempts
    ref, _ = run(paged, reqs)
    assert paged.stats.n_preemptions > 0
    for policy in RESERVATION_POLICIES:
        assert run(engine(tiny32, policy, n_blocks=24), reqs)[0] == ref, policy


def test_bad_input_is_refused_clearly(tiny32):
    with pytest.raises(ValueError, match="unknown reservation policy 'buddy'.*oracle"):
        ReservingEngine(tiny32, "buddy", block_size=BLOCK, n_blocks=16)
    with pytest.raises(ValueError, match="unknown reservation policy"):
        reserved_tokens("pow3", 10, 64)
    with pytest.raises(ValueError, match="could never admit"):
        ReservingEngine(tiny32, "max", context_limit=128, block_size=BLOCK, n_blocks=16)
    e = engine(tiny32, "pow2", n_blocks=64)
    with pytest.raises(ValueError, match="context limit of 64"):
        e.add(list(range(100, 160)), 10)
    with pytest.raises(ValueError, match="one sequence"):
        e.add_group(list(range(100, 110)), 4, n=2)
    assert not e.has_work


def test_dataset_lengths_follow_the_scaled_means_within_the_context_limit():
    lengths = dataset_lengths("sharegpt", 4000, scale=1 / 8, context_limit=256)
    prompt, out = DATASET_MEANS["sharegpt"]
    assert all(p >= 1 and o >= 1 and p + o <= 256 for p, o in lengths)
    assert abs(sum(p for p, _ in lengths) / 4000 - prompt / 8) < 0.1 * prompt / 8
    assert abs(sum(o for _, o in lengths) / 4000 - out / 8) < 0.1 * out / 8
    with pytest.raises(ValueError, match="unknown dataset"):
        dataset_lengths("wikitext", 4, 1.0, 2048)


def test_drive_timed_adds_each_request_once_it_has_arrived(tiny32):
    reqs = rate_trace(tiny32.vocab_size, 5, rate_per_s=20.0, dataset="alpaca", scale=0.25, context_limit=CONTEXT)
    e = engine(tiny32, "paged", n_blocks=64)
    seqs = drive_timed(e, tiny32, reqs)
    t0 = seqs[0].timing.arrival - reqs[0].arrival_s
    assert [round(s.timing.arrival - t0, 6) for s in seqs] == [round(r.arrival_s, 6) for r in reqs]
    assert all(s.timing.first_token >= s.timing.arrival and s.timing.n_generated == r.max_new_tokens
               for s, r in zip(seqs, reqs))


def test_sustained_rate_interpolates_the_crossing():
    assert sustained_rate([(1, 0.1), (2, 0.2), (4, 0.6)], 0.4) == (3.0, True)
    assert sustained_rate([(1, 0.1), (2, 0.2)], 0.4) == (2, False)        # never crossed: a lower bound
    assert sustained_rate([(1, 0.5), (2, 0.9)], 0.4) == (0.0, True)


def test_rate_sweep_quick_runs_end_to_end():
    from measure.cli import run_demo
    report = run_demo("rate_sweep", model="tiny", device="cpu", dtype="fp32", quick=True)
    d = report.data
    assert d["policies"] == ["paged", *RESERVATION_POLICIES] and all(d["identical"].values())
    assert all(str(d["rates"][0]) in d["runs"][p] for p in d["policies"])   # every policy ran the lowest rate
    assert [t.title.split(" ")[0] for t in report.tables] == ["Normalized", "Mean", "Highest"]
    assert not any("✗" in str(cell) for t in report.tables for row in t.rows for cell in row)


# --- requests of several sequences: Orca shares nothing (share_sweep, the paper's Fig. 14) -------------------
def test_unshared_admission_reserves_every_sequence_its_own_copy(tiny32):
    from phases.p4_2_beam_search.engine import BeamSearchEngine
    from extras.p4_4_preemption.reservation import UnsharedReservingEngine
    prompt, new, n, n_blocks = list(range(3, 11)), 8, 4, 40          # 8 + 8 tokens: 4 blocks a sequence
    admitted = {}
    for name, cls in (("shared", BeamSearchEngine), ("unshared", UnsharedReservingEngine)):
        e = cls(tiny32, block_size=BLOCK, n_blocks=n_blocks, max_running=64)
        groups = [e.add_group(prompt, new, ignore_eos=True, n=n) for _ in range(6)]
        e.step()
        admitted[name] = sum(g.seqs[0].status.name != "WAITING" for g in groups)
    # unshared: 4 x 4 blocks a request, 2 in a pool of 40; shared: 2 prompt blocks + 4 x 2, so 4 fit (40 // 10)
    assert admitted == {"shared": 4, "unshared": 2}


def test_unshared_engine_makes_the_same_samples_and_beams(tiny32):
    from common.sampling import SamplingParams
    from phases.p4_2_beam_search.engine import BeamSearchEngine
    from extras.p4_4_preemption.reservation import UnsharedReservingEngine
    outs = []
    for cls in (BeamSearchEngine, UnsharedReservingEngine):
        e = cls(tiny32, block_size=BLOCK, n_blocks=40, max_running=64)
        samples = [e.add_group(r.prompt_ids, r.max_new_tokens, SamplingParams(temperature=1.0, seed=i),
                               ignore_eos=True, n=3) for i, r in enumerate(trace(tiny32, n=4))]
        beams = [e.add_beam_search(r.prompt_ids, r.max_new_tokens, beam_width=3) for r in trace(tiny32, n=3)]
        e.run()
        outs.append(([g.outputs for g in samples], [g.best for g in beams]))
    assert outs[0] == outs[1]
    with pytest.raises(ValueError, match="3 unshared copies.*whole pool has 8"):   # 3 x 3 blocks > 8
        UnsharedReservingEngine(tiny32, block_size=BLOCK, n_blocks=8).add_group([5] * 6, 6, ignore_eos=True, n=3)


def test_share_sweep_quick_runs_end_to_end():
    from measure.cli import run_demo
    report = run_demo("share_sweep", model="tiny", device="cpu", dtype="fp32", quick=True)
    d = report.data
    assert d["kinds"] == ["sampling", "beam"] and d["widths"] == [2]
    assert all(same == total > 0 for same, total in d["identical"].values())   # fp32: the same tokens
    assert all(str(d["rates"][0]) in runs for runs in d["runs"].values())      # every policy ran the lowest rate
    assert [t.title.split(":")[0] for t in report.tables] == ["parallel sampling", "beam search",
                                                             "Highest rate sustained under 1 s/token"]


def test_block_sweep_quick_runs_end_to_end():
    from measure.cli import run_demo
    report = run_demo("block_sweep", model="tiny", device="cpu", dtype="fp32", quick=True)
    d = report.data
    assert list(d["runs"]) == ["sharegpt recompute", "sharegpt swap"] and d["block_sizes"] == [2, 8]
    assert all(set(by_size) == {"2", "8"} for by_size in d["runs"].values())
    normalized, _, best = report.tables
    assert [row[0] for row in normalized.rows] == [2, 8] and all(v > 0 for row in normalized.rows for v in row[1:])
    assert [row[:2] for row in best.rows] == [["sharegpt", "recompute"], ["sharegpt", "swap"]]


@pytest.mark.parametrize("dataset, paper", [("sharegpt", "1.7-2.7x"), ("alpaca", "-")])
def test_the_paper_is_quoted_only_beside_the_dataset_it_gives_figures_for(dataset, paper):
    from measure.rate_bench import ratio_table
    from measure.report import Report
    report = Report("rate_sweep")
    runs = {p: {4.0: {"mean_batched": 8.0}} for p in ("paged", "oracle")}
    ratio_table(report, ["paged", "oracle"], runs, {"paged": (4.0, True), "oracle": (2.0, True)}, 0.3, dataset)
    [table] = report.tables
    oracle = table.rows[1]
    assert oracle[2] == "2.00x" and oracle[table.columns.index("paper: rate")] == paper


def test_share_sweep_bounds_a_ratio_by_the_rate_that_never_crossed():
    from measure.share_rate_bench import paged_over
    assert paged_over(6.0, True, 3.0, True) == "2.00x"
    assert paged_over(8.0, False, 4.0, True) == ">= 2.00x"   # paged held up to the highest rate run
    assert paged_over(4.0, True, 8.0, False) == "<= 0.50x"   # Orca did
    assert paged_over(8.0, False, 8.0, False) == "-" and paged_over(2.0, True, 0.0, True) == "-"
