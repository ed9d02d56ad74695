"""The `tput` sweep: for each batch size, every engine runs the same requests; KV peak, tok/s, ms/tok side by side.

A phase's demo hands its engines over as `EngineRunner`s (measure/harness.py):

    @demo("tput", phase="p3_3", options=tput_options(), plot=plot_tput, help=...)
    def tput(cfg):
        return run_tput(cfg, [EngineRunner("dyn", "...", run_dynamic), EngineRunner("paged", "...", run_paged)])

and a later phase takes the demo over with its own engine added
(`@demo("tput", ..., extends="p3_3")`). Every request asks for the same number
of new tokens with EOS ignored, so all engines do exactly the same work and
their tok/s are comparable.
"""

from __future__ import annotations

from itertools import cycle, islice

from common.prompts import interleaved_latency_prompts
from measure.bench import MB
from measure.demos import Option, RunConfig
from measure.harness import EngineRunner, format_settings, measure, pick_engines, warmup_rule
from measure.progress import progress_bar
from measure.report import Report
from measure.workload import Request

TPUT_BATCH_SIZES_CPU = [1, 2, 4, 8]
TPUT_BATCH_SIZES_GPU = [1, 2, 4, 8, 16, 32]   # the blog's table
TPUT_NEW_TOKENS_CPU = 64
TPUT_NEW_TOKENS_GPU = 256
TPUT_REPEATS = 3  # runs per cell, the fastest kept
QUICK_BATCH_SIZES = [1, 2]
QUICK_NEW_TOKENS = 4
KB, GB = 1024, 1024 ** 3


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


def tput_requests(prompts: list[str], n: int, new_tokens: int) -> list[Request]:
    """n requests cycling through `prompts`, each exactly `new_tokens` long (EOS ignored)."""
    return [Request(prompt=p, max_new_tokens=new_tokens, ignore_eos=True) for p in islice(cycle(prompts), n)]


def run_tput(cfg: RunConfig, engines: list[EngineRunner], on_request: list[EngineRunner] = (),
             kv_note: str = "") -> Report:
    """For each batch size: every engine runs the same requests; KV peak, tok/s, ms/tok side by side.

    `engines` run by default; `on_request` ones only when the `engines` option names them.
    `kv_note`: how the engines count their KV bytes (a line under the KV table).
    """
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
    with progress_bar("tput", total=repeats * len(batch_sizes) * len(engines)) as bar:
        for rep in range(repeats):
            for bs in batch_sizes:
                for engine in engines:
                    bar.describe(f"tput: {engine.name}, batch {bs}, run {rep + 1}/{repeats}")
                    row = measure(lm, engine, tput_requests(prompts, bs, new_tokens), bs, warm=rep == 0)
                    if (bs, engine.name) not in best or row["wall_s"] < best[bs, engine.name]["wall_s"]:
                        best[bs, engine.name] = row
                    bar.advance()
    rows = [best[bs, e.name] for bs in batch_sizes for e in engines]
    tput_tables(report, engines, rows, batch_sizes, new_tokens, repeats, warmup_rule(lm.device), kv_note)
    report.data = dict(engines=[e.name for e in engines], batch_sizes=batch_sizes, new_tokens=new_tokens,
                       repeats=repeats, warmup=warmup_rule(lm.device),
                       rows=[{k: v for k, v in r.items() if k != "outputs"} for r in rows])
    return report


def kv_unit(largest_bytes: int) -> tuple[str, int]:
    """The unit that shows `largest_bytes` with a few significant digits: GB, MB or KB."""
    for unit, scale in (("GB", GB), ("MB", MB)):
        if largest_bytes >= scale:
            return unit, scale
    return "KB", KB


def tput_tables(report: Report, engines: list[EngineRunner], rows: list[dict], batch_sizes: list[int],
                new_tokens: int, repeats: int = 1, warmup: str = "", kv_note: str = "") -> None:
    """The KV table and the throughput table, with the notes that say how to read them."""
    by = {(r["batch_size"], r["engine"]): r for r in rows}
    names = [e.name for e in engines]
    unit, scale = kv_unit(max(r["kv_peak_bytes"] for r in rows))
    kv = report.table(f"KV memory held at peak ({unit})", ["batch_size"] + [f"{n}_kv" for n in names])
    speed = report.table(f"Throughput ({new_tokens} new tokens per request, EOS ignored)",
                         ["batch_size"] + [c for n in names for c in (f"{n}_tok/s", f"{n}_ms/step")])
    per_seq = report.table("ms/tok per sequence (a second view of the same runs)",
                           ["batch_size"] + [f"{n}_ms/tok/seq" for n in names])
    for bs in batch_sizes:
        kv.add_row(bs, *[by[bs, n]["kv_peak_bytes"] / scale for n in names])
        speed.add_row(bs, *[x for n in names for x in (by[bs, n]["tok_s"], by[bs, n]["ms_per_step"])])
        per_seq.add_row(bs, *[by[bs, n]["ms_per_tok"] for n in names])
    if kv_note:
        kv.notes.append(kv_note)
    speed.notes.append("tok/s: all generated tokens / wall time; ms/step: wall time of one decode step (every "
                       "running sequence makes one token), the blog's ms/tok"
                       + (f"; each cell the fastest of {repeats} interleaved runs" if repeats > 1 else ""))
    per_seq.notes.append("ms/tok/seq: mean over sequences of (finish - first token) / (tokens - 1). Here every "
                         "sequence runs every step, so it tracks ms/step; they part when sequences do not run "
                         "in lockstep (workload_bench)")
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
    from measure import plots

    d, m = report.data, report.meta
    by_engine = {name: [r for r in d["rows"] if r["engine"] == name] for name in d["engines"]}
    plots.side_by_side(
        png_path, d["batch_sizes"],
        panels={"KV held at peak (MB)": {n: [r["kv_peak_mb"] for r in rows] for n, rows in by_engine.items()},
                "total tok/s": {n: [r["tok_s"] for r in rows] for n, rows in by_engine.items()}},
        xlabel="batch size (max_running)",
        title=f"tput: {m.get('model')} on {m.get('device_name', m.get('device'))}, {m.get('dtype')}, "
              f"{d['new_tokens']} new tokens per request")
