"""The promises of phase 4.4's preempting scheduler, checked while it runs and after it stops.

`Audited` is a mixin (put it first in the bases) that watches the engine's
own decisions and records every broken rule in `violations`:

- preemption picks the latest-arrived running group, never an earlier one;
- a group is preempted whole: none of its members stays running;
- first come, first served: a group admitted (or swapped back in) was
  earlier than every group still waiting or swapped out at that moment.

`check_finished` runs after the engine has drained: every request is done,
every sequence finished exactly once (DONE once in its history, listed once
in `engine.finished`), and no block leaked in the GPU pool or the CPU pool
(measure/harness.py's `pool_problems`, which any engine's pool can be checked
with). The tests assert on both; `stress_demo` reports them.
"""

from __future__ import annotations

from collections import Counter

from measure.harness import pool_problems
from phases.p2_2_scheduler.sequence import Sequence, Status
from phases.p4_1_copy_on_write.engine import SequenceGroup


class Audited:
    """Mixin for a PreemptingEngine subclass: `class E(Audited, PreemptingEngine)`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.violations: list[str] = []

    def _waiting_ids(self) -> set[int]:
        return {self.group_of(s).request_id for s in self.waiting} | {g.request_id for g in self.swapped}

    def _running_ids(self) -> set[int]:
        return {self.group_of(s).request_id for s in self.running}

    def _preempt(self, group: SequenceGroup, members: list[Sequence]) -> None:
        running = self._running_ids()
        if group.request_id != max(running):
            self.violations.append(f"step {self.n_steps}: preempted request {group.request_id}, "
                                   f"but {max(running)} arrived later")
        super()._preempt(group, members)
        if any(self.group_of(s) is group for s in self.running):
            self.violations.append(f"step {self.n_steps}: request {group.request_id} only partly preempted")

    def admit(self) -> None:
        before = self._running_ids()
        super().admit()
        self._check_fcfs(self._running_ids() - before, "admitted")

    def _swap_in(self) -> None:
        before = self._running_ids()
        super()._swap_in()
        self._check_fcfs(self._running_ids() - before, "swapped in")

    def _check_fcfs(self, started: set[int], what: str) -> None:
        later = self._waiting_ids()
        for rid in started:
            earlier = [w for w in later if w < rid]
            if earlier:
                self.violations.append(f"step {self.n_steps}: {what} request {rid} while earlier request(s) "
                                       f"{sorted(earlier)} still waited")


def check_finished(engine, groups: list[SequenceGroup]) -> list[str]:
    """Problems found once the engine has no work left (an empty list: all is well)."""
    problems = []
    if engine.has_work:
        problems.append(f"engine still has work: {len(engine.waiting)} waiting, {len(engine.running)} running, "
                        f"{len(engine.swapped)} swapped")
    listed = Counter(s.seq_id for s in engine.finished)
    for group in groups:
        if not group.done:
            problems.append(f"request {group.request_id} not done")
        for s in group.seqs:
            if s.history.count(Status.DONE) != 1 or listed[s.seq_id] != 1:
                problems.append(f"sequence {s.seq_id} finished {s.history.count(Status.DONE)} times "
                                f"(listed {listed[s.seq_id]} times)")
    problems += pool_problems(engine.allocator, "GPU pool")
    if engine.swap_space.cpu is not None:
        problems += pool_problems(engine.swap_space.cpu, "CPU pool")
    return problems + list(getattr(engine, "violations", []))
