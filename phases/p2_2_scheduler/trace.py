"""A step-by-step record of who occupies which running slot: the data behind the timelines.

A scheduler appends one `StepRecord` per `step()`. From the records we can draw
"which sequence holds which slot when", and see static batching's carried rows
(a slot held by a sequence that has already finished) next to continuous
batching handing a freed slot straight to the next waiting sequence.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

# What a slot did during one step.
PREFILL, DECODE, CARRIED = "prefill", "decode", "carried"


@dataclass
class StepRecord:
    step: int
    t_start: float                 # clock (seconds, `common.clock.now`) when the step began
    t_end: float
    slots: list[int | None]        # seq_id in each slot (None: empty)
    work: list[str | None]         # PREFILL / DECODE / CARRIED per slot (None: empty)


@dataclass
class Trace:
    records: list[StepRecord] = field(default_factory=list)

    def add(self, record: StepRecord) -> None:
        self.records.append(record)

    def max_occupied(self) -> int:
        """The most slots ever held at once (never more than max_running)."""
        return max((sum(s is not None for s in r.slots) for r in self.records), default=0)

    def spans(self, t0: float) -> list[dict]:
        """Contiguous stretches of one sequence in one slot doing one kind of work.

        Times are seconds from `t0`. Prefill and decode merge into one "live"
        stretch; carried stretches (static batching's waste) stay separate.
        Returns [{"seq": id, "slot": s, "start": s, "end": s, "carried": bool, "steps": n}].
        """
        out: list[dict] = []
        open_: dict[int, dict] = {}   # slot -> the span being extended
        for r in self.records:
            for slot, (sid, work) in enumerate(zip(r.slots, r.work)):
                if sid is None:
                    open_.pop(slot, None)
                    continue
                carried = work == CARRIED
                cur = open_.get(slot)
                if cur is not None and cur["seq"] == sid and cur["carried"] == carried:
                    cur["end"], cur["steps"] = r.t_end - t0, cur["steps"] + 1
                else:
                    cur = {"seq": sid, "slot": slot, "start": r.t_start - t0, "end": r.t_end - t0,
                           "carried": carried, "steps": 1}
                    open_[slot] = cur
                    out.append(cur)
        return out

    def as_dicts(self) -> list[dict]:
        return [asdict(r) for r in self.records]
