"""The kernel benchmarks' harness: a sweep over (batch size, context length), one table row per cell.

A kernel demo (`gather_bench`, `attn_bench`) gives the sweep its table and a
`measure(case) -> (cells, row)` function; the sweep loads the model, walks the
grid with a progress bar and fills the table:

    report, table = kernel_sweep(cfg, "gather_bench", title, columns, measure)

`case` (a `KernelCase`) carries the cell's shape (batch size, context, the
batch's mixed lengths), the model, and `case.time(fn)`: the median
milliseconds of `fn()`. On a CPU a Triton kernel runs only in Triton's
interpreter (every program in Python), so it is checked there on the first
cell (`case.check_kernel`) but never timed (`case.time_kernel` says so).

Timing. On CUDA a kernel launch returns before the kernel runs, so a host clock
would time the launch. CUDA events are recorded in the stream around each call
and read after a synchronise: they time the work itself. On CPU the call is
synchronous and `time.perf_counter` suffices. Warm-up calls come first (Triton
compiles a kernel on its first launch; caches and allocators warm up too), and
the median of the timed calls resists the odd slow outlier.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from common.bench import sync
from common.demos import Option, RunConfig
from common.progress import progress_bar
from common.report import Report, Table

NOT_TIMED_CPU = "not timed (CPU)"
QUICK = dict(batch_sizes=[1, 2], context_lens=[5, 19], warmup=1, iters=2)   # tests: 4 cells, 1 + 2 calls each
LENGTHS_SEED_STRIDE = 1009   # a prime: every (context, batch) pair draws its own lengths
# The benches' pool. It interleaves layers inside each block ([n_blocks, n_layers, 2, ...]), so two layers
# are enough to read "a layer" that does not start the block.
POOL_LAYERS = 2
LAYER = 1


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
        """`time(fn)` on a GPU; on a CPU the interpreter's time means nothing: NOT_TIMED_CPU."""
        return self.time(fn) if self.on_gpu else NOT_TIMED_CPU


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
