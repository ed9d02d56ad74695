"""`decode_sweep`: phase 0 vs phase 1, one prompt, a growing number of generated tokens.

For each length in `new_tokens`, DECODE_PROMPT is decoded greedily with EOS
ignored (so every row generates exactly that many tokens and the rows compare),
once by each loop. Phase 0's ms/tok grows with the length, because every step
re-reads the whole sequence; phase 1's stays flat. The per-step times of every
run are kept in `report.data` and the plot draws ms/tok against the position.
"""

from __future__ import annotations

import torch

from common.prompts import DECODE_NEW_TOKENS_CPU, DECODE_NEW_TOKENS_GPU, DECODE_PROMPT
from measure.bench import PeakMemory
from measure.demos import Option, RunConfig, demo
from measure.progress import progress_bar
from measure.report import Report
from phases.p0_generate.generate import check_request
from phases.p0_generate.generate import generate_ids as p0_generate_ids
from phases.p1_kv_cache.generate import generate_ids as p1_generate_ids

# (label, phase, table title, generate function). Both take ids and return a GenerationResult.
LOOPS = [
    ("no cache", "p0", "p0: no KV cache (whole sequence every step)", p0_generate_ids),
    ("KV cache", "p1", "p1: KV cache (one token per step)", p1_generate_ids),
]
WARMUP_NEW_TOKENS = 4        # one short run per loop first: kernel selection, allocator growth, lazy imports
QUICK_NEW_TOKENS = [4, 8]    # tests: two rows per table, every code path, a fraction of a second on `tiny`
STEP_MS_DECIMALS = 3         # per-step times saved in the JSON, in ms


def plot_decode_sweep(report: Report, png_path) -> None:
    """ms per decode step against the sequence length, for the longest run of each loop."""
    from measure import plots

    longest = {}
    for run in report.data["runs"]:
        key = f"{run['phase']}: {run['loop']}"
        if key not in longest or run["new_tokens"] > longest[key]["new_tokens"]:
            longest[key] = run
    # Both loops ran the same lengths on the same prompt, so they share the x axis.
    # step_ms[0] is the prefill (the TTFT), not a decode step: plot from step 1.
    positions = next(iter(longest.values()))["positions"][1:]
    series = {key: run["step_ms"][1:] for key, run in longest.items()}
    m = report.meta
    plots.lines(png_path, positions, series, xlabel="sequence length at the step (prompt + generated tokens)",
                ylabel="ms per decode step", marker="",
                title=f"decode_sweep: {m.get('model')} on {m.get('device_name', m.get('device'))}, {m.get('dtype')}")


@demo("decode_sweep", phase="p0/p1",
      help="tok/s, ms/tok, TTFT and peak memory vs generated length, without (p0) and with (p1) a KV cache",
      options=[
          Option("new_tokens", int, cpu=DECODE_NEW_TOKENS_CPU, gpu=DECODE_NEW_TOKENS_GPU, many=True,
                 help="generated lengths to time (EOS ignored, so each run makes exactly this many tokens)"),
          Option("prompt", str, cpu=DECODE_PROMPT, help="the user message (chat template applied)"),
      ],
      plot=plot_decode_sweep)
def decode_sweep(cfg: RunConfig) -> Report:
    # `--threads 1` (a flag of every demo) is steadier on a small shared CPU.
    cfg.use_quick(new_tokens=QUICK_NEW_TOKENS)
    new_tokens = list(cfg.new_tokens)
    if not new_tokens:
        raise ValueError("decode_sweep needs at least one value in --new-tokens")
    lm = cfg.load()
    prompt_ids = lm.prompt_ids(cfg.prompt)
    check_request(lm, prompt_ids, max(new_tokens))  # fail on a bad length before any timing

    report = cfg.new_report("decode_sweep")
    report.data = {"prompt": cfg.prompt, "prompt_tokens": len(prompt_ids), "runs": []}
    columns = ["new_tokens", "tok/s", "ms/tok", "TTFT (ms)", "peak MB"]
    tables = {label: report.table(title, columns) for label, _, title, _ in LOOPS}
    ms_per_token: dict[tuple[str, int], float] = {}

    for *_, generate_ids in LOOPS:
        generate_ids(lm, prompt_ids, WARMUP_NEW_TOKENS, ignore_eos=True)
    with progress_bar("decode_sweep", total=len(new_tokens) * len(LOOPS)) as bar:
        for n in new_tokens:
            for label, phase, _, generate_ids in LOOPS:
                bar.describe(f"{phase} {label}: {n} tokens")
                with PeakMemory(lm.device) as mem:
                    result = generate_ids(lm, prompt_ids, n, ignore_eos=True)
                t = result.timing
                tables[label].add_row(n, result.tok_s, t.ms_per_token, t.ttft_ms, mem.peak_mb)
                ms_per_token[(label, n)] = t.ms_per_token
                report.data["runs"].append({
                    "loop": label, "phase": phase, "new_tokens": n, "positions": result.positions,
                    "step_ms": [round(ms, STEP_MS_DECIMALS) for ms in result.step_ms]})
                bar.advance()

    ratio = report.table("KV cache speedup (same prompt, same lengths)",
                         ["new_tokens", "ms/tok no cache", "ms/tok KV cache", "speedup"])
    for n in new_tokens:
        slow, fast = ms_per_token[("no cache", n)], ms_per_token[("KV cache", n)]
        ratio.add_row(n, slow, fast, f"{slow / fast:.2f}x" if fast > 0 else "-")

    memory_note = ("peak MB: torch.cuda.max_memory_allocated (weights + activations + cache)" if lm.device.startswith("cuda")
                   else "peak MB: process RSS (weights, Python and activations), comparable only within this run")
    ratio.notes += [
        f"prompt: {len(prompt_ids)} tokens (chat template); EOS ignored; one warm-up run per loop first"
        + ("." if lm.device.startswith("cuda") else f"; CPU threads: {torch.get_num_threads()}."),
        "tok/s = tokens / request latency (prefill included); ms/tok = mean decode step after the first token; "
        "TTFT = start to first token (the prefill).",
        memory_note,
    ]
    return report
