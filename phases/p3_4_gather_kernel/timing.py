"""Median wall time of a GPU or CPU operation, for the kernel benchmarks.

On CUDA a kernel launch returns before the kernel runs, so a host clock would
time the launch. CUDA events are recorded in the stream around each call and
read after a synchronise: they time the work itself. On CPU the call is
synchronous and `time.perf_counter` suffices. Warm-up calls come first (Triton
compiles a kernel on its first launch; caches and allocators warm up too), and
the median of the timed calls resists the odd slow outlier.
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from common.bench import cpu_threads, sync  # noqa: F401  (cpu_threads re-exported)


def median_ms(fn: Callable[[], object], device: str | torch.device, warmup: int = 3, iters: int = 20) -> float:
    """Median milliseconds of `fn()` over `iters` timed calls, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    sync(device)
    times: list[float] = []
    if str(device).startswith("cuda"):
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def lengths_for(context: int, batch: int, seed: int = 0) -> list[int]:
    """`batch` lengths in [context / 2, context], the first exactly `context`: a batch of mixed lengths."""
    gen = torch.Generator().manual_seed(seed + context * 1009 + batch)
    low = max(1, context // 2)
    rest = torch.randint(low, context + 1, (batch - 1,), generator=gen).tolist()
    return [context] + rest


