"""The parts of the headline GPU check (measure/gpu_headline.py), most valuable first, each with its time box.

A part is a list of `Step`s, commands run one after another in their own
processes (`python -m common <demo> ...` or `pytest`), and a function that reads
the figures back out of the reports the steps saved. Each step writes into its
own folder, so two runs of one demo (equal work, then mixed) never overwrite
each other, and a step stopped by the box loses only itself.

The boxes (seconds, sized for an H100 from cold caches: model builds, Triton
compiles and HF's static-cache compile included) sum to what one short GPU
window allows. Nothing here imports a phase: engine names are strings, checked
against the phases by tests/test_gpu_headline.py.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from measure.gpu_check import junit_outcomes

# Time boxes (s), in running order. Sum: 435, inside an 8-minute command with slack for the summary. Each box is
# what its steps took on an H200 plus a margin (results/gpu-headline_nvidia-h200_*.md); the batch-1 decode step
# includes compiling HF's static generate. The blog's demos have runs of their own (RUNS, below).
CORRECTNESS_BOX_S = 75
THROUGHPUT_BOX_S = 130
NANO_VLLM_BOX_S = 50
DECODE_STEP_BOX_S = 100
PREFILL_BOX_S = 35
PREFIX_BOX_S = 45

STEP_DIR = "{step_dir}"    # in a step's command: its own folder (reports, junit), filled in when it runs
HEADLINE_ENGINE = "fused_overlap"     # the end of the decode line: fused kernels, CUDA graphs, overlapped steps
DECODE_ENGINE = "p3_11 fused, CUDA graph, overlapped"   # the same engine in fused_bench's step section
HF_CB_CONFIG = "16:1024"   # one generate_batch setting (page size : tokens per batch): each costs a full run
STEP_OVER_GPU_TARGET = 1.3     # a 256-sequence decode step's wall time over its graph's GPU time
BATCH1_OVER_HF_TARGET = 1.5    # a batch-1 step against HF compiled's time per token

# Published tok/s on nano-vllm's bench.py workload (measure/workload.py's nano_vllm_work), each with its hardware.
# "reported" rows are figures quoted for this workload whose original page was not checked here.
NANO_VLLM_PUBLISHED = [
    ("nano-vllm", "RTX 4070 laptop", 1434, "nano-vllm README"),
    ("vLLM", "RTX 4070 laptop", 1362, "nano-vllm README"),
    ("nano-vllm", "A100 40GB", 7660, "vllm.rs docs/performance.md"),
    ("vllm.rs", "A100 40GB", 10978, "vllm.rs docs/performance.md"),
    ("nano-vllm", "A100", 8670, "reported (about)"),
    ("vLLM 0.21", "A100 PCIe", 9530, "reported"),
    ("nano-vllm, Triton fork", "A800", 10009, "reported"),
    ("vLLM", "A800", 8588, "reported"),
]

# The gpu tier's tests the check runs: (what they check, alternatives of substrings a test id must all contain).
# Every kernel case below is in both the CUDA grid and the interpreter's, so a CPU dry run collects each group.
TIER_FILES = ["tests/gpu/test_kernels_gpu.py", "tests/gpu/test_prefill_kernel_gpu.py",
              "tests/gpu/test_engine_p3_10_gpu.py", "tests/gpu/test_engine_p3_11_gpu.py",
              "tests/gpu/test_engines_gpu.py"]
CORRECTNESS_GROUPS = {
    "decode and prefill attention kernels, bf16 and fp32": [("bs16-g8-d128-bf16",), ("bs64-g4-d64-fp32",)],
    "gather and K/V write kernels, bf16 and fp32": [("bs8-d128-bf16",), ("bs64-d64-fp32",)],
    "split-KV decode kernel (p3_9), fp32 and bf16": [("test_tuned_kernel_compiled_equals_reference",)],
    "fused norm, rotary and SwiGLU kernels, fp32 and bf16": [("test_fused_kernels_compiled",)],
    "served engine (p5), graphs on, = HF generate fp32": [("test_engine_equals_hf_generate", "p5")],
    "overlapped graph engine (p3_10) = HF generate fp32": [("test_graph_decode_equals_hf_generate", "None-4096",
                                                           "OverlappedDecodeEngine")],
    "fused overlapped graph engine (p3_11) = HF generate fp32": [("test_fused_graph_decode", "FusedOverlapped")],
}


@dataclass
class Setup:
    device: str      # "cuda", or "cpu" for the dry run
    model: str
    dtype: str
    dry: bool        # every command at its smallest (--quick), the tests collected and not run


@dataclass
class Step:
    name: str
    argv: list[str]          # after the interpreter; STEP_DIR stands for the step's folder
    to_results: bool = False  # reference reports (the blog's demos): also copied into the results folder


@dataclass
class StepResult:
    name: str
    status: str      # ok, failed, refused, timeout, or skipped (the box was spent)
    seconds: float
    folder: Path
    detail: str = ""

    def reports(self) -> list[dict]:
        return [json.loads(p.read_text()) for p in sorted(self.folder.glob("*.json"))]


@dataclass
class Figure:
    figure: str
    target: str
    measured: object
    met: bool | None = None   # None: no target, the figure is there to be read


@dataclass
class Part:
    name: str
    box_s: float
    steps: Callable[[Setup], list[Step]]
    figures: Callable[[list[StepResult], Setup], list[Figure]]
    estimate_s: float | None = None   # what its steps should take on a GPU, where no run has timed them yet


def demo_step(setup: Setup, name: str, demo: str, *options: str, to_results: bool = False) -> Step:
    argv = ["-m", "common", demo, "--device", setup.device, "--model", setup.model, "--dtype", setup.dtype,
            "--results-dir", STEP_DIR, *options, *(["--quick"] if setup.dry else [])]
    return Step(name, argv, to_results)


def data_rows(results: list[StepResult], key: str) -> list:
    """report.data[key] of every report the steps saved (lists extended, dicts appended)."""
    rows = []
    for r in results:
        for report in r.reports():
            value = report.get("data", {}).get(key)
            rows += value if isinstance(value, list) else [value] if value is not None else []
    return rows


def ratio(a: float | None, b: float | None) -> float:
    return a / b if a and b else math.nan


# --- 1. correctness ------------------------------------------------------------------------------------
def correctness_steps(setup: Setup) -> list[Step]:
    expr = " or ".join("(" + " and ".join(alt) + ")" for alts in CORRECTNESS_GROUPS.values() for alt in alts)
    run = ["--collect-only"] if setup.dry else [f"--junitxml={STEP_DIR}/junit.xml"]
    return [Step("tier", ["-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                          *run, *TIER_FILES, "-k", expr])]


def in_group(test_id: str, alternatives: list[tuple[str, ...]]) -> bool:
    return any(all(s in test_id for s in alt) for alt in alternatives)


def correctness_figures(results: list[StepResult], setup: Setup) -> list[Figure]:
    folder = results[0].folder
    if setup.dry:   # the collected ids, one a line
        log = (folder / "output.log").read_text() if (folder / "output.log").exists() else ""
        cases = [(line.strip(), "collected") for line in log.splitlines() if "::" in line]
    else:
        cases = [(test_id, outcome) for test_id, outcome, _ in junit_outcomes(folder / "junit.xml")]
    figures = []
    for group, alternatives in CORRECTNESS_GROUPS.items():
        mine = [outcome for test_id, outcome in cases if in_group(test_id, alternatives)]
        if setup.dry:
            figures.append(Figure(group, "collected", f"{len(mine)} tests", bool(mine)))
        else:
            passed = mine.count("passed")
            met = bool(mine) and passed == len(mine)
            figures.append(Figure(group, "all pass", f"{passed}/{len(mine)} passed", met))
    return figures


# --- 2. throughput on equal and mixed work; 3. nano-vllm's workload ------------------------------------
def throughput_steps(setup: Setup) -> list[Step]:
    return [demo_step(setup, "equal", "fused_workload", "--workloads", "equal",
                      "--engines", HEADLINE_ENGINE, "hf_compiled", "hf_cb", "--hf-cb-configs", HF_CB_CONFIG),
            demo_step(setup, "mixed", "fused_workload", "--workloads", "mixed",
                      "--engines", HEADLINE_ENGINE, "hf_compiled")]


def throughput_figures(results: list[StepResult], setup: Setup) -> list[Figure]:
    figures = []
    for r in results:
        for report in r.reports():
            for work, rows in report["data"].get("results", {}).items():
                figures += [Figure(f"{work} work: {e} tok/s", "-", row["tok_s"]) for e, row in rows.items()]
            for table in report["tables"]:   # workload_bench's targets: workload, comparison, measured, target, met
                if table["columns"][-2:] == ["target", "met"]:
                    figures += [Figure(f"{row[0]}: {row[1]}", row[3], row[2], row[4]) for row in table["rows"]]
    return figures


def nano_vllm_steps(setup: Setup) -> list[Step]:
    return [demo_step(setup, "nano_vllm", "fused_workload", "--workloads", "nano_vllm", "--engines", HEADLINE_ENGINE)]


def nano_vllm_tok_s(results: list[StepResult]) -> float | None:
    rows = [row for row in data_rows(results, "results") if HEADLINE_ENGINE in row.get("nano_vllm", {})]
    return rows[0]["nano_vllm"][HEADLINE_ENGINE]["tok_s"] if rows else None


def nano_vllm_figures(results: list[StepResult], setup: Setup) -> list[Figure]:
    ours = nano_vllm_tok_s(results)
    best = max(tok_s for _, _, tok_s, _ in NANO_VLLM_PUBLISHED)
    return [Figure(f"nano-vllm bench.py work: {HEADLINE_ENGINE} tok/s", "beside the published (table below)",
                   ours or math.nan),
            Figure("... over the best published figure (other GPUs)", "-", ratio(ours, best))]


# --- 4. the decode step: wall time against GPU time ---------------------------------------------------
def decode_step_steps(setup: Setup) -> list[Step]:
    # Batch 256 first: batch 1 also compiles HF generate's static cache, the slowest thing in the part.
    return [demo_step(setup, f"batch_{b}", "fused_bench", "--sections", "step", "--batch-sizes", str(b), *extra)
            for b, extra in ((256, []), (1, ["--hf-new-tokens", "64"]))]


def decode_step_figures(results: list[StepResult], setup: Setup) -> list[Figure]:
    rows = data_rows(results, "step")
    mine = {r["batch"]: r for r in rows if r["engine"] == DECODE_ENGINE}
    hf = next((r for r in rows if r["engine"] == "hf_compiled"), None)
    figures = []
    for batch, r in sorted(mine.items()):
        figures += [Figure(f"decode step, batch {batch}: wall ms", "-", r["ms"]),
                    Figure(f"decode step, batch {batch}: GPU ms (graph replay)", "-", r.get("gpu_ms") or math.nan)]
    big = mine.get(256)
    w = ratio(big["ms"], big.get("gpu_ms")) if big else math.nan
    figures.append(Figure("decode step, batch 256: wall / GPU", f"<= {STEP_OVER_GPU_TARGET}x", w,
                          None if math.isnan(w) else w <= STEP_OVER_GPU_TARGET))
    one = ratio(mine[1]["ms"], hf["ms"]) if 1 in mine and hf else math.nan
    figures.append(Figure("decode step, batch 1: ms/token over HF compiled's", f"<= {BATCH1_OVER_HF_TARGET}x", one,
                          None if math.isnan(one) else one <= BATCH1_OVER_HF_TARGET))
    return figures


# --- 5. prefill; 6. prefix caching; 7. the blog's demos -----------------------------------------------
def prefill_steps(setup: Setup) -> list[Step]:
    return [demo_step(setup, "prefill", "prefill_bench", "--sections", "attention", "latency",
                      "--packs", "1x4096", "16x256", "--prefix", "0")]


def prefill_figures(results: list[StepResult], setup: Setup) -> list[Figure]:
    figures = [Figure(f"prefill attention {r['pack']}, prefix {r['prefix']}: packed varlen / contiguous bound, "
                      "tok/s", "-", ratio(r["tok_s"]["varlen"], r["tok_s"]["bound"]))
               for r in data_rows(results, "attention")]
    for latency in data_rows(results, "latency"):
        names = list(latency)
        figures += [Figure(f"streams' ITL p99 ms as a long prompt arrives: {n}", "-", latency[n]["p99"])
                    for n in names[-2:]]
    return figures


def prefix_steps(setup: Setup) -> list[Step]:
    return [demo_step(setup, "prefix", "prefix_demo", "--shots", "5")]   # few-shot: the highest hit rate


def prefix_figures(results: list[StepResult], setup: Setup) -> list[Figure]:
    runs = {r["caching"]: r for r in data_rows(results, "runs")}
    if set(runs) != {True, False}:
        return [Figure("prefix caching on / off", "-", math.nan)]
    on, off = runs[True], runs[False]
    return [Figure("prefix cache hit rate (few-shot)", "-", on["hit_rate"]),
            Figure("prefix caching on / off: total tok/s", "-", ratio(on["total_tok_s"], off["total_tok_s"])),
            Figure("prefix caching off / on: mean TTFT", "-", ratio(off["mean_ttft_ms"], on["mean_ttft_ms"]))]


PARTS = [
    Part("correctness", CORRECTNESS_BOX_S, correctness_steps, correctness_figures),
    Part("throughput", THROUGHPUT_BOX_S, throughput_steps, throughput_figures),
    Part("nano_vllm", NANO_VLLM_BOX_S, nano_vllm_steps, nano_vllm_figures),
    Part("decode_step", DECODE_STEP_BOX_S, decode_step_steps, decode_step_figures),
    Part("prefill", PREFILL_BOX_S, prefill_steps, prefill_figures),
    Part("prefix_cache", PREFIX_BOX_S, prefix_steps, prefix_figures),
]


# --- two more runs of at most 8 minutes each: the blog's demos (`--run demos`), the paper's (`--run paper`) --
# No GPU run has timed these demos at these sizes, so each box is an estimate: a step's start, plus the forward
# passes it runs at an eager pass's cost, plus any wall-clock time it waits by design; then a margin, since the
# last run's boxes were estimates and three ran out. docs/measured.md gives the runs the two costs come from and
# the estimate of each part. Random weights never stop at EOS, so every sequence runs to its cap: the caps below
# are what keeps a demo inside its box.
PASS_S = 0.04      # one eager forward pass of dummy:qwen3-0.6b (the H100 baseline's latency_demo, rounded up)
START_S = 25.0     # process, model build and warm-up (the H200 headline's batch-256 fused_bench step, rounded up)
BOX_MARGIN = 1.3


@dataclass
class GpuDemo:
    demo: str
    options: list[str]    # its GPU sizes, smaller than its own GPU defaults where those take minutes
    passes: int           # forward passes at these sizes
    waits_s: float = 0.0  # wall-clock time it spends by design (arrivals spread over time)

    @property
    def estimate_s(self) -> float:
        return START_S + self.passes * PASS_S + self.waits_s


# The blog's demos, the cheapest first, so that a run cut short has filled the most cells.
BLOG_DEMOS = [
    GpuDemo("table_demo", ["--max-new-tokens", "128"], 128),              # one sequence, 128 steps
    GpuDemo("waste_demo", [], 200),                                         # one static batch to its cap of 200
    GpuDemo("sweep", ["--new-tokens", "64"], 5 * 64),                       # batch 1, 2, 4, 8, 16
    GpuDemo("decode_sweep", ["--new-tokens", "16", "32", "128"], 2 * 176),  # without, then with the KV cache
    GpuDemo("tput", ["--batch-sizes", "1", "8", "--new-tokens", "32", "--repeats", "1"], 416),  # N passes for 3.3
    GpuDemo("wall", ["--max-new-tokens", "64"], 8 * 64),                    # 8 prompts, one pass per sequence
    GpuDemo("alloc_demo", ["--max-new-tokens", "64"], 8 * 64),              # the same workload
    # the blog's own output lengths x 1/8: 358 static batched steps and 534 single passes
    GpuDemo("latency_demo", ["--lengths", "blog", "--length-scale", "0.125"], 892),
]
# The paper's experiments: a burst against a small pool (7 runs of about 128 steps: the unlimited pool, recompute,
# swap, then both at two block sizes), and Poisson arrivals at two rates for three policies, 10 s each, lengths
# x 1/4 (outputs to about 500 tokens, so each run drains in about 500 steps after its last arrival).
PAPER_DEMOS = [
    GpuDemo("preempt_demo", ["--n-requests", "32", "--prompt-len", "64", "256", "--output-len", "32", "64",
                             "--block-sizes", "16", "64", "--micro-seqs", "8", "--micro-len", "256"], 7 * 128),
    GpuDemo("rate_sweep", ["--scale", "0.25", "--duration-s", "10", "--rates", "2", "4", "--policies", "paged",
                           "oracle", "max"], 6 * 500, waits_s=6 * 10),
]


def demo_part(d: GpuDemo) -> Part:
    def steps(setup: Setup) -> list[Step]:
        return [demo_step(setup, d.demo, d.demo, *d.options, to_results=True)]
    return Part(d.demo, math.ceil(d.estimate_s * BOX_MARGIN), steps, demo_figures, estimate_s=d.estimate_s)


def demo_figures(results: list[StepResult], setup: Setup) -> list[Figure]:
    return [Figure(f"{r.name}: its report", "saved", r.detail or r.status, r.status == "ok") for r in results]


RUNS = {"headline": PARTS, "demos": [demo_part(d) for d in BLOG_DEMOS],
        "paper": [demo_part(d) for d in PAPER_DEMOS]}
