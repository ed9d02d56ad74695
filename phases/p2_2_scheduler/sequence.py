"""A request's life: `Status` and `Sequence`, and `StepOutput`, one token of one step.

A sequence moves WAITING -> PREFILLING -> DECODING -> DONE, exactly once each. `kv` is the engine's KV
state for it (here the `PaddedBatch` it shares); the state machine never looks inside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any, Callable

from common.clock import SeqTiming
from common.sampling import GREEDY, SamplingParams


class Status(Enum):
    WAITING = auto()
    PREFILLING = auto()
    DECODING = auto()
    DONE = auto()


# The only moves a sequence may make. Anything else is a scheduler bug.
ALLOWED_MOVES = {
    Status.WAITING: {Status.PREFILLING},
    Status.PREFILLING: {Status.DECODING, Status.DONE},
    Status.DECODING: {Status.DONE},
    Status.DONE: set(),
}


# eq=False: two sequences with equal fields are still two requests (and a sequence can be a dict key).
@dataclass(eq=False)
class Sequence:
    seq_id: int
    prompt: str
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams = GREEDY
    ignore_eos: bool = False          # fixed-length benchmark runs
    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    timing: SeqTiming | None = None   # arrival / first token / finish clock readings
    kv: Any = None                    # the engine's KV state for this sequence
    history: list[Status] = field(default_factory=lambda: [Status.WAITING])
    finish_reason: str | None = None  # "eos" or "length"

    def __post_init__(self):
        if not self.prompt_ids:
            raise ValueError(f"sequence {self.seq_id}: empty prompt")
        if self.max_new_tokens <= 0:
            raise ValueError(f"sequence {self.seq_id}: max_new_tokens must be > 0, got {self.max_new_tokens}")

    def move(self, new: Status) -> None:
        """Change status, refusing any move the state machine does not allow."""
        if new not in ALLOWED_MOVES[self.status]:
            raise RuntimeError(f"sequence {self.seq_id}: illegal move {self.status.name} -> {new.name}")
        self.status = new
        self.history.append(new)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def n_tokens(self) -> int:
        """Tokens whose K/V the sequence holds or will hold: prompt + generated."""
        return len(self.prompt_ids) + len(self.output_ids)

    def take_token(self, token_id: int, eos_ids: set[int], t: float | None = None) -> bool:
        """The token sampled for this sequence in a step (a first one ends its prefill). True when finished."""
        if self.status is Status.PREFILLING:
            self.move(Status.DECODING)
        return self.append_token(token_id, eos_ids, t)

    def append_token(self, token_id: int, eos_ids: set[int], t: float | None = None) -> bool:
        """Record a generated token; return True when the sequence is now finished."""
        self.output_ids.append(token_id)
        if self.timing is not None and t is not None:
            self.timing.token(t)
        if not self.ignore_eos and token_id in eos_ids:
            self.finish_reason = "eos"
        elif len(self.output_ids) >= self.max_new_tokens:
            self.finish_reason = "length"
        return self.finish_reason is not None


@dataclass
class StepOutput:
    """One token emitted by one sequence in one step."""
    seq: Sequence
    token_id: int
    finished: bool   # the sequence is DONE after this token (EOS or max_new_tokens)


def take_tokens(seqs: list[Sequence], tokens: list[int], eos_ids: set[int], t: float | None,
                finish: Callable[[Sequence], None]) -> list[StepOutput]:
    """seqs[i] takes tokens[i] at clock reading `t`; `finish(seq)` runs for each one now done."""
    outputs = []
    for seq, token in zip(seqs, tokens):
        done = seq.take_token(token, eos_ids, t)
        if done:
            finish(seq)
        outputs.append(StepOutput(seq, token, done))
    return outputs
