"""Warm a call up before a CUDA graph records it, then record it so that a failed capture harms nothing after it.

A graph records launches, not work done on the host. So before `fn` is
captured it must already have run: Triton compiles a kernel on its first
launch, cuBLAS picks its algorithms, the caching allocator grows its pools, and
none of that may happen while a stream is capturing. PyTorch's rule for these
warm-up calls is a side stream, ordered after the work already queued and
before the capture that follows. This phase's engine captures its decode steps
this way (graphs.py), and the kernel benches capture a kernel's calls the same
way to time them without launch latency (measure/kernel_bench.py).

A capture can fail: a call that makes the host wait for the GPU (`.item()`,
`.tolist()`, a synchronize) is illegal while a stream captures. torch's
`torch.cuda.graph` then raises from `capture_end` before it puts the caller's
stream back, so every later op of the thread would run on the capture stream.
`record` restores the stream whatever happens, and `refuse_a_sync` finds such
a call before any capture starts (the kernel benches' test of "can this be
captured?", which falls back to per-call timing when it cannot).
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


def refuse_a_sync(fn: Callable[[], object]) -> None:
    """Call `fn()` once with torch's sync debug mode at "error": a call that synchronises raises RuntimeError here,
    before a capture. (torch detects most synchronising calls, not all: `record` still guards the capture.)"""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def record(graph: torch.cuda.CUDAGraph, fn: Callable[[], object], pool=None) -> object:
    """Capture `fn()` into `graph` (memory from `pool`); returns what the call returned (the graph's output).
    The caller's stream is current again afterwards, even when the capture fails."""
    stream = torch.cuda.current_stream()
    try:
        with torch.cuda.graph(graph, pool=pool):
            return fn()
    finally:
        torch.cuda.set_stream(stream)
