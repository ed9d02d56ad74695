"""A step-by-step record of who occupies which running slot: the data behind the timelines.

A scheduler appends one `StepRecord` per `step()`: enough to draw "which sequence holds which slot
when", static batching's carried rows (a slot held by a finished sequence) included.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
