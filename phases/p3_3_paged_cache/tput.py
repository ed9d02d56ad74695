"""The `tput` measurement: KV memory and throughput of several engines on the same requests.

An engine enters the comparison as an `EngineRunner`:

    EngineRunner(name, label, run)
      name   short column prefix ("dyn", "paged", ...)
      label  one line saying what it is (printed under the tables)
      run    run(lm, requests, max_running) -> EngineRun
               requests     list[common.workload.Request], all arriving at once
               max_running  how many sequences the engine may run together
             returns EngineRun(outputs, timings, kv_peak_bytes, note):
               outputs        new token ids per request, in request order
               timings        one common.bench.SeqTiming per request
               kv_peak_bytes  the most KV bytes the engine held at one time
               note           optional line for the table notes

`measure(lm, runner, requests, max_running)` times one run and returns a row
dict; `run_tput(cfg, engines)` is the whole demo body (a batch-size sweep over
`engines`, or over those named by the `--engines` option), and `TPUT_ENGINES`
lists this phase's two engines. A later phase
takes over the `tput` demo and adds its own engine like this:

    @demo("tput", phase="p3_5", extends="p3_3", options=tput_options(), plot=plot_tput, help=...)
    def tput(cfg):
        return run_tput(cfg, TPUT_ENGINES + [EngineRunner("batched", "...", run_batched)])

Every request asks for the same number of new tokens with EOS ignored, so all
engines do exactly the same work and their tok/s are comparable.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import cycle, islice
from typing import Callable

from common.bench import MB, SeqTiming, now, summarize
from common.demos import Option, RunConfig
from common.prompts import interleaved_latency_prompts
from common.report import Report
from common.workload import Request
from phases.p2_2_scheduler.sequence import Sequence
from phases.p2_3_continuous_batching.scheduler import ContinuousScheduler
from phases.p3_1_block_allocator.allocator import DEFAULT_BLOCK_SIZE
from phases.p3_3_paged_cache.scheduler import PagedScheduler, blocks_for

TPUT_BATCH_SIZES_CPU = [1, 2, 4, 8]
TPUT_BATCH_SIZES_GPU = [1, 2, 4, 8, 16, 32]   # the blog's table
TPUT_NEW_TOKENS_CPU = 64
TPUT_REPEATS = 3  # runs per cell, the fastest kept
TPUT_NEW_TOKENS_GPU = 256
QUICK_BATCH_SIZES = [1, 2]
QUICK_NEW_TOKENS = 4
WARMUP_NEW_TOKENS = 2


# --- the runner interface -----------------------------------------------------------------
@dataclass
class EngineRun:
    outputs: list[list[int]]          # new token ids per request, in request order
    timings: list[SeqTiming]          # one per request
    kv_peak_bytes: int                # most KV bytes held at once during the run
    note: str = ""

    @classmethod
    def from_sequences(cls, seqs: list[Sequence], kv_peak_bytes: int, note: str = "") -> "EngineRun":
        seqs = sorted(seqs, key=lambda s: s.seq_id)
        return cls([list(s.output_ids) for s in seqs], [s.timing for s in seqs], kv_peak_bytes, note)


@dataclass
class EngineRunner:
    name: str
    label: str
    run: Callable[..., EngineRun] = field(repr=False)   # run(lm, requests, max_running) -> EngineRun


def tput_requests(prompts: list[str], n: int, new_tokens: int) -> list[Request]:
    """n requests cycling through `prompts`, each exactly `new_tokens` long (EOS ignored)."""
    return [Request(prompt=p, max_new_tokens=new_tokens, ignore_eos=True) for p in islice(cycle(prompts), n)]


# --- phase 2.3 and 3.3's engines, with the peak of the KV they hold ------------------------
class PeakKV:
    """Mixin for a `ContinuousScheduler`: remembers the most KV bytes its running sequences held at once.

    Sampled after the forward passes of every step, just before the first
    finished sequence of that step gives its KV back (the moment of most KV).
    """

    peak_kv_bytes = 0

    def held_kv_bytes(self) -> int:
        return sum(self.kv_bytes(s) for s in self.running)

    def _sample_peak(self) -> None:
        self.peak_kv_bytes = max(self.peak_kv_bytes, self.held_kv_bytes())

    def free_kv(self, seq):
        self._sample_peak()
        super().free_kv(seq)

    def step(self):
        finished = super().step()
        self._sample_peak()
        return finished


class DynamicPeakScheduler(PeakKV, ContinuousScheduler):
    pass


class PagedPeakScheduler(PeakKV, PagedScheduler):
    pass


def _submit(sched, lm, requests: list[Request]) -> None:
    for r in requests:
        sched.add(r.ids(lm), r.max_new_tokens, sampling=r.sampling, ignore_eos=r.ignore_eos)


def run_dynamic(lm, requests: list[Request], max_running: int) -> EngineRun:
    """Phase 2.3: continuous batching, one DynamicCache per sequence."""
    sched = DynamicPeakScheduler(lm, max_running)
    _submit(sched, lm, requests)
    return EngineRun.from_sequences(sched.run(), sched.peak_kv_bytes)


def workload_pool_blocks(lm, requests: list[Request], block_size: int) -> int:
    """A pool with room for every request's worst case at once: the pool never makes anyone wait."""
    return sum(blocks_for(len(r.ids(lm)) + r.max_new_tokens - 1, block_size) for r in requests)


def run_paged(lm, requests: list[Request], max_running: int, block_size: int = DEFAULT_BLOCK_SIZE) -> EngineRun:
    """Phase 3.3: the same continuous batching, K/V in one paged pool (PagedCache + Python gather)."""
    n_blocks = workload_pool_blocks(lm, requests, block_size)
    sched = PagedPeakScheduler(lm, max_running, block_size=block_size, n_blocks=n_blocks)
    _submit(sched, lm, requests)
    finished = sched.run()
    assert sched.allocator.n_free == n_blocks, "blocks leaked"
    return EngineRun.from_sequences(finished, sched.peak_kv_bytes,
                                    note=f"pool of {n_blocks} blocks x {block_size} tokens")


TPUT_ENGINES: list[EngineRunner] = [
    EngineRunner("dyn", "ContinuousScheduler + DynamicCache (p2_3): one forward pass per sequence", run_dynamic),
    EngineRunner("paged", "PagedScheduler + PagedCache (p3_3): one forward pass per sequence, Python gather",
                 run_paged),
]


# --- measuring -----------------------------------------------------------------------------
def measure(lm, runner: EngineRunner, requests: list[Request], max_running: int) -> dict:
    """Run `requests` through one engine, timed; one row of numbers (JSON-serialisable)."""
    start = now(lm.device)
    result = runner.run(lm, requests, max_running)
    wall_s = now(lm.device) - start
    m = summarize(result.timings, wall_s)
    return dict(engine=runner.name, batch_size=max_running, n_seqs=m.n_seqs, total_tokens=m.total_tokens,
                wall_s=wall_s, tok_s=m.total_tok_s, ms_per_tok=m.mean_ms_per_token, ttft_ms=m.mean_ttft_ms,
                kv_peak_bytes=result.kv_peak_bytes, kv_peak_mb=result.kv_peak_bytes / MB,
                outputs=result.outputs, note=result.note)


def tput_options() -> list[Option]:
    return [
        Option("batch_sizes", int, cpu=TPUT_BATCH_SIZES_CPU, gpu=TPUT_BATCH_SIZES_GPU, many=True,
               help="requests run together (max_running = batch size)"),
        Option("new_tokens", int, cpu=TPUT_NEW_TOKENS_CPU, gpu=TPUT_NEW_TOKENS_GPU,
               help="new tokens per request (EOS ignored, so every engine does equal work)"),
        Option("engines", str, cpu=[], many=True,
               help="run only these engines, by name (e.g. `--engines dyn paged`); empty = every engine"),
        Option("repeats", int, cpu=TPUT_REPEATS, gpu=TPUT_REPEATS,
               help="runs of every (batch size, engine), interleaved; the fastest is kept"),
    ]


def pick_engines(engines: list[EngineRunner], names: list[str] | None) -> list[EngineRunner]:
    """The engines named in `names`, in the order of `engines` (all of them when `names` is empty)."""
    if not names:
        return list(engines)
    unknown = set(names) - {e.name for e in engines}
    if unknown:
        raise ValueError(f"unknown engine(s) {sorted(unknown)}; this demo has {[e.name for e in engines]}")
    return [e for e in engines if e.name in names]


def run_tput(cfg: RunConfig, engines: list[EngineRunner]) -> Report:
    """For each batch size: every engine runs the same requests; KV peak, tok/s, ms/tok side by side."""
    from rich.progress import Progress

    engines = pick_engines(engines, cfg.options.get("engines"))
    lm = cfg.load()
    batch_sizes, new_tokens = cfg.batch_sizes, cfg.new_tokens
    if cfg.quick:
        batch_sizes, new_tokens = QUICK_BATCH_SIZES, min(new_tokens, QUICK_NEW_TOKENS)
    if not batch_sizes or min(batch_sizes) < 1 or new_tokens < 1:
        raise ValueError(f"batch sizes must be >= 1 and new_tokens >= 1, got {batch_sizes}, {new_tokens}")
    prompts = interleaved_latency_prompts()
    report = cfg.new_report("tput")
    # Warm-up: the first forward passes of a process pay for one-off setup; keep them out of the table.
    for engine in engines:
        engine.run(lm, tput_requests(prompts, 1, WARMUP_NEW_TOKENS), 1)
    # Each cell is a few seconds of work, so on a shared machine one slow moment moves it a lot.
    # Noise only ever slows a run down: run every cell `repeats` times, interleaved so each
    # engine meets the same moments, and keep the fastest.
    repeats = 1 if cfg.quick else max(1, cfg.options.get("repeats", 1))
    best: dict[tuple[int, str], dict] = {}
    with Progress(transient=True) as progress:
        task = progress.add_task("tput", total=repeats * len(batch_sizes) * len(engines))
        for rep in range(repeats):
            for bs in batch_sizes:
                for engine in engines:
                    progress.update(task, description=f"tput: {engine.name}, batch {bs}, run {rep + 1}/{repeats}")
                    row = measure(lm, engine, tput_requests(prompts, bs, new_tokens), bs)
                    if (bs, engine.name) not in best or row["wall_s"] < best[bs, engine.name]["wall_s"]:
                        best[bs, engine.name] = row
                    progress.advance(task)
    rows = [best[bs, e.name] for bs in batch_sizes for e in engines]
    _tables(report, engines, rows, batch_sizes, new_tokens, repeats)
    report.data = dict(engines=[e.name for e in engines], batch_sizes=batch_sizes, new_tokens=new_tokens,
                       repeats=repeats,
                       rows=[{k: v for k, v in r.items() if k != "outputs"} for r in rows])
    return report


def kv_unit(largest_bytes: int) -> tuple[str, int]:
    """The unit that shows `largest_bytes` with a few significant digits: GB, MB or KB."""
    for unit, scale in (("GB", 1024 ** 3), ("MB", MB)):
        if largest_bytes >= scale:
            return unit, scale
    return "KB", 1024


def _tables(report: Report, engines: list[EngineRunner], rows: list[dict], batch_sizes: list[int],
            new_tokens: int, repeats: int = 1) -> None:
    by = {(r["batch_size"], r["engine"]): r for r in rows}
    names = [e.name for e in engines]
    unit, scale = kv_unit(max(r["kv_peak_bytes"] for r in rows))
    kv = report.table(f"KV memory held at peak ({unit})", ["batch_size"] + [f"{n}_kv" for n in names])
    speed = report.table(f"Throughput ({new_tokens} new tokens per request, EOS ignored)",
                         ["batch_size"] + [c for n in names for c in (f"{n}_tok/s", f"{n}_ms/tok")])
    for bs in batch_sizes:
        kv.add_row(bs, *[by[bs, n]["kv_peak_bytes"] / scale for n in names])
        speed.add_row(bs, *[x for n in names for x in (by[bs, n]["tok_s"], by[bs, n]["ms_per_tok"])])
    kv.notes.append("dyn: bytes of the DynamicCache tensors; paged and later: blocks held x bytes per block "
                    "(the last block's unused tail included)")
    speed.notes.append("tok/s: all generated tokens / wall time; ms/tok: mean over sequences of "
                       "(finish - first token) / (tokens - 1)"
                       + (f"; each cell the fastest of {repeats} interleaved runs" if repeats > 1 else ""))
    # Same greedy requests, so every engine should emit the same tokens as the first one.
    for n in names[1:]:
        same = all(by[bs, n]["outputs"] == by[bs, names[0]]["outputs"] for bs in batch_sizes)
        speed.notes.append(f"{n}: outputs {'identical to' if same else 'DIFFER from'} {names[0]}'s")
    for e in engines:
        extra = next((by[bs, e.name]["note"] for bs in reversed(batch_sizes) if by[bs, e.name]["note"]), "")
        speed.notes.append(f"{e.name}: {e.label}" + (f" ({extra} at batch {batch_sizes[-1]})" if extra else ""))


def plot_tput(report: Report, png_path) -> None:
    """Left: KV held at peak; right: tok/s; both against batch size, one line per engine."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = report.data
    fig, (ax_kv, ax_tp) = plt.subplots(1, 2, figsize=(11, 4.5))
    for name in d["engines"]:
        rows = [r for r in d["rows"] if r["engine"] == name]
        xs = [r["batch_size"] for r in rows]
        ax_kv.plot(xs, [r["kv_peak_mb"] for r in rows], marker="o", label=name)
        ax_tp.plot(xs, [r["tok_s"] for r in rows], marker="o", label=name)
    for ax, ylabel in ((ax_kv, "KV held at peak (MB)"), (ax_tp, "total tok/s")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(d["batch_sizes"], [str(b) for b in d["batch_sizes"]])
        ax.set_ylim(bottom=0)  # from zero, so a 5% gap looks like one
        ax.set_xlabel("batch size (max_running)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
    m = report.meta
    fig.suptitle(f"tput: {m.get('model')} on {m.get('device_name', m.get('device'))}, {m.get('dtype')}, "
                 f"{d['new_tokens']} new tokens per request")
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
