"""Phase 2.1 demos: `sweep` (throughput vs batch size) and `waste_demo` (steps carried for nothing).

    python -m common sweep        [--batch-sizes 1 2 4 8 16] [--new-tokens 32]
    python -m common waste_demo   [--max-new-tokens 200]

And `STATIC`, this phase's engine as the measurement harness runs it: a request
list in static batches of `max_running`, one after another, each to its longest row.
"""

from __future__ import annotations

from common.prompts import (SWEEP_BATCH_SIZES, SWEEP_NEW_TOKENS, SWEEP_PROMPT, WASTE_DEMO_MAX_TOKENS,
                            WASTE_DEMO_PROMPTS)
from measure.bench import MB, PeakMemory, summarize
from measure.demos import Option, RunConfig, demo
from measure.harness import EngineRun, EngineRunner
from measure.progress import progress_bar
from measure.report import shorten
from measure.workload import Request
from phases.p2_1_naive_batching.generate import generate_batch

# CPU: 32 new tokens per row keeps the whole sweep around a minute on 2 cores.
SWEEP_NEW_TOKENS_CPU = 32
QUICK_BATCH_SIZES = [1, 2]
QUICK_NEW_TOKENS = 3
QUICK_WASTE_TOKENS = 6
WARMUP_NEW_TOKENS = 2    # one short batch first, so the first row is not paying for lazy init
PROMPT_LABEL_CHARS = 30


def short(text: str) -> str:
    """A prompt as a table cell or a plot label."""
    return shorten(text, PROMPT_LABEL_CHARS, ellipsis="...")


# --- sweep --------------------------------------------------------------------------------
def plot_sweep(report, png_path) -> None:
    from measure.plots import twin_lines
    d = report.data
    twin_lines(png_path, d["batch_size"], ("total tok/s", d["total_tok_s"]), ("ms/step (the blog's ms/tok)", d["ms_per_step"]),
               xlabel="batch size", logx=True,
               title=f"naive batching: same prompt x N ({report.meta.get('model')}, {report.meta.get('device_name')})")


@demo("sweep", phase="p2_1", help="total tok/s and ms per decode step vs batch size (same prompt x N)",
      options=[Option("batch_sizes", int, cpu=SWEEP_BATCH_SIZES, many=True, help="batch sizes to run"),
               Option("new_tokens", int, cpu=SWEEP_NEW_TOKENS_CPU, gpu=SWEEP_NEW_TOKENS,
                      help="new tokens per row (EOS ignored, so every row does the same work)")],
      plot=plot_sweep)
def sweep(cfg: RunConfig):
    cfg.use_quick(batch_sizes=QUICK_BATCH_SIZES, new_tokens=QUICK_NEW_TOKENS)
    sizes, n_new = cfg.batch_sizes, cfg.new_tokens
    lm = cfg.load()
    report = cfg.new_report("sweep")
    table = report.table(f"naive batching: \"{SWEEP_PROMPT}\" x batch_size, {n_new} new tokens each (EOS ignored)",
                         ["batch_size", "total tok/s", "ms/step", "ms/tok (per seq)", "TTFT (ms)", "peak MB", "KV MB"])
    generate_batch(lm, [SWEEP_PROMPT], WARMUP_NEW_TOKENS, ignore_eos=True)
    cols = {k: [] for k in ("batch_size", "total_tok_s", "ms_per_step", "ms_per_tok", "ttft_ms", "peak_mb", "kv_mb")}
    with progress_bar("sweep", total=len(sizes) * n_new) as bar:
        for i, bs in enumerate(sizes):
            with PeakMemory(lm.device) as mem:
                res = generate_batch(lm, [SWEEP_PROMPT] * bs, n_new, ignore_eos=True,
                                     on_step=lambda step, _live, i=i: bar.update(i * n_new + step + 1))
            m = summarize(res.timings, res.wall_s, mem.peak_mb)
            row = (bs, m.total_tok_s, m.ms_per_step, m.mean_ms_per_token, m.mean_ttft_ms, m.peak_mb, res.kv_bytes / MB)
            table.add_row(*row)
            for key, v in zip(cols, row):
                cols[key].append(v)
    report.data.update(cols)
    mem_note = "GPU: torch.cuda.max_memory_allocated" if lm.device.startswith("cuda") else \
        "CPU: peak process RSS (includes the weights and Python)"
    table.notes += [f"peak MB = {mem_note}; KV MB = the shared DynamicCache's K/V bytes at the end.",
                    "ms/step = wall time of one decode step of the batch (every row makes one token), the blog's "
                    "ms/tok; ms/tok (per seq) = mean over rows of (finish - first token) / (tokens - 1), the same "
                    "steps seen from one row, so the two agree here."]
    if len(sizes) > 1:
        lo, hi = 0, len(sizes) - 1
        table.notes.append(
            f"batch {sizes[hi]} vs {sizes[lo]}: total tok/s x{cols['total_tok_s'][hi] / cols['total_tok_s'][lo]:.1f}, "
            f"ms/step x{cols['ms_per_step'][hi] / cols['ms_per_step'][lo]:.1f}")
    return report


# --- waste demo -----------------------------------------------------------------------------
def plot_waste(report, png_path) -> None:
    from measure.plots import hbars_used_and_wasted
    d = report.data
    hbars_used_and_wasted(png_path, [short(p) for p in d["prompts"]], d["steps_needed"], d["steps_wasted"],
                          "steps needed (until its EOS)", "steps carried after it finished (waste)",
                          xlabel="decode steps of the batch",
                          title=f"static batching: the batch ran {d['n_decode_steps']} decode steps "
                                f"({report.meta.get('model')})")


@demo("waste_demo", phase="p2_1", help="per prompt: decode steps needed vs carried on padding in one static batch",
      options=[Option("max_new_tokens", int, cpu=WASTE_DEMO_MAX_TOKENS, help="cap on new tokens per prompt")],
      plot=plot_waste)
def waste_demo(cfg: RunConfig):
    cfg.use_quick(max_new_tokens=QUICK_WASTE_TOKENS)
    cap = cfg.max_new_tokens
    lm = cfg.load()
    report = cfg.new_report("waste_demo")
    with progress_bar("waste_demo", total=cap) as bar:
        res = generate_batch(lm, WASTE_DEMO_PROMPTS, cap, on_step=lambda step, _live: bar.update(step + 1))
    table = report.table(f"one static batch of {len(WASTE_DEMO_PROMPTS)} prompts, cap {cap} new tokens",
                         ["prompt", "steps needed", "steps wasted", "waste %", "finish"])
    for i, p in enumerate(WASTE_DEMO_PROMPTS):
        table.add_row(short(p), res.steps_needed[i], res.steps_wasted[i], res.waste_pct[i], res.finish_reasons[i])
    row_steps = len(WASTE_DEMO_PROMPTS) * res.n_decode_steps
    wasted = sum(res.steps_wasted)
    table.notes.append(f"batch ran for {res.n_decode_steps} decode steps total "
                       f"(after the prefill, which gave each prompt its first token)")
    if row_steps:
        table.notes.append(f"{wasted} of {row_steps} row-steps ({100 * wasted / row_steps:.1f}%) were spent on "
                           f"rows that had already finished")
    report.data.update(prompts=list(WASTE_DEMO_PROMPTS), steps_needed=res.steps_needed,
                       steps_wasted=res.steps_wasted, waste_pct=res.waste_pct, n_decode_steps=res.n_decode_steps,
                       finish_reasons=res.finish_reasons, outputs=res.texts, n_pad=res.n_pad,
                       prompt_tokens=[len(p) for p in res.prompt_ids], wall_s=res.wall_s)
    return report


# --- this phase's engine, as the harness runs it ------------------------------------------------
def run_static(lm, requests: list[Request], max_running: int) -> EngineRun:
    """Static batches of `max_running` requests, one after another, each run to its longest row."""
    outputs, timings, kv_peak = [], [], 0
    for i in range(0, len(requests), max_running):
        chunk = requests[i:i + max_running]
        longest = max(r.max_new_tokens for r in chunk)
        res = generate_batch(lm, [r.ids(lm) for r in chunk], longest, ignore_eos=all(r.ignore_eos for r in chunk))
        for r, out, t in zip(chunk, res.output_ids, res.timings):
            outputs.append(out[: r.max_new_tokens])   # a row carried past its request's length: cut back
            timings.append(t.first(r.max_new_tokens))
        kv_peak = max(kv_peak, res.kv_bytes)
    return EngineRun(outputs, timings, kv_peak, note="every row of a batch runs to the batch's longest",
                     settings=dict(max_running=max_running, kv="one left-padded DynamicCache per batch"))


STATIC = EngineRunner("static", "generate_batch (p2_1): static padded batches of max_running", run_static)
