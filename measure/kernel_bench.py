"""The kernel benchmarks' harness: a sweep over (batch size, context length), one table row per cell.

A kernel demo (`gather_bench`, `attn_bench`) gives the sweep its table and a `measure(case) -> (cells, row)`
function; the sweep loads the model, walks the grid with a progress bar and fills the table:

    report, table = kernel_sweep(cfg, "gather_bench", title, columns, measure)

`case` (a `KernelCase`) carries the cell's shape (batch size, context, the batch's mixed lengths), the
model, and `case.time(fn)`: the median milliseconds of `fn()`. On a CPU a Triton kernel runs only in
Triton's interpreter (every program in Python), so it is checked there on the first cell
(`case.check_kernel`) but never timed (`case.time_kernel` and `case.time_kernel_gpu` say so).

Timing, two ways (`Timing.how` names which one a figure is):

- PER_CALL (`median_ms`, `case.time`, `case.time_kernel`): CUDA events around each call, so the host's
  launch latency is included: what an eager engine pays for each call.
- GRAPH_REPLAY (`gpu_time`, `case.time_kernel_gpu`): replays of a CUDA graph of back-to-back calls, so the
  GPU does not wait on the host: what a replayed decode step pays, and what a bandwidth figure needs.

On CPU both are `time.perf_counter` around each call (the call is synchronous). Warm-up calls come first
(Triton compiles a kernel on its first launch; caches and allocators warm up too), and the median resists
the odd slow outlier. Back-to-back calls read the same K/V, so whatever of it the GPU's L2 holds (50 MB on
an H100) is read again from there: a cell whose K/V is not several times the L2 reads faster than HBM
allows, under either timing.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from common.clock import sync
from measure.demos import Option, RunConfig
from measure.progress import progress_bar
from measure.report import Report, Table, shorten

NOT_TIMED_CPU = "not timed (CPU)"
QUICK = dict(batch_sizes=[1, 2], context_lens=[5, 19], warmup=1, iters=2)   # tests: 4 cells, 1 + 2 calls each
LENGTHS_SEED_STRIDE = 1009   # a prime: every (context, batch) pair draws its own lengths
# The benches' pool. It interleaves layers inside each block ([n_blocks, n_layers, 2, ...]), so two layers
# are enough to read "a layer" that does not start the block.
POOL_LAYERS = 2
LAYER = 1


def median_ms(fn: Callable[[], object], device: str | torch.device, warmup: int = 3, iters: int = 20) -> float:
    """Median milliseconds of `fn()` over `iters` timed calls, after `warmup` untimed ones: per call, so on
    CUDA the host's launch latency included (PER_CALL; `gpu_time` leaves it out).

    A launch returns before the kernel runs, so the CUDA events time the stream, but the start event runs at
    once on an idle GPU while the host is still in Python launching the kernel: the figure includes that
    launch latency (tens of microseconds on a slow host, as much as a small kernel's whole run). It is what an
    eager engine pays for each call (phases 3.4-3.8)."""
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


GRAPH_REPLAY = "GPU time (graph replay)"
PER_CALL = "per call, launch included"
CALLS_PER_GRAPH = 10   # calls of fn in one captured graph: a replay's own launch is paid once per this many
REPLAY_WARMUP = 2      # untimed replays first (the first one uploads the graph), queued before the timed ones


@dataclass(frozen=True)
class Timing:
    """A median time per call and how it was taken (GRAPH_REPLAY, or PER_CALL and, if a graph was wanted, why
    it could not be had)."""
    ms: float
    how: str

    @property
    def replayed(self) -> bool:
        return self.how == GRAPH_REPLAY

    def cell(self) -> float | str:
        """The table cell: the ms under a graph-replay column, or the ms saying it is per call (a fallback)."""
        return self.ms if self.replayed else f"{self.ms:.3f} ({self.how})"


def timing_cell(t: Timing | None) -> float | str:
    """A kernel's table cell: its Timing's, or NOT_TIMED_CPU for None (a kernel not timed on a CPU)."""
    return NOT_TIMED_CPU if t is None else t.cell()


def refuse_a_sync(fn: Callable[[], object]) -> None:
    """Call `fn()` once with torch's sync debug mode at "error": a call that synchronises (`.item()`, `.tolist()`,
    a synchronize: illegal while a stream captures) raises RuntimeError here, before a capture starts. (torch
    detects most synchronising calls, not all: phase 3.10's `record` still guards the capture.)"""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def capture_calls(fn: Callable[[], object], calls: int = CALLS_PER_GRAPH) -> Callable[[], None]:
    """`calls` back-to-back calls of `fn` recorded as one CUDA graph; returns its replay. Raises RuntimeError
    where `fn` cannot be captured (a host read of a device tensor, a synchronize)."""
    # imported on use: measure/ loads no phase, and only a capture on a GPU needs phase 3.10's rules
    from phases.p3_10_cuda_graphs.graphs import record, warm_up
    warm_up(fn)
    refuse_a_sync(fn)           # a synchronising call is refused here, not found by a failed capture
    graph = torch.cuda.CUDAGraph()
    record(graph, lambda: [fn() for _ in range(calls)])
    return graph.replay


def replay_intervals_ms(replay: Callable[[], None], warmup: int, iters: int) -> list[float]:
    """ms of each of `iters` back-to-back replays: events between them, read once at the end. The warm-up
    replays go first in the same queue, so the GPU is still busy when the first timed one is queued."""
    for _ in range(warmup):
        replay()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
    events[0].record()
    for e in events[1:]:
        replay()
        e.record()
    events[-1].synchronize()
    return [a.elapsed_time(b) for a, b in zip(events, events[1:])]


def gpu_time(fn: Callable[[], object], device: str | torch.device, warmup: int = 3, iters: int = 20,
             calls_per_graph: int = CALLS_PER_GRAPH, capture: Callable = capture_calls) -> Timing:
    """Median GPU ms of one `fn()` without the host's launch latency (GRAPH_REPLAY); per call where `fn`
    cannot be captured (a host read of a tensor, say: its Timing says why), and on CPU.

    `fn` is captured `calls_per_graph` times back to back into one CUDA graph; replays are queued back to back
    with an event between each two, so the GPU does not wait on the host (while a replay's calls outlast the
    host's queueing of the next one), and each interval / `calls_per_graph` is one call's GPU time. It is
    what a replayed decode step pays (phase 3.10, whose graphs.py records it here too)."""
    if not str(device).startswith("cuda"):
        return Timing(median_ms(fn, device, warmup, iters), PER_CALL)
    try:
        replay = capture(fn, calls_per_graph)
    except RuntimeError as e:                      # torch reports a failed capture as a RuntimeError
        sync(device)
        return Timing(median_ms(fn, device, warmup, iters), f"{PER_CALL}: not capturable ({capture_error(e)})")
    intervals = replay_intervals_ms(replay, max(REPLAY_WARMUP, -(-warmup // calls_per_graph)), iters)
    return Timing(statistics.median(intervals) / calls_per_graph, GRAPH_REPLAY)


def capture_error(e: BaseException, width: int = 60) -> str:
    """What broke a capture, in a few words: the first line of the first error (ending a broken capture raises
    a second one, "a previous error during capture", chained to it)."""
    while isinstance(e.__context__, RuntimeError):
        e = e.__context__
    lines = str(e).strip().splitlines()
    return shorten(lines[0] if lines else type(e).__name__, width)


def lengths_for(context: int, batch: int, seed: int = 0) -> list[int]:
    """`batch` lengths in [context / 2, context], the first exactly `context`: a batch of mixed lengths."""
    gen = torch.Generator().manual_seed(seed + context * LENGTHS_SEED_STRIDE + batch)
    low = max(1, context // 2)
    rest = torch.randint(low, context + 1, (batch - 1,), generator=gen).tolist()
    return [context] + rest


def kernel_options(*extra: Option) -> list[Option]:
    """The sweep's options (batch sizes, context lengths, block size, warm-up and timed calls), with a
    demo's own `extra` options after the block size."""
    return [
        Option("batch_sizes", int, cpu=[1, 8, 32], gpu=[1, 8, 32, 64], many=True, help="sequences per batch"),
        Option("context_lens", int, cpu=[128, 512, 2048], gpu=[512, 2048, 8192], many=True,
               help="longest sequence in a batch (others drawn from [L/2, L])"),
        Option("block_size", int, cpu=16, gpu=16, help="tokens per KV block"),
        *extra,
        Option("warmup", int, cpu=2, gpu=5, help="untimed calls before timing"),
        Option("iters", int, cpu=10, gpu=50, help="timed calls (median reported)"),
    ]


@dataclass
class KernelCase:
    """One cell of the sweep: what a demo's `measure` gets."""
    lm: object                 # the LoadedModel: KV heads, head_dim, dtype, device
    batch_size: int
    context: int               # the longest sequence; the others are shorter
    lens: list[int]            # every sequence's length (`lengths_for`)
    block_size: int
    first: bool                # the sweep's first cell
    warmup: int
    iters: int

    @property
    def device(self) -> str:
        return self.lm.device

    @property
    def on_gpu(self) -> bool:
        return str(self.lm.device).startswith("cuda")

    @property
    def seed(self) -> int:
        """A seed of this cell's own for its random K/V."""
        return self.context + self.batch_size

    @property
    def check_kernel(self) -> bool:
        """Run the kernel and compare it: every cell on a GPU, the first one only in the CPU interpreter."""
        return self.on_gpu or self.first

    def time(self, fn: Callable[[], object]) -> float:
        """Median ms of `fn()` (see `median_ms`)."""
        return median_ms(fn, self.device, self.warmup, self.iters)

    def time_kernel(self, fn: Callable[[], object]) -> float | str:
        """`time(fn)` (per call, launch included) on a GPU; on a CPU the interpreter's time means nothing:
        NOT_TIMED_CPU."""
        return self.time(fn) if self.on_gpu else NOT_TIMED_CPU

    def time_kernel_gpu(self, fn: Callable[[], object]) -> Timing | None:
        """`gpu_time(fn)` (graph replay: no launch latency) on a GPU; None on a CPU (`timing_cell` says why)."""
        return gpu_time(fn, self.device, self.warmup, self.iters) if self.on_gpu else None


def kernel_sweep(cfg: RunConfig, name: str, title: str, columns: list[str],
                 measure: Callable[[KernelCase], tuple[list, dict]]) -> tuple[Report, Table]:
    """Every (batch size, context) cell through `measure(case) -> (table cells, data row)`; returns the
    report (its data["rows"] filled) and the table, for the demo's notes."""
    cfg.use_quick(**QUICK)
    lm = cfg.load()
    report = cfg.new_report(name)
    if not str(lm.device).startswith("cuda"):   # other work on a shared CPU skews timings: record how busy it was
        report.meta["load_avg_1m"] = round(os.getloadavg()[0], 2)
    table = report.table(title, columns)
    cells = [(b, c) for b in cfg.batch_sizes for c in cfg.context_lens]
    rows = []
    with progress_bar(name, total=len(cells)) as bar:
        for i, (batch_size, context) in enumerate(cells):
            case = KernelCase(lm, batch_size, context, lengths_for(context, batch_size), cfg.block_size,
                              first=i == 0, warmup=cfg.warmup, iters=cfg.iters)
            row_cells, row = measure(case)
            table.add_row(*row_cells)
            rows.append(row)
            bar.advance()
    report.data["rows"] = rows
    return report, table
