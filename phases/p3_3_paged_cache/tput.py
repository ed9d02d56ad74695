"""The `tput` measurement: KV memory and throughput of several engines on the same requests.

An engine enters the comparison as an `EngineRunner`:

    EngineRunner(name, label, run)
      name   short column prefix ("dyn", "paged", ...)
      label  one line saying what it is (printed under the tables)
      run    run(lm, requests, max_running) -> EngineRun
               requests     list[common.workload.Request], all arriving at once
               max_running  how many sequences the engine may run together
             returns EngineRun(outputs, timings, kv_peak_bytes, note, settings):
               outputs        new token ids per request, in request order
               timings        one common.bench.SeqTiming per request
               kv_peak_bytes  the most KV bytes the engine held at one time
               note           optional line for the table notes
               settings       what the engine ran with (max_running, block size, pool, ...),
                              so a reader can reproduce the row

`measure(lm, runner, requests, max_running)` warms the engine up on the
workload's own shapes (`warm_up`), then times one run and returns a row dict;
`run_tput(cfg, engines)` is the whole demo body (a batch-size sweep over
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

from dataclasses import dataclass, field, replace
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
WARMUP_NEW_TOKENS_CPU = 2   # a CPU warm-up runs the workload's prompts with only this many new tokens each


# --- the runner interface -----------------------------------------------------------------
@dataclass
class EngineRun:
    outputs: list[list[int]]          # new token ids per request, in request order
    timings: list[SeqTiming]          # one per request
    kv_peak_bytes: int                # most KV bytes held at once during the run
    note: str = ""
    settings: dict = field(default_factory=dict)   # what it ran with, JSON-ready: enough to reproduce the row

    @classmethod
    def from_sequences(cls, seqs: list[Sequence], kv_peak_bytes: int, note: str = "",
                       settings: dict | None = None) -> "EngineRun":
        seqs = sorted(seqs, key=lambda s: s.seq_id)
        return cls([list(s.output_ids) for s in seqs], [s.timing for s in seqs], kv_peak_bytes, note,
                   settings or {})


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
    return EngineRun.from_sequences(sched.run(), sched.peak_kv_bytes,
                                    settings=dict(max_running=max_running, kv="one DynamicCache per sequence"))


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
                                    note=f"pool of {n_blocks} blocks x {block_size} tokens",
                                    settings=dict(max_running=max_running, block_size=block_size,
                                                  pool_blocks=n_blocks))


TPUT_ENGINES: list[EngineRunner] = [
    EngineRunner("dyn", "ContinuousScheduler + DynamicCache (p2_3): one forward pass per sequence", run_dynamic),
    EngineRunner("paged", "PagedScheduler + PagedCache (p3_3): one forward pass per sequence, Python gather",
                 run_paged),
]


# --- measuring -----------------------------------------------------------------------------
def _on_cuda(device) -> bool:
    return str(device).startswith("cuda")


def warmup_requests(lm, requests: list[Request]) -> list[Request]:
    """What an engine runs, untimed, before its timed run on `requests`.

    CUDA: the very same requests. Compiled code (HF's static-cache `generate` with
    CUDA graphs, kernel autotuning) is built per shape: batch size, prompt lengths,
    cache length. Only the same requests are sure to give the same shapes, and a
    first call that compiles can take 4x as long as a warm one, or longer.
    CPU: nothing compiles. The same prompts (same batch size and prompt lengths)
    with only WARMUP_NEW_TOKENS_CPU new tokens each warm what there is to warm
    (allocator, lazy initialisation, kernel choice per shape) at a fraction of
    the cost of running everything twice.
    """
    if _on_cuda(lm.device):
        return list(requests)
    return [replace(r, max_new_tokens=min(r.max_new_tokens, WARMUP_NEW_TOKENS_CPU)) for r in requests]


def warmup_rule(device) -> str:
    """One line for the report: how `warm_up` warms an engine on `device`."""
    if _on_cuda(device):
        return "warmed up by one untimed run of the same requests (the shapes compiled code is built for)"
    return (f"warmed up by one untimed run of the same prompts with {WARMUP_NEW_TOKENS_CPU} new tokens each "
            "(CPU: nothing compiles; that covers the prefill's and a decode step's shapes)")


def warm_up(lm, runner: EngineRunner, requests: list[Request], max_running: int) -> None:
    """Run `runner` untimed, with `max_running`, on the workload's own shapes (see `warmup_requests`)."""
    runner.run(lm, warmup_requests(lm, requests), max_running)


def measure(lm, runner: EngineRunner, requests: list[Request], max_running: int, warm: bool = True) -> dict:
    """Warm the engine up on these requests' shapes (`warm_up`; skipped with `warm=False` when it has
    just run them), then run `requests` through it, timed; one row of numbers (JSON-serialisable)."""
    if warm:
        warm_up(lm, runner, requests, max_running)
    warmup = warmup_rule(lm.device) if warm else "warm: an earlier timed run of the same requests"
    start = now(lm.device)
    result = runner.run(lm, requests, max_running)
    wall_s = now(lm.device) - start
    m = summarize(result.timings, wall_s)
    return dict(engine=runner.name, batch_size=max_running, n_seqs=m.n_seqs, total_tokens=m.total_tokens,
                wall_s=wall_s, tok_s=m.total_tok_s, ms_per_tok=m.mean_ms_per_token, ttft_ms=m.mean_ttft_ms,
                kv_peak_bytes=result.kv_peak_bytes, kv_peak_mb=result.kv_peak_bytes / MB,
                outputs=result.outputs, note=result.note, settings=result.settings, warmup=warmup)


def format_settings(settings: dict) -> str:
    """`k=v, k=v`: one engine's settings on one line of table notes."""
    return ", ".join(f"{k}={v}" for k, v in settings.items())


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


def pick_engines(engines: list[EngineRunner], names: list[str] | None,
                 on_request: list[EngineRunner] = ()) -> list[EngineRunner]:
    """The engines named in `names` (all of `engines` when `names` is empty), in the order of
    `engines` then `on_request`. An engine in `on_request` runs only when named."""
    if not names:
        return list(engines)
    known = list(engines) + [e for e in on_request if e.name not in {k.name for k in engines}]
    unknown = set(names) - {e.name for e in known}
    if unknown:
        raise ValueError(f"unknown engine(s) {sorted(unknown)}; this demo has {[e.name for e in known]}")
    return [e for e in known if e.name in names]


def run_tput(cfg: RunConfig, engines: list[EngineRunner], on_request: list[EngineRunner] = ()) -> Report:
    """For each batch size: every engine runs the same requests; KV peak, tok/s, ms/tok side by side.

    `engines` run by default; `on_request` ones only when the `engines` option names them.
    """
    from rich.progress import Progress

    engines = pick_engines(engines, cfg.options.get("engines"), on_request)
    lm = cfg.load()
    batch_sizes, new_tokens = cfg.batch_sizes, cfg.new_tokens
    if cfg.quick:
        batch_sizes, new_tokens = QUICK_BATCH_SIZES, min(new_tokens, QUICK_NEW_TOKENS)
    if not batch_sizes or min(batch_sizes) < 1 or new_tokens < 1:
        raise ValueError(f"batch sizes must be >= 1 and new_tokens >= 1, got {batch_sizes}, {new_tokens}")
    prompts = interleaved_latency_prompts()
    report = cfg.new_report("tput")
    # Each cell is a few seconds of work, so on a shared machine one slow moment moves it a lot.
    # Noise only ever slows a run down: run every cell `repeats` times, interleaved so each
    # engine meets the same moments, and keep the fastest. Every cell's first run is preceded
    # by a warm-up on its own shapes (`measure`); later runs repeat shapes already warm.
    repeats = 1 if cfg.quick else max(1, cfg.options.get("repeats", 1))
    best: dict[tuple[int, str], dict] = {}
    with Progress(transient=True) as progress:
        task = progress.add_task("tput", total=repeats * len(batch_sizes) * len(engines))
        for rep in range(repeats):
            for bs in batch_sizes:
                for engine in engines:
                    progress.update(task, description=f"tput: {engine.name}, batch {bs}, run {rep + 1}/{repeats}")
                    row = measure(lm, engine, tput_requests(prompts, bs, new_tokens), bs, warm=rep == 0)
                    if (bs, engine.name) not in best or row["wall_s"] < best[bs, engine.name]["wall_s"]:
                        best[bs, engine.name] = row
                    progress.advance(task)
    rows = [best[bs, e.name] for bs in batch_sizes for e in engines]
    _tables(report, engines, rows, batch_sizes, new_tokens, repeats, warmup_rule(lm.device))
    report.data = dict(engines=[e.name for e in engines], batch_sizes=batch_sizes, new_tokens=new_tokens,
                       repeats=repeats, warmup=warmup_rule(lm.device),
                       rows=[{k: v for k, v in r.items() if k != "outputs"} for r in rows])
    return report


def kv_unit(largest_bytes: int) -> tuple[str, int]:
    """The unit that shows `largest_bytes` with a few significant digits: GB, MB or KB."""
    for unit, scale in (("GB", 1024 ** 3), ("MB", MB)):
        if largest_bytes >= scale:
            return unit, scale
    return "KB", 1024


def _tables(report: Report, engines: list[EngineRunner], rows: list[dict], batch_sizes: list[int],
            new_tokens: int, repeats: int = 1, warmup: str = "") -> None:
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
    if warmup:
        speed.notes.append(f"every engine at every batch size: {warmup}"
                           + ("; later repeats run on warm shapes" if repeats > 1 else ""))
    for e in engines:
        settings = by[batch_sizes[-1], e.name].get("settings")
        if settings:
            speed.notes.append(f"{e.name} settings at batch {batch_sizes[-1]}: {format_settings(settings)}")


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
