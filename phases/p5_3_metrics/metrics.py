"""What `/health` and `/metrics` report: a snapshot of the engine, and its Prometheus exposition.

`MeteredAsyncEngine`'s engine thread takes an `EngineStats` after every step and publishes it with one
reference assignment, so the HTTP handlers never touch the engine. At each scrape a custom collector
(prometheus-client's way to export values that live elsewhere) reads the latest snapshot. Counters only
grow (a scraper derives rates); gauges are the state now. Time to first token and inter-token latency are
timed on the event loop as tokens reach their request. vllm_metrics.py adds vLLM's names beside ours.
"""

from __future__ import annotations

import math
import threading
from bisect import bisect_left
import time
from collections import deque
from dataclasses import asdict, dataclass
from itertools import accumulate
from weakref import WeakKeyDictionary

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from phases.p4_4_preemption.engine import PREEMPTED
from phases.p5_2_async_engine.async_engine import AsyncEngine, TokenEvent

TOKEN_RATE_WINDOW_S = 10.0
METRIC_PREFIX = "engine"
# Upper bounds (seconds) of the histograms' buckets: vLLM's, so its dashboards' quantiles read ours alike.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)


@dataclass(frozen=True)
class EngineStats:
    running: int                  # sequences in the running batch
    waiting: int                  # sequences queued and never admitted yet
    preempted: int                # sequences preempted for room: waiting to be recomputed, or swapped out
    free_blocks: int              # KV blocks free (cached-free ones included: they are reclaimable)
    total_blocks: int
    prefix_blocks_queried: int    # full prompt blocks looked up in the prefix cache
    prefix_blocks_hit: int        # ... and found there
    prefix_tokens_queried: int    # prompt tokens of every admitted request (recomputed ones again)
    prefix_tokens_hit: int        # ... whose prefill a prefix hit saved
    preemptions: int              # preemptions so far
    generated_tokens: int         # tokens handed to clients so far
    step_failures: int            # steps that raised
    requests_failed: int          # requests failed by a step (the culprits)
    isolating: bool               # narrower passes while a failure's culprit is searched for

    @property
    def prefix_hit_rate(self) -> float:
        """Blocks hit / blocks looked up; NaN before any lookup (and with prefix caching off)."""
        return self.prefix_blocks_hit / self.prefix_blocks_queried if self.prefix_blocks_queried else math.nan

    def as_dict(self) -> dict:
        out = asdict(self)
        out["prefix_hit_rate"] = None if math.isnan(self.prefix_hit_rate) else self.prefix_hit_rate
        return out


def snapshot(engine, generated_tokens: int, requests_failed: int) -> EngineStats:
    """The served engine's state now; call on the engine thread only."""
    preempted = sum(1 for s in engine.waiting if s.status is PREEMPTED) + len(engine.swapped_seqs)
    cache = engine.cache_stats
    return EngineStats(
        running=len(engine.running), waiting=len(engine.waiting) + len(engine.swapped_seqs) - preempted,
        preempted=preempted, free_blocks=engine.allocator.n_free, total_blocks=engine.allocator.n_blocks,
        prefix_blocks_queried=cache.blocks_queried, prefix_blocks_hit=cache.blocks_hit,
        prefix_tokens_queried=cache.prompt_tokens, prefix_tokens_hit=cache.tokens_skipped,
        preemptions=engine.stats.n_preemptions, generated_tokens=generated_tokens,
        step_failures=engine.n_step_failures, requests_failed=requests_failed, isolating=engine.isolating)


class RateMeter:
    """Events per second over the last `window_s` seconds. One thread adds, any thread reads."""

    def __init__(self, window_s: float = TOKEN_RATE_WINDOW_S):
        self.window_s = window_s
        self._events: deque[tuple[float, int]] = deque()   # (when, how many)
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self._events.append((time.monotonic(), n))
            self._trim()

    def per_second(self) -> float:
        with self._lock:
            self._trim()
            return sum(n for _, n in self._events) / self.window_s

    def _trim(self) -> None:
        cutoff = time.monotonic() - self.window_s
        while self._events and self._events[0][0] < cutoff:
            self._events.popleft()


class Histogram:
    """Counts per bucket, a sum and a count, as Prometheus exports them; observed and scraped on the loop."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)   # the last: above every bound (+Inf)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1   # bucket "le b" holds values <= b
        self.sum += value
        self.count += 1

    def family(self, name: str, doc: str, labels: dict[str, str] | None = None) -> HistogramMetricFamily:
        """Prometheus' cumulative buckets, `le` as text."""
        labels = labels or {}
        h = HistogramMetricFamily(name, doc, labels=list(labels))
        cumulative = list(zip([*map(str, self.bounds), "+Inf"], accumulate(self.counts)))
        h.add_metric(list(labels.values()), cumulative, self.sum)
        return h


class MeteredAsyncEngine(AsyncEngine):
    """Phase 5.2's async engine, measured: a snapshot after every drain of the inbox (after every step, and
    while idle), the tokens handed out, the requests failed, the token rate, TTFT and ITL."""

    def __init__(self, engine, **kwargs):
        super().__init__(engine, **kwargs)
        self.n_generated = 0                           # engine side: tokens the engine made
        self.n_requests_failed = 0                     # engine side: requests a failed step failed
        self.token_rate = RateMeter()
        self.ttft = Histogram(TTFT_BUCKETS_S)         # loop side: a request's first token (any sample's)
        self.itl = Histogram(ITL_BUCKETS_S)           # loop side: between two tokens of one sample
        # loop side: request -> when each sample's last token came; an entry goes with its request
        self._last_token_at: WeakKeyDictionary = WeakKeyDictionary()
        self.stats: EngineStats = self._snapshot()

    def _snapshot(self) -> EngineStats:
        return snapshot(self.engine, self.n_generated, self.n_requests_failed)
    # --- engine thread ----------------------------------------------------------------
    def _drain(self) -> None:
        super()._drain()
        self.stats = self._snapshot()  # one reference assignment: readers see old or new, never half

    def _fail_all(self, error) -> None:
        super()._fail_all(error)
        self.stats = self._snapshot()

    def _dispatch(self, outputs) -> None:
        self.n_generated += len(outputs)
        if outputs:
            self.token_rate.add(len(outputs))
        super()._dispatch(outputs)

    def _fail_culprits(self, failure) -> None:
        self.n_requests_failed += sum(g in self._owner for g in failure.failed)
        super()._fail_culprits(failure)

    # --- event loop -------------------------------------------------------------------
    def _deliver(self, batch: dict) -> None:
        now = time.monotonic()
        for req, events in batch.items():
            for ev in events:
                if isinstance(ev, TokenEvent):
                    self._time(req, ev.index, now)
        super()._deliver(batch)

    def _time(self, req, index: int, now: float) -> None:
        last = self._last_token_at.setdefault(req, [None] * req.n)
        if all(t is None for t in last):
            self.ttft.observe(now - req.arrival)
        elif last[index] is not None:
            self.itl.observe(now - last[index])
        last[index] = now


class EngineCollector:
    """Reads the async engine's latest snapshot at every scrape (prometheus-client's custom-collector protocol)."""

    def __init__(self, aengine):
        self.aengine = aengine

    def collect(self):
        s: EngineStats = self.aengine.stats
        p = METRIC_PREFIX
        gauges = [
            ("running_sequences", "Sequences in the running batch", s.running),
            ("waiting_sequences", "Sequences queued, never admitted yet", s.waiting),
            ("preempted_sequences", "Sequences preempted for room (to recompute, or swapped out)", s.preempted),
            ("queued_requests", "Requests accepted and not producing tokens yet (503 past max_waiting)",
             self.aengine.n_queued),
            ("kv_blocks_free", "KV blocks free (cached-free included)", s.free_blocks),
            ("kv_blocks_total", "KV blocks in the pool", s.total_blocks),
            ("prefix_cache_hit_rate", "Prefix cache: blocks hit / blocks looked up (NaN before any lookup)",
             s.prefix_hit_rate),
            ("generation_tokens_per_second", f"Tokens generated per second over the last "
             f"{self.aengine.token_rate.window_s:g} s", self.aengine.token_rate.per_second()),
            ("isolating", "1 while a failed step's culprit is being isolated", int(s.isolating)),
        ]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(f"{p}_{name}", doc, value=value)
        counters = [
            ("generation_tokens", "Tokens generated", s.generated_tokens),
            ("preemptions", "Preemptions", s.preemptions),
            ("prefix_cache_queried_blocks", "Prompt blocks looked up in the prefix cache", s.prefix_blocks_queried),
            ("prefix_cache_hit_blocks", "Prompt blocks found in the prefix cache", s.prefix_blocks_hit),
            ("prefix_cache_queried_tokens", "Prompt tokens of admitted requests", s.prefix_tokens_queried),
            ("prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache", s.prefix_tokens_hit),
            ("step_failures", "Engine steps that raised", s.step_failures),
            ("requests_failed", "Requests failed by an engine step", s.requests_failed),
        ]
        for name, doc, value in counters:
            yield CounterMetricFamily(f"{p}_{name}", doc, value=value)
        yield self.aengine.ttft.family(f"{p}_time_to_first_token_seconds",
                                       "Time from a request's arrival to its first token")
        yield self.aengine.itl.family(f"{p}_inter_token_latency_seconds", "Time between two tokens of one sample")
        group = getattr(self.aengine.engine, "tensor_parallel", None)
        if group is not None:
            alive = group.health()["alive"]
            yield GaugeMetricFamily(f"{p}_tensor_parallel_workers", "Ranks of the tensor-parallel group", len(alive))
            yield GaugeMetricFamily(f"{p}_tensor_parallel_workers_alive", "Ranks of the tensor-parallel group "
                                    "alive (below the size: the engine can run nothing more)", sum(alive))


def metrics_registry(aengine, *collectors) -> CollectorRegistry:
    """This server's own registry (tests start several servers): ours and the `collectors` given (vLLM's)."""
    registry = CollectorRegistry(auto_describe=False)
    for collector in (EngineCollector(aengine), *collectors):
        registry.register(collector)
    return registry


def exposition(registry: CollectorRegistry) -> tuple[bytes, str]:
    """(body, content type) of a /metrics answer."""
    return generate_latest(registry), CONTENT_TYPE_LATEST
