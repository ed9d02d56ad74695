"""CUDA graph capture of one decode step, in one small function.

A decode forward pass of a 28-layer model is some 1,500 kernel launches; on a
host with a slow CPU, launching them from Python takes several times longer
than the GPU takes to run them (the README has the figures). A CUDA graph records the launches once, with their
arguments (the addresses of the static buffers), and replays them with one
call. What the step changes must therefore be *values* in those buffers,
never shapes or addresses: hence the static buffers, the buckets (one graph
per batch size) and a split count fixed per graph.

`capture(forward, pool)` runs `forward` a few times on a side stream first
(Triton compiles its kernels, cuBLAS picks its algorithms, the caching
allocator warms up; none of that may happen during capture), then records one
call. The tensor that call returned is the graph's output: each replay
overwrites it. Graphs of one engine share one memory pool (`pool`), captured
largest bucket first, so the smaller ones reuse its memory.
"""

from __future__ import annotations

from typing import Callable

import torch

from phases.p3_10_cuda_graphs.graph_capture import record, warm_up_for_capture


def capture(forward: Callable[[], torch.Tensor], pool=None) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Record `forward()` (static inputs -> a tensor) as a CUDA graph; returns (graph, its output tensor)."""
    warm_up_for_capture(forward)       # graph_capture.py: a few calls on a side stream first
    graph = torch.cuda.CUDAGraph()
    out = record(graph, forward, pool)  # torch.cuda.graph, the caller's stream put back even if it fails
    return graph, out
