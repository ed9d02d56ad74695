"""CUDA graph capture of one decode step: warm it up on a side stream, then record one call.

A graph records a pass's kernel launches once, with their arguments (the static buffers' addresses), and
replays them in one call: a step may change *values* in those buffers, never shapes or addresses. The call
must have run before capture (Triton compiles, cuBLAS picks algorithms), and must not make the host wait.
"""

from __future__ import annotations

from typing import Callable

import torch

WARMUP_RUNS = 2   # before capture: compile, autotune, allocate


def capture(forward: Callable[[], torch.Tensor], pool=None) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Record `forward()` (static inputs -> a tensor) as a CUDA graph, its memory from `pool`; returns
    (graph, its output tensor), which each replay overwrites."""
    warm_up(forward)
    graph = torch.cuda.CUDAGraph()
    return graph, record(graph, forward, pool)


def warm_up(fn: Callable[[], object], runs: int = WARMUP_RUNS) -> None:
    """Call `fn()` `runs` times on a side stream (PyTorch's rule for the calls before a capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(runs):
            fn()
    torch.cuda.current_stream().wait_stream(side)


def record(graph: torch.cuda.CUDAGraph, fn: Callable[[], object], pool=None) -> object:
    """Capture `fn()` into `graph`; returns what the call returned. The caller's stream stays current."""
    stream = torch.cuda.current_stream()
    try:
        with torch.cuda.graph(graph, pool=pool):
            return fn()
    finally:
        torch.cuda.set_stream(stream)
