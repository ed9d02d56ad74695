"""Warm a call up before a CUDA graph records it: on a side stream, so its first-call work stays out of the graph.

A graph records launches, not work done on the host. So before `fn` is
captured it must already have run: Triton compiles a kernel on its first
launch, cuBLAS picks its algorithms, the caching allocator grows its pools, and
none of that may happen while a stream is capturing. PyTorch's rule for these
warm-up calls is a side stream, ordered after the work already queued and
before the capture that follows. Phase 3.7's engine captures its decode steps
this way (phases/p3_7_cuda_graphs/graphs.py), and the kernel benches capture a
kernel's calls the same way to time them without launch latency
(common/kernel_bench.py).
"""

from __future__ import annotations

from typing import Callable

import torch

WARMUP_RUNS = 2   # before capture: compile, autotune, allocate


def warm_up_for_capture(fn: Callable[[], object], runs: int = WARMUP_RUNS) -> None:
    """Call `fn()` `runs` times on a side stream, ordered after the current stream's work and before its next."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(runs):
            fn()
    torch.cuda.current_stream().wait_stream(side)
