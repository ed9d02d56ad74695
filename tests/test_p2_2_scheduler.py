"""Phase 2.2: the static-batch scheduler keeps the state machine, the cap and FIFO order, and
its greedy output equals HF generate per prompt."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from phases.p2_2_scheduler.scheduler import Scheduler
from phases.p2_2_scheduler.sequence import Status
from phases.p2_2_scheduler.trace import CARRIED
from tests.test_p2_1_naive_batching import NEW_TOKENS, PROMPTS, reference

FULL_LIFE = [Status.WAITING, Status.PREFILLING, Status.DECODING, Status.DONE]


def finished(outputs) -> list:
    """The sequences a step's StepOutputs report as finished, in output order."""
    return [o.seq for o in outputs if o.finished]


def run_all(sched_cls, lm, prompts, max_running, n=NEW_TOKENS):
    s = sched_cls(lm, max_running=max_running)
    for p in prompts:
        s.add(p, n)
    return s, s.run()


# --- the oracle ---------------------------------------------------------------------------------
def test_static_scheduler_equals_hf_generate(any32):
    # max_running=3 over 4 prompts: a batch of three, then a batch of one.
    s, done = run_all(Scheduler, any32, PROMPTS, max_running=3)
    assert [q.output_ids for q in done] == reference(any32)
    assert [q.seq_id for q in done] == [0, 1, 2, 3]


# --- properties of the scheduler, on the tiny model with token-id prompts -----------------------
def check_invariants(s: Scheduler, n_added: int) -> None:
    """What any scheduler in phase 2 must guarantee, read from its sequences and its trace."""
    seqs = s.sequences
    # Nothing lost, nothing run twice: every sequence finished exactly once.
    assert sorted(q.seq_id for q in s.finished) == list(range(n_added))
    assert not s.waiting and not s.running
    for q in seqs:
        assert q.history == FULL_LIFE, q.history
        assert q.status is Status.DONE and q.finish_reason in ("eos", "length")
        assert 1 <= len(q.output_ids) <= q.max_new_tokens
    # Never more than max_running at once.
    assert max(sum(sid is not None for sid in r.slots) for r in s.trace.records) <= s.max_running
    # FIFO: sequences are admitted (first seen in a slot) in the order they were added.
    first_seen: dict[int, int] = {}
    for r in s.trace.records:
        for sid in r.slots:
            if sid is not None:
                first_seen.setdefault(sid, r.step)
    order = sorted(first_seen, key=lambda sid: (first_seen[sid], sid))
    assert order == list(range(n_added))
    # Each sequence occupies exactly one slot for one unbroken stretch.
    for sid in range(n_added):
        steps = [r.step for r in s.trace.records if sid in r.slots]
        assert steps == list(range(steps[0], steps[0] + len(steps)))
        assert len({r.slots.index(sid) for r in s.trace.records if sid in r.slots}) == 1


requests = st.lists(st.tuples(st.lists(st.integers(100, 2000), min_size=1, max_size=6),  # prompt ids
                              st.integers(1, 4)),                                          # max_new_tokens
                    min_size=1, max_size=7)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(reqs=requests, max_running=st.integers(1, 4))
def test_static_scheduler_properties(tiny32, reqs, max_running):
    s = Scheduler(tiny32, max_running=max_running)
    for ids, n in reqs:
        s.add(ids, n, ignore_eos=True)
    done = s.run()
    check_invariants(s, len(reqs))
    assert [len(q.output_ids) for q in done] == [n for _, n in reqs]
    # Static batches: consecutive groups of max_running; a slot changes owner only when
    # the whole batch is done, so a finished row is carried until then.
    owners_before = None
    for r in s.trace.records:
        if owners_before is not None and r.slots != owners_before:
            assert "prefill" in r.work, "a new owner appeared without a new batch starting"
            assert all(w == "prefill" for w in r.work if w is not None)
        owners_before = r.slots
    batches = [tuple(sid for sid in r.slots if sid is not None) for r in s.trace.records if "prefill" in r.work]
    expected = [tuple(range(i, min(i + max_running, len(reqs)))) for i in range(0, len(reqs), max_running)]
    assert batches == expected
    lengths = [n for _, n in reqs]
    if max_running > 1 and len(set(lengths[:max_running])) > 1:
        assert any(w == CARRIED for r in s.trace.records for w in r.work)


def test_step_by_step_states(tiny32):
    s = Scheduler(tiny32, max_running=2)
    a, b, c = s.add([101, 102], 1), s.add([103], 3), s.add([104, 105, 106], 2)
    assert [q.status for q in (a, b, c)] == [Status.WAITING] * 3
    outputs = s.step()                           # prefill: one token each, a is done after its only token
    assert [(o.seq, o.finished) for o in outputs] == [(a, True), (b, False)]
    assert [o.token_id for o in outputs] == [a.output_ids[-1], b.output_ids[-1]]
    assert (a.status, b.status, c.status) == (Status.DONE, Status.DECODING, Status.WAITING)
    assert s.slots == [a, b]                     # a is DONE but still holds its slot (static batch)
    s.step()
    assert finished(s.step()) == [b] and s.slots == [None, None] and c.status is Status.WAITING
    assert s.returned_at[a.seq_id] == s.returned_at[b.seq_id]  # a static batch returns together
    s.step()
    assert finished(s.step()) == [c] and not s.has_work
    assert s.step() == []                        # nothing to do is not an error


# --- bad input --------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [0, -1, 1.5, None])
def test_max_running_must_be_positive(tiny32, bad):
    with pytest.raises(ValueError, match="max_running"):
        Scheduler(tiny32, max_running=bad)


def test_bad_requests_are_rejected_at_add(tiny32):
    s = Scheduler(tiny32)
    with pytest.raises(ValueError, match="empty prompt"):
        s.add("", 4)
    with pytest.raises(ValueError, match="empty prompt"):
        s.add([], 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        s.add("hi", 0)
    with pytest.raises(ValueError, match="context"):
        s.add("word " * (tiny32.max_context + 10), 4)
    assert not s.waiting and not s.sequences and s.run() == []
