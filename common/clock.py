"""The clock every engine reads: a synchronised wall clock and one request's timestamps.

An engine stamps each request as it runs (arrival, each token, finish) in a
`SeqTiming`; the demos turn those stamps into metrics (measure/bench.py).
The definitions the properties follow (DESIGN.md, "Measurement"):
- TTFT: a request's arrival to its first generated token.
- ms/tok: decode time per generated token after the first
  ((finish - first_token) / (n_generated - 1)).
On CUDA every clock read is preceded by a synchronize, since kernels run
asynchronously and an unsynchronised timer measures only the launch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


def sync(device: str | torch.device | None = None) -> None:
    """Wait for queued GPU work, so the next clock read means something."""
    if torch.cuda.is_available() and (device is None or str(device).startswith("cuda")):
        # "cuda" or None: the current GPU; "cuda:1": that one
        torch.cuda.synchronize(device if device is not None and ":" in str(device) else None)


def now(device: str | torch.device | None = None) -> float:
    """A synchronised wall clock, in seconds."""
    sync(device)
    return time.perf_counter()


@dataclass
class SeqTiming:
    """The clock readings of one request (seconds, from `now()`)."""
    arrival: float
    first_token: float | None = None
    finish: float | None = None
    n_generated: int = 0
    token_times: list[float] = field(default_factory=list)  # when each token came out

    def token(self, t: float) -> None:
        if self.first_token is None:
            self.first_token = t
        self.token_times.append(t)
        self.finish = t
        self.n_generated += 1

    def first(self, n: int) -> "SeqTiming":
        """The timing of only the first n tokens: a row carried past what its request asked for (a static
        batch runs every row to its longest) finished, for that request, when its n-th token came out."""
        out = SeqTiming(arrival=self.arrival)
        for when in self.token_times[:n]:
            out.token(when)
        return out

    @property
    def ttft_ms(self) -> float:
        return (self.first_token - self.arrival) * 1e3 if self.first_token is not None else float("nan")

    @property
    def ms_per_token(self) -> float:
        if self.n_generated < 2:
            return float("nan")
        return (self.finish - self.first_token) * 1e3 / (self.n_generated - 1)

    @property
    def latency_ms(self) -> float:
        return (self.finish - self.arrival) * 1e3 if self.finish is not None else float("nan")

