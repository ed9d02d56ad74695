"""Memory and the metric maths every demo shares, over the clock readings of common/clock.py.

Definitions (DESIGN.md, "Measurement"; TTFT and ms/tok per request are
`SeqTiming`'s properties):
- total throughput: all generated tokens / wall time of the run.
- mean ms/tok: the mean of the per-sequence ms/tok.
- ms/step: wall time of one decode step of a batch that runs together, the
  blog's ms/tok (see `ms_per_step`).
- peak memory: `PeakMemory`, tensors on CUDA, process RSS on CPU.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from statistics import mean
from typing import Iterator

import torch

from common.clock import SeqTiming

MB = 1024 * 1024
RSS_SAMPLE_INTERVAL_S = 0.005  # how often the CPU peak-memory sampler reads RSS


@dataclass
class RunMetrics:
    n_seqs: int
    total_tokens: int
    wall_s: float
    total_tok_s: float
    mean_ms_per_token: float
    mean_ttft_ms: float
    peak_mb: float = float("nan")
    ms_per_step: float = float("nan")

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _nanmean(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]
    return mean(xs) if xs else float("nan")


def summarize(timings: list[SeqTiming], wall_s: float, peak_mb: float = float("nan")) -> RunMetrics:
    total = sum(t.n_generated for t in timings)
    return RunMetrics(
        n_seqs=len(timings), total_tokens=total, wall_s=wall_s,
        total_tok_s=total / wall_s if wall_s > 0 else float("nan"),
        mean_ms_per_token=_nanmean([t.ms_per_token for t in timings]),
        mean_ttft_ms=_nanmean([t.ttft_ms for t in timings]),
        peak_mb=peak_mb,
        ms_per_step=ms_per_step(timings),
    )


def ms_per_step(timings: list[SeqTiming]) -> float:
    """Wall time per decode step of a batch whose sequences all start together and make one token per
    step until the longest is done (the `sweep` and `tput` runs): the blog's ms/tok.

    Step 0 (the prefill) gives every sequence its first token; each later step gives every sequence
    still running one more. So the steps after the first are the span from the last first token (the
    end of step 0) to the last token of all (the end of the last step), over the longest output
    minus one. It differs from the per-sequence figure (`SeqTiming.ms_per_token`) when the sequences do
    not run in lockstep, and it counts a step's whole time however the step is computed: one forward
    pass for the batch, or (phases 2.3 and 3.3) one per sequence.
    """
    started = [t for t in timings if t.first_token is not None]
    steps_after_first = max((t.n_generated for t in started), default=0) - 1
    if steps_after_first < 1:
        return float("nan")
    end_of_first_step = max(t.first_token for t in started)
    return (max(t.finish for t in started) - end_of_first_step) * 1e3 / steps_after_first


def rss_bytes() -> int:
    import psutil
    return psutil.Process().memory_info().rss


class PeakMemory:
    """Peak memory over a `with` block.

    CUDA: `torch.cuda.max_memory_allocated` (reset at entry), i.e. tensors only.
    CPU: peak process RSS, sampled by a background thread, since the allocator
    has no counter there. RSS includes the model weights and Python itself, so
    compare it across rows of one run, not with GPU numbers.
    """

    def __init__(self, device: str | torch.device):
        self.cuda = str(device).startswith("cuda") and torch.cuda.is_available()
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "PeakMemory":
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            self.peak_bytes = rss_bytes()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(RSS_SAMPLE_INTERVAL_S):
            self.peak_bytes = max(self.peak_bytes, rss_bytes())

    def __exit__(self, *exc) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.peak_bytes = torch.cuda.max_memory_allocated()
        else:
            self._stop.set()
            self._thread.join()
            self.peak_bytes = max(self.peak_bytes, rss_bytes())

    @property
    def peak_mb(self) -> float:
        return self.peak_bytes / MB


@contextmanager
def cpu_threads(n: int) -> Iterator[None]:
    """Run with `n` intra-op CPU threads (0: leave torch's default), then restore.

    On a small shared CPU, a multi-threaded op waits at a barrier for every
    thread; when the other cores are busy with other work, that wait (a
    scheduler time slice, ~10 ms) can dwarf the op itself. One thread measures
    the operation rather than the neighbours. Every demo takes `--threads`.
    """
    before = torch.get_num_threads()
    if n > 0:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def ceil_div(n: int, d: int) -> int:
    """n / d rounded up: tokens -> pages for the harness (measure/ imports no phase, so not p3_1's
    `blocks_for`, which the phases use)."""
    full, rest = divmod(n, d)
    return full + (rest > 0)


def kv_bytes_per_token(lm) -> int:
    """Bytes of K and V one token occupies across all layers: 2 * L * H_kv * D * itemsize."""
    itemsize = torch.empty((), dtype=lm.dtype).element_size()
    return 2 * lm.n_layers * lm.n_kv_heads * lm.head_dim * itemsize


def percentile(xs: list[float], q: float) -> float:
    """q in [0, 100]; linear interpolation, NaN for an empty list."""
    xs = sorted(x for x in xs if x == x)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)
