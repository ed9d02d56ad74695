"""The "blog vs ours" table of every phase README: the blog's figure, ours on the CPU, ours on a GPU.

Each phase lists the figures it can be compared on. A figure of ours is never typed in: it is
looked up in a results/ report (a markdown table cell, by the table's title, the row's leading
cells and the column's name), and the report's own header gives the device, model and commit
printed under the table. `scripts/sync_readme_tables.py` writes the tables into the READMEs
between `<!-- blog-vs-ours: <phase folder> -->` and `<!-- /blog-vs-ours -->`, and with `--check`
fails when a README's table no longer equals what the reports say.

The blog's figures are constants copied from the blog post (../shared/seeds, "Inference Engines
2/N"); it ran Qwen on a Modal GPU and does not name the card. Where the blog has no figure for a
phase (it stops at a sketch of the gather kernel), the blog column says what it claims instead.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))        # run as a script: measure/ is the repo's, beside scripts/
from measure.report import read_markdown  # noqa: E402

RESULTS = ROOT / "results"
NOT_RUN = "not run yet"


@dataclass(frozen=True)
class Cell:
    """One figure of a results/ report: the table whose title contains `table`, the row whose leading
    cells are `row`, the column named `col`."""
    report: str          # path under results/, without .md
    table: str
    row: tuple[str, ...]
    col: str


@dataclass(frozen=True)
class Note:
    """One figure in a report's notes: the first match of `pattern`'s group 1 in a line under a table."""
    report: str
    pattern: str


@dataclass(frozen=True)
class Figure:
    what: str            # what is compared, in words
    blog: str            # the blog's number (or claim), verbatim
    cpu: Cell | Note | str | None      # a str: why there is no figure (it is printed as is); None: not run yet
    gpu: Cell | Note | str | None
    unit: str = ""       # appended as is (" MB", "%") to each of our looked-up figures: the blog's carry theirs


@dataclass(frozen=True)
class Comparison:
    figures: list[Figure]
    why: str             # one sentence: where the shape differs from the blog's, and why
    reference: str = "blog (GPU, Qwen)"   # the head of the column the blog's figures (or claims) sit in
    source: str = ""     # appended to the opening line: where figures that are not the blog's come from


def read_tables(report: str) -> tuple[dict, dict[str, list[list[str]]]]:
    """A report's header fields and its tables ({title: [header row, body rows...]})."""
    return read_markdown(RESULTS / f"{report}.md")


def lookup(cell: Cell | Note) -> tuple[str, dict]:
    """The text of one cell, and its report's header; KeyError naming what is missing."""
    header, tables = read_tables(cell.report)
    if isinstance(cell, Note):
        for line in (RESULTS / f"{cell.report}.md").read_text().splitlines():
            m = re.search(cell.pattern, line.strip())
            if m:
                return m.group(1), header
        raise KeyError(f"results/{cell.report}.md: no line matches {cell.pattern!r}")
    titles = [t for t in tables if cell.table in t]
    if len(titles) != 1:
        raise KeyError(f"results/{cell.report}.md: {len(titles)} tables titled like {cell.table!r}")
    head, *body = tables[titles[0]]
    if cell.col not in head:
        raise KeyError(f"results/{cell.report}.md: no column {cell.col!r} in {titles[0]!r}")
    rows = [r for r in body if tuple(r[:len(cell.row)]) == cell.row]
    if len(rows) != 1:
        raise KeyError(f"results/{cell.report}.md: {len(rows)} rows {cell.row} in {titles[0]!r}")
    return rows[0][head.index(cell.col)], header


def render(comparison: Comparison) -> str:
    """The markdown block: the table, then where each of our figures comes from, then why shapes differ."""
    lines = ["The blog's figures are copied from the post (Qwen on a Modal GPU it does not name); ours are looked "
             "up in `results/` by `scripts/sync_readme_tables.py` (which figures: `scripts/blog_vs_ours.py`)."
             + comparison.source, "",
             f"| figure | {comparison.reference} | ours, CPU | ours, GPU |", "|---|---:|---:|---:|"]
    sources: dict[str, dict] = {}
    for f in comparison.figures:
        cells = []
        for cell in (f.cpu, f.gpu):
            if cell is None or isinstance(cell, str):
                cells.append(cell or NOT_RUN)
                continue
            text, header = lookup(cell)
            sources[cell.report] = header
            cells.append(text + f.unit)
        lines.append(f"| {f.what} | {f.blog} | {cells[0]} | {cells[1]} |")
    lines.append("")
    for report, h in sources.items():
        lines.append(f"- `results/{report}.md`: `{h['demo']}`, {h['model']} on {h['device']}, {h['dtype']}, "
                     f"commit {h['commit']}  ")
    lines += ["", comparison.why]
    return "\n".join(lines)


# --- the comparisons, phase by phase ---------------------------------------------------------
# A Cell's row or column names an engine or kernel as the report printed it. Reports recorded before the
# phases were renumbered say p3_5 for the batched engine (3.6 today), p3_6 for the chunked one (3.8), p3_7 for the
# tuned kernel (3.9) or, earlier still, the static graph engine (3.10), and p3_8 for the fused one (3.11).
CPU, H100 = "cpu_smollm2-135m", "nvidia-h100-80gb-hbm3_dummy-qwen3-0.6b"
BASE = "gpu-baseline/"      # the H100 run of the demos on an earlier tree (see results/gpu-baseline/README.md)
P3_3_TPUT = f"p3_3/tput_{CPU}"   # `tput` with phase 3.3's two engines only, the run its README discusses
BLOG_LENGTHS = "latency_demo_blog_lengths/"   # `latency_demo --lengths blog`: the blog's output lengths
SHARE_SWEEP = "share_sweep/"    # `share_sweep --kinds sampling` and `--kinds beam`, one folder each
# The headline check's batch-1 decode step on an H200 (make gpu-headline, its second run)
H200_PREFILL = "gpu-headline_nvidia-h200_dummy-qwen3-0.6b/prefill/prefill/prefill-bench_nvidia-h200_dummy-qwen3-0.6b"
PREFILL_ITL = r"p99 ITL, whole prompts / chunks: ([\d.]+)x lower"
H200_PREFIX = ("gpu-headline_nvidia-h200_dummy-qwen3-0.6b_wider-boxes/prefix_cache/prefix/"
               "prefix-demo_nvidia-h200_dummy-qwen3-0.6b")
H200_BATCH_1 = ("gpu-headline_nvidia-h200_dummy-qwen3-0.6b_wider-boxes/decode_step/batch_1/"
                "fused-bench_nvidia-h200_dummy-qwen3-0.6b")


def cpu(demo: str, table: str, row: tuple, col: str, report: str | None = None) -> Cell:
    return Cell(report or f"{demo}_{CPU}", table, tuple(str(x) for x in row), col)


def gpu(demo: str, table: str, row: tuple, col: str, report: str | None = None) -> Cell:
    return Cell(report or f"{BASE}{demo}_{H100}", table, tuple(str(x) for x in row), col)


def blog_len(seq: int, col: str) -> Cell:
    """A cell of the CPU's `latency_demo --lengths blog` run (each request the blog's length, EOS ignored)."""
    return Cell(f"{BLOG_LENGTHS}latency-demo_{CPU}", "the blog's lengths", (str(seq),), col)


P2_3_WHY = (
    "With the blog's output lengths (EOS ignored; a quarter of each on the CPU) the short prompts win as in the "
    "blog, 20-49x against its 15-36x: what sets the win is how much longer the answers beside a short one are. "
    "With our model's own answers they win less or lose: SmolLM2 answers \"What is 2 + 2?\" with 107 tokens, the "
    "long answers stop at the cap of 128, where the blog's ran 443-1,592 steps, and \"Name one fruit.\" waits in "
    "the queue behind a long one. The GPU column is the H100 baseline (random weights never stop at EOS, cap 128), "
    "so every row runs the cap and continuous batching (one pass per sequence) only loses; this table has no GPU "
    "run of the blog's own experiment (`--lengths blog`, full length).")


COMPARISONS: dict[str, Comparison] = {
    "p0_generate": Comparison([
        Figure("ms/tok without a cache, 16 new tokens", "part 0/N (not in our seeds)",
               cpu("decode-sweep", "no KV cache", (16,), "ms/tok"), None),
        Figure("ms/tok without a cache, 128 new tokens", "part 0/N (not in our seeds)",
               cpu("decode-sweep", "no KV cache", (128,), "ms/tok"), None),
    ], "Without a cache every step re-reads the whole sequence, so ms/tok grows with the length; the "
       "blog post we follow starts after this phase, so it has no figure to set beside ours."),
    "p1_kv_cache": Comparison([
        Figure("ms/tok with a KV cache, 32 new tokens", "32.78",
               cpu("decode-sweep", "p1: KV cache", (32,), "ms/tok"), None),
        Figure("ms/tok with a KV cache, 128 new tokens", "32.57",
               cpu("decode-sweep", "p1: KV cache", (128,), "ms/tok"), None),
        Figure("TTFT (ms), 128 new tokens", "34",
               cpu("decode-sweep", "p1: KV cache", (128,), "TTFT (ms)"), None),
    ], "Flat in both: with a cache each step feeds one token, whatever the length; our CPU step is slower "
       "than the blog's GPU step in absolute terms (2 cores, bf16)."),
    "p2_1_naive_batching": Comparison([
        Figure("total tok/s, batch 1", "25.7",
               cpu("sweep", "naive batching", (1,), "total tok/s"), gpu("sweep", "naive batching", (1,), "total tok/s")),
        Figure("total tok/s, batch 16", "411.4",
               cpu("sweep", "naive batching", (16,), "total tok/s"), gpu("sweep", "naive batching", (16,), "total tok/s")),
        Figure("ms/step (the blog's ms/tok), batch 1", "38.89",
               cpu("sweep", "naive batching", (1,), "ms/step"), gpu("sweep", "naive batching", (1,), "ms/tok (per seq)")),
        Figure("ms/step (the blog's ms/tok), batch 16", "38.89",
               cpu("sweep", "naive batching", (16,), "ms/step"), gpu("sweep", "naive batching", (16,), "ms/tok (per seq)")),
        Figure("waste demo: decode steps the batch ran", "199",
               cpu("waste-demo", "one static batch", ("Explain in detail how the a...",), "steps needed"), None),
        Figure("waste demo: % of \"capital of France\"'s steps wasted", "95.0%",
               cpu("waste-demo", "one static batch", ("What is the capital of France?",), "waste %"), None),
    ], "On the GPU, as in the blog, a step costs about the same at batch 1 and 16, so throughput grows with "
       "the batch; on 2 CPU cores a step of 16 rows is compute-bound and takes longer, so throughput grows less. "
       "The GPU's ms/step column is the older per-sequence figure, which equals ms/step in a lockstep batch."),
    "p2_2_scheduler": Comparison([
        Figure("static batching: first batch's results back (ms)", "45,288",
               cpu("latency-demo", "8 requests", ("0",), "static ms"), gpu("latency-demo", "8 requests", ("0",), "static ms")),
        Figure("static batching: second batch's results back (ms)", "115,074",
               cpu("latency-demo", "8 requests", ("4",), "static ms"), gpu("latency-demo", "8 requests", ("4",), "static ms")),
    ], "The scheduler alone changes no number (the blog shows none); these are its static batches in "
       "`latency_demo`, shorter than the blog's because our answers stop at 128 tokens, where the blog's long ones "
       "ran 443-1,592 steps: the CPU's cap, and the GPU run's too (it predates the GPU default of 2048)."),
    "p2_3_continuous_batching": Comparison([
        Figure("speedup, \"capital of France\" (short), the blog's lengths (CPU: x 1/4)", "35.9x",
               blog_len(0, "speedup"), None),
        Figure("speedup, \"Is Python interpreted...\" (short), the blog's lengths", "14.9x",
               blog_len(2, "speedup"), None),
        Figure("speedup, \"What is 2 + 2?\" (short), the blog's lengths", "28.6x",
               blog_len(4, "speedup"), None),
        Figure("speedup, \"Name one fruit.\" (short), the blog's lengths", "26.7x",
               blog_len(6, "speedup"), None),
        Figure("speedup, \"Explain in detail...\" (long), the blog's lengths", "0.4x",
               blog_len(1, "speedup"), None),
        Figure("speedup, \"capital of France\", our model's own answers (to EOS, cap 128)", "35.9x",
               cpu("latency-demo", "8 requests", ("0",), "speedup"), gpu("latency-demo", "8 requests", ("0",), "speedup")),
        Figure("speedup, \"What is 2 + 2?\", our model's own answers", "28.6x",
               cpu("latency-demo", "8 requests", ("4",), "speedup"), gpu("latency-demo", "8 requests", ("4",), "speedup")),
        Figure("steps, \"What is 2 + 2?\", our model's own answers", "23",
               cpu("latency-demo", "8 requests", ("4",), "steps"), gpu("latency-demo", "8 requests", ("4",), "steps")),
        Figure("steps, \"Explain in detail...\", our model's own answers", "1269",
               cpu("latency-demo", "8 requests", ("1",), "steps"), gpu("latency-demo", "8 requests", ("1",), "steps")),
        Figure("wall: KV reserved by StaticCache, 32 sequences", "5.62G",
               cpu("wall", "KV memory", (32,), "static KV (MB)"), None, unit=" MB"),
        Figure("wall: % of the reservation wasted, 32 sequences", "73.9%",
               cpu("wall", "KV memory", (32,), "wasted %"), None, unit="%"),
    ], P2_3_WHY),
    "p3_1_block_allocator": Comparison([
        Figure("blocks for \"capital of France\"", "2 (29 tokens)",
               cpu("alloc-demo", "Per sequence", ("0",), "paged blocks"), None),
        Figure("blocks for \"Explain in detail...\"", "81 (1295 tokens)",
               cpu("alloc-demo", "Per sequence", ("1",), "paged blocks"), None),
        Figure("blocks a static reservation takes per sequence", "128",
               cpu("alloc-demo", "Per sequence", ("1",), "static blocks"), None),
        Figure("pool capacity (blocks)", "7730",
               cpu("alloc-demo", "KV pool", ("2912",), "blocks"), None),
    ], "Same arithmetic (tokens / 16, rounded up); our long answer stops at 128 tokens, and our CPU pool is sized "
       "from a stated 1 GiB budget, not 80% of a GPU's free memory."),
    "p3_2_block_table": Comparison([
        Figure("prompt tokens of the walked-through sequence", "24",
               cpu("table-demo", "One sequence", (), "prompt tokens"), None),
        Figure("tokens generated", "61",
               cpu("table-demo", "One sequence", (), "generated"), None),
        Figure("blocks held at the end", "6 (85 tokens)",
               cpu("table-demo", "One sequence", (), "blocks"), None),
        *[Figure(f"Fig. 18b: block sizes within 10% of the best, {name}-like lengths (x 1/16)",
                 f"beyond the blog (vLLM paper: {lo}-{hi}, x 1/16: {lo // 16}-{hi // 16})",
                 cpu("block-sweep", "Best block size", (data, "recompute"), "within 10% of it"), None)
          for data, name, lo, hi in (("sharegpt", "ShareGPT", 16, 128), ("alpaca", "Alpaca", 16, 32))],
    ], "A different prompt and a 128-token cap give a longer walk; block by block it is the same table. The "
       "block-size rows are phase 4.4's `block_sweep` (it needs preemption), at one request rate with lengths "
       "and pool scaled by 1/16, so our block of b tokens holds what the paper's block of 16b does. On "
       "Alpaca-like lengths the pool stayed far from full, so that row's match with the paper's says little.",
       reference="blog (GPU, Qwen) or vLLM paper (OPT-13B, A100)",
       source=" The paper's are from its text (§7.2)."),
    "p3_3_paged_cache": Comparison([
        Figure("dyn total tok/s, batch 1", "33.0",
               cpu("tput", "Throughput", ("1",), "dyn_tok/s", report=P3_3_TPUT), None),
        Figure("paged total tok/s, batch 1", "32.1",
               cpu("tput", "Throughput", ("1",), "paged_tok/s", report=P3_3_TPUT), None),
        Figure("dyn total tok/s, batch 8", "37.5",
               cpu("tput", "Throughput", ("8",), "dyn_tok/s", report=P3_3_TPUT), None),
        Figure("paged total tok/s, batch 8", "32.7",
               cpu("tput", "Throughput", ("8",), "paged_tok/s", report=P3_3_TPUT), None),
        Figure("DynamicCache: MB copied to grow one sequence to 537 tokens", "\"every decode step\" (no figure)",
               cpu("grow-demo", "one sequence growing", ("DynamicCache (torch.cat)", "537"), "copied to grow MB"), None),
        Figure("PagedCache: MB copied to grow it", "none (the claim)",
               cpu("grow-demo", "one sequence growing", ("PagedCache (pool of 16-token blocks)", "537"),
                   "copied to grow MB"), None),
    ], "Total tok/s is the same measure on both sides (all tokens / wall time), and both stay flat in the batch: "
       "each step runs one forward pass per sequence. The blog's ms/tok column (30.3 ms at batch 1, 26.7 at 8) is "
       "not set beside ours because it is a different measure: 1000 / its tok/s, the time of one forward pass, "
       "where our ms/tok is one sequence's time per token, which grows with the batch (the `tput` "
       "table on the measurements page). Ours are from the bf16, one-thread run that page quotes."),
    "p3_4_gather_kernel": Comparison([
        Figure("Python gather / one batched gather (CPU: torch indexing, GPU: the kernel), batch 8 x 2048",
               "\"horribly slow\" (no figure)",
               cpu("gather-bench", "gather one layer", ("8", "2048"), "python/ref"),
               gpu("gather-bench", "gather one layer", ("8", "2048"), "python/kernel")),
        Figure("... batch 64 x 8192", "\"horribly slow\" (no figure)", "not in the CPU sweep",
               gpu("gather-bench", "gather one layer", ("64", "8192"), "python/kernel")),
        Figure("pad + stack / N calls, batch 1", "> 1 \"in the common case\"",
               cpu("stack-bench", "one decode step", ("1",), "stack / N calls"), None),
        Figure("pad + stack / N calls, batch 8", "> 1 \"in the common case\"",
               cpu("stack-bench", "one decode step", ("8",), "stack / N calls"), None),
    ], "On a CPU the kernel only runs in Triton's interpreter, so the gather's CPU figure is against torch "
       "indexing. The blog's claim that pad-and-stack loses holds on the CPU only at batch 1: from two sequences "
       "on, one batched pass beats N passes, padding included. The blog's claim is about a GPU; this table "
       "has no GPU run of `stack_bench`."),
    "p3_5_paged_attention": Comparison([
        Figure("decode attention, batch 8 x 512 tokens: the CPU path (gather + bmm), ms", "beyond the blog",
               cpu("attn-bench", "decode attention, one layer", ("8", "512"), "CPU path ms"),
               gpu("attn-bench", "decode attention, one layer", ("8", "512"), "CPU path ms")),
        Figure("... SDPA over contiguous K/V, ms", "beyond the blog",
               cpu("attn-bench", "decode attention, one layer", ("8", "512"), "SDPA ms"),
               gpu("attn-bench", "decode attention, one layer", ("8", "512"), "SDPA ms")),
        Figure("decode attention, batch 32 x 2,048 tokens: kernel / SDPA", "beyond the blog",
               "the interpreter: checked, not timed",
               gpu("attn-bench", "decode attention, one layer", ("32", "2048"), "kernel/SDPA")),
        Figure("decode attention, batch 1 x 512 tokens: kernel / SDPA", "beyond the blog",
               "the interpreter: checked, not timed",
               gpu("attn-bench", "decode attention, one layer", ("1", "512"), "kernel/SDPA")),
    ], "The blog sketches a gather kernel and stops; this phase's kernel reads the pool in place instead. On a CPU "
       "the kernel runs only in Triton's interpreter, so it is checked there and timed on the GPU."),
    "p3_6_batched_engine": Comparison([
        Figure("equal work: batched engine tok/s", "beyond the blog",
               cpu("workload-bench", "equal work", ("batched",), "total tok/s"),
               gpu("workload-bench", "equal work", ("batched",), "total tok/s")),
        Figure("equal work: HF static padded generate tok/s", "beyond the blog",
               cpu("workload-bench", "equal work", ("hf_static",), "total tok/s"),
               gpu("workload-bench", "equal work", ("hf_static",), "total tok/s")),
        Figure("mixed work: batched engine tok/s", "beyond the blog",
               cpu("workload-bench", "mixed work", ("batched",), "total tok/s"),
               gpu("workload-bench", "mixed work", ("batched",), "total tok/s")),
    ], "The blog stops at a sketch of the gather kernel; this phase is the batched forward pass it points to. "
       "The GPU figures are the baseline before phases 3.7-3.10 (prefill looped over sequences, decode host-bound); "
       "that run timed HF's padded generate cold, before engines were warmed up (6,885 tok/s warm)."),
    "p3_7_varlen_prefill": Comparison([
        Figure("one layer's attention, 32 prompts: varlen / loop", "beyond the blog",
               cpu("prefill-bench", "prefill attention", ("32x16-128", "0"), "varlen / loop"), None),
        Figure("one layer's attention, 16 prompts of 256 tokens: varlen / loop", "beyond the blog",
               "not run at this shape on the CPU",
               Cell(H200_PREFILL, "prefill attention", ("16x256", "0"), "varlen / loop")),
    ], "On the CPU one call for the pack saves little over a loop of SDPA calls; on the H200, where each call's "
       "launch is the cost, 16 prompts in one call beat the loop."),
    "p3_8_chunked_prefill": Comparison([
        Figure("whole prefill pass, 16 prompts of 8-64 tokens: chunked (3.8) / batched (3.6)", "beyond the blog",
               cpu("prefill-bench", "whole prefill pass", ("16x8-64", "0"), "p3_6 / p3_5"), None),
        Figure("... after a 256-token cached prefix", "beyond the blog",
               cpu("prefill-bench", "whole prefill pass", ("16x8-64", "256"), "p3_6 / p3_5"), None),
        Figure("streams' p99 gap between tokens as a long prompt arrives: whole prompt / chunks", "beyond the blog",
               Note(f"prefill-bench_{CPU}", PREFILL_ITL), Note(H200_PREFILL, PREFILL_ITL), unit="x"),
    ], "The whole pass compares the batched engine's prefill (SDPA per segment per layer) with one varlen call "
       "per layer; the report names them p3_5 and p3_6, as numbered then. The streams' rows: 4 streams and a "
       "512-token prompt on the CPU, 32 streams and 8,192 tokens on the GPU."),
    "p3_9_tuned_decode_kernel": Comparison([
        Figure("decode attention, batch 256 x 2,048 tokens: K/V read (GB/s)", "beyond the blog",
               "the interpreter: checked, not timed",
               Cell(f"graph-bench_{H100}", "decode attention, one layer", ("256", "2048"), "p3_7 GB/s")),
        Figure("... as a share of the datasheet's HBM bandwidth", "beyond the blog", "-",
               Cell(f"graph-bench_{H100}", "decode attention, one layer", ("256", "2048"), "% of HBM"), unit="%"),
        Figure("... this kernel's time / SDPA's on contiguous K/V", "beyond the blog", "-",
               Cell(f"graph-bench_{H100}", "decode attention, one layer", ("256", "2048"), "p3_7/SDPA")),
        Figure("... phase 3.5's kernel's time / SDPA's", "beyond the blog", "-",
               Cell(f"graph-bench_{H100}", "decode attention, one layer", ("256", "2048"), "p3_5/SDPA")),
    ], "The blog's kernel stops at a gather; these are one layer's decode attention on the H100, per call with "
       "the launch included, before the merge became one Triton launch (the measurements page says how kernels "
       "are timed)."),
    "p3_10_cuda_graphs": Comparison([
        Figure("equal work: CUDA-graph engine tok/s", "beyond the blog",
               Cell(f"graph-workload_{CPU}", "equal work", ("graphs",), "total tok/s"),
               Cell(f"graph-workload_{H100}", "equal work", ("graphs",), "total tok/s")),
        Figure("equal work: HF static generate, compiled, tok/s", "beyond the blog",
               "no CPU path (transformers compiles on CUDA)",
               Cell(f"graph-workload_{H100}", "equal work", ("hf_compiled",), "total tok/s")),
        Figure("mixed work: CUDA-graph engine tok/s", "beyond the blog",
               Cell(f"graph-workload_{CPU}", "mixed work", ("graphs",), "total tok/s"),
               Cell(f"graph-workload_{H100}", "mixed work", ("graphs",), "total tok/s")),
        Figure("decode step, batch 1, CUDA graph (ms)", "the blog's flat ms/tok", "no CUDA graphs on a CPU",
               Cell(f"graph-bench_{H100}", "one decode step", ("1", "p3_7 static, CUDA graph"), "ms/step")),
        Figure("decode step, batch 256, CUDA graph (ms)", "the blog's flat ms/tok", "no CUDA graphs on a CPU",
               Cell(f"graph-bench_{H100}_batch-256-64", "one decode step", ("256", "p3_7 static, CUDA graph"),
                    "ms/step")),
        Figure("equal work, bf16: served engine tok/s, CPU step off", "beyond the blog",
               cpu("vllm-cpu-peer", "Same requests", ("equal", "served-plain"), "tok/s"), "a GPU replays graphs"),
        Figure("equal work, bf16: served engine tok/s, CPU step on", "beyond the blog",
               cpu("vllm-cpu-peer", "Same requests", ("equal", "served"), "tok/s"), "a GPU replays graphs"),
    ], "On the CPU graphs do not exist and the static step runs eagerly; in bf16 its CPU counterpart (weights "
       "packed once, decode attention compiled to read the pool in place) is what the last two rows compare, in "
       "vllm_cpu_peer's run. On the H100 the step stays at 5.6-7.8 ms from batch 1 to 128, the blog's flat ms/tok, "
       "until the host's per-sequence work shows at 256."),
    "p3_11_fused_ops": Comparison([
        Figure("kernels per decode step, phase 3.10's static step", "beyond the blog",
               Cell("fused-bench_cpu_dummy-qwen3-0.6b", "kernels launched by one decode step",
                    ("1", "p3_7 static step"), "kernels"), None),
        Figure("kernels per decode step, fused", "beyond the blog",
               Cell("fused-bench_cpu_dummy-qwen3-0.6b", "kernels launched by one decode step",
                    ("1", "p3_8 fused step"), "kernels"), None),
        Figure("decode step, batch 1, fused CUDA graph (ms)", "the blog's flat ms/tok", "no CUDA graphs on a CPU",
               Cell(H200_BATCH_1, "one decode step", ("1", "p3_8 fused, CUDA graph"), "ms/step")),
    ], "The blog stops before kernels per step matter; the counts are Qwen3-0.6B's step as its Python launches it, "
       "counted on the CPU (both include 112 slot checks that run only there); what fewer kernels buy in time on "
       "a GPU is in the H200 check of docs/measured.md."),
    "p4_1_copy_on_write": Comparison([
        Figure("distinct blocks after the prefill and the fork", "beyond the blog",
               Note(f"cow-demo_{CPU}", r"^(\d+) distinct blocks held; \d+ if"),
               Note(f"{BASE}cow-demo_{H100}", r"^(\d+) distinct blocks held; \d+ if")),
        Figure("... if every sample had its own copy", "beyond the blog",
               Note(f"cow-demo_{CPU}", r"^\d+ distinct blocks held; (\d+) if"),
               Note(f"{BASE}cow-demo_{H100}", r"^\d+ distinct blocks held; (\d+) if")),
        Figure("blocks copied by copy-on-write in the whole run", "beyond the blog",
               Note(f"cow-demo_{CPU}", r"copied by copy-on-write in the whole run: (\d+)"),
               Note(f"{BASE}cow-demo_{H100}", r"copied by copy-on-write in the whole run: (\d+)")),
    ], "The blog's engine gives each sequence its own blocks; sharing the prompt is the vLLM paper's next "
       "step. The GPU run forks 4 samples where the CPU default forks 3, so it holds and copies one more block."),
    "p4_2_beam_search": Comparison([
        Figure("parallel sampling, n = 4: KV saved (run average)", "beyond the blog",
               cpu("share-demo", "Memory saved by sharing", ("parallel sampling", "4"), "saving (run avg)"), None),
        Figure("beam search, k = 4: KV saved (run average)", "beyond the blog",
               cpu("share-demo", "Memory saved by sharing", ("beam search", "4"), "saving (run avg)"), None),
        *[Figure(f"Fig. 14: rate sustained, paged / Orca (Oracle), {what} {w}",
                 "beyond the blog (vLLM paper: " + ("2.3x)" if (kind, w) == ("beam", 6) else f"grows with {grows})"),
                 Cell(f"{SHARE_SWEEP}{kind}/share-sweep_{CPU}", "Highest rate sustained", (kind, str(w)),
                      "paged / Orca"), None)
          for kind, what, grows in (("sampling", "samples, n =", "n"), ("beam", "beam width", "width"))
          for w in (4, 6)],
    ], "The vLLM paper (its section 6.3) is the figure to compare with, and `share_demo` prints it beside ours; "
       "this table has no GPU run of it. Fig. 14 is phase 4.4's `share_sweep`, `rate_sweep`'s setup scaled "
       "down 16 times on a shared CPU (rough figures; at n or width 2 neither policy crossed the bound). Its "
       "beams gain nothing: this engine admits a search on its worst case, before its beams share anything.",
       reference="blog (GPU, Qwen) or vLLM paper (OPT-13B, A100)",
       source=" The paper's are from its text (§6.3): 1.3x in basic sampling, 2.3x at beam width 6."),
    "p4_3_prefix_caching": Comparison([
        Figure("1 shot: hit rate", "beyond the blog",
               cpu("prefix-demo", "With and without", ("1", "on"), "hit rate"),
               gpu("prefix-demo", "With and without", ("1", "on"), "hit rate")),
        Figure("1 shot: tok/s without the cache", "beyond the blog",
               cpu("prefix-demo", "With and without", ("1", "off"), "total tok/s"),
               gpu("prefix-demo", "With and without", ("1", "off"), "total tok/s")),
        Figure("... with the cache", "beyond the blog",
               cpu("prefix-demo", "With and without", ("1", "on"), "total tok/s"),
               gpu("prefix-demo", "With and without", ("1", "on"), "total tok/s")),
        Figure("5 shots: tok/s with the cache", "beyond the blog",
               cpu("prefix-demo", "With and without", ("5", "on"), "total tok/s"),
               gpu("prefix-demo", "With and without", ("5", "on"), "total tok/s")),
        Figure("5 shots: tok/s without", "beyond the blog",
               cpu("prefix-demo", "With and without", ("5", "off"), "total tok/s"),
               gpu("prefix-demo", "With and without", ("5", "off"), "total tok/s")),
        Figure("5 shots: throughput with / without the cache (GPU: an H200, a later tree)", "beyond the blog",
               cpu("prefix-demo", "Speedup from prefix caching", ("5",), "throughput speedup"),
               Cell(H200_PREFIX, "Speedup from prefix caching", ("5",), "throughput speedup")),
    ], "On the CPU skipping prefill always pays; in the H100 baseline a 5-shot hit cost more than it saved, "
       "because a cached prefix then went through a gather and a masked SDPA per sequence, the loop phase 3.7 replaced. "
       "On the later tree of the H200 headline check, where prefill reads a cached prefix in place, the hit pays."),
    "p4_4_preemption": Comparison([
        Figure("unlimited pool: total tok/s", "beyond the blog",
               cpu("preempt-demo", "12 requests at once", ("unlimited pool",), "total tok/s"), None),
        Figure("recompute: total tok/s", "beyond the blog",
               cpu("preempt-demo", "12 requests at once", ("recompute",), "total tok/s"), None),
        Figure("swap: total tok/s", "beyond the blog",
               cpu("preempt-demo", "12 requests at once", ("swap",), "total tok/s"), None),
        Figure("swap: MB moved", "beyond the blog",
               cpu("preempt-demo", "12 requests at once", ("swap",), "MB moved"), None),
        *[Figure(f"{what}, paged / Orca ({orca})", f"beyond the blog (vLLM paper: {paper})",
                 cpu("rate-sweep", "Highest rate sustained", (f"Orca ({orca})",), col), None)
          for what, col, papers in (("rate sustained", "rate: paged / this", ("1.7-2.7x", "2.7-8x")),
                                    ("requests batched", "batched: paged / this", ("2.2x", "4.3x")))
          for orca, paper in zip(("Oracle", "Max"), papers)],
        Figure("Alpaca-like: rate sustained, paged / Orca (Max)", "beyond the blog (vLLM paper: a similar trend)",
               cpu("rate-sweep", "Highest rate sustained", ("Orca (Max)",), "rate: paged / this",
                   report=f"rate_sweep_alpaca/rate-sweep_{CPU}"), None),
        Figure("Fig. 19b: block sizes within 10% of the best, swap", "beyond the blog (vLLM paper: 16-64, x 1/16: 1-4)",
               cpu("block-sweep", "Best block size", ("sharegpt", "swap"), "within 10% of it"), None),
    ], "The blog never runs out of blocks; the vLLM paper is the reference, its setup scaled down on a shared "
       "CPU (rough figures; the measurements page has the scaling). Its Fig. 19 found recomputation at most 1.2x "
       "swapping's cost on a GPU; on our CPU it costs 148-174x (no PCIe, a compute-bound prefill). The rate rows "
       "are its §6.1 (Fig. 12 and 13), the block rows its §7.2-7.3.",
       reference="blog (GPU, Qwen) or vLLM paper (OPT, A100)",
       source=" The paper's are read from its figures."),
    "p4_5_speculative_decoding": Comparison([
        Figure("n-gram acceptance, code edit", "beyond the blog",
               cpu("spec-demo", "Acceptance by workload", ("code_edit", "ngram"), "acceptance"), None),
        Figure("n-gram acceptance, open chat", "beyond the blog",
               cpu("spec-demo", "Acceptance by workload", ("chat", "ngram"), "acceptance"), None),
        Figure("n-gram speed over plain, code edit, batch 1", "beyond the blog",
               cpu("spec-demo", "Speed against plain", ("code_edit", "1"), "ngram / plain"), None),
        Figure("n-gram speed over plain, code edit, batch 64", "beyond the blog",
               cpu("spec-demo", "Speed against plain", ("code_edit", "64"), "ngram / plain"), None),
        Figure("self-draft speed over plain, code edit, batch 1", "beyond the blog",
               cpu("spec-demo", "Speed against plain", ("code_edit", "1"), "draft / plain"), None),
    ], "The blog stops before speculative decoding; the anchors are gpt-fast's 1.9x at batch 1 on a GPU, "
       "Leviathan et al.'s 2-3x and EAGLE's 2.7-3.5x, and a nano-vllm fork that measured it 2.65-2.74% slower in "
       "batched offline decoding (the measurements page sets them beside ours)."),
    "p4_6_model_sharding": Comparison([
        Figure("weights (MB), the whole model on 1 worker", "beyond the blog",
               cpu("tp-demo", "What each worker holds", ("1 worker",), "weights (MB)"), None),
        Figure("weights (MB), rank 0 (2 of 3 KV-head groups)", "beyond the blog",
               cpu("tp-demo", "What each worker holds", ("0",), "weights (MB)"), None),
        Figure("weights (MB), rank 1 (1 of 3 KV-head groups)", "beyond the blog",
               cpu("tp-demo", "What each worker holds", ("1",), "weights (MB)"), None),
        Figure("all-reduces per forward pass", "beyond the blog",
               cpu("tp-demo", "Communication per forward pass", (), "all-reduces"), None),
    ], "The blog stops at one device and the paper's §4.6 describes this cut without a figure of its own; "
       "the two shards add up to the whole model, rank 0 a little more than half: its attention is 2 of 3 "
       "KV-head groups, but the MLP and the vocabulary are cut evenly. A pass costs 2 x 30 layers + 1 all-reduces."),
    "p4_7_tensor_parallel": Comparison([
        Figure("outputs identical, 2 workers against 1 (fp32)", "beyond the blog",
               cpu("tp-demo", "Same requests", ("2",), "outputs identical"), None),
        Figure("ms per step, 1 worker", "beyond the blog",
               cpu("tp-demo", "Same requests", ("1", "2"), "ms/step"), None),
        Figure("ms per step, 1 worker on 1 thread (each worker's share)", "beyond the blog",
               cpu("tp-demo", "Same requests", ("1", "1"), "ms/step"), None),
        Figure("ms per step, 2 workers", "beyond the blog",
               cpu("tp-demo", "Same requests", ("2",), "ms/step"), None),
        Figure("blocks at equal memory, rank 0 (2 of 3 KV heads)", "beyond the blog",
               cpu("tp-demo", "What each worker holds", ("0",), "blocks at equal memory"), None),
        Figure("control message per pass (bytes)", "beyond the blog",
               cpu("tp-demo", "Communication per forward pass", (), "control message (bytes)"), None),
    ], "The blog stops at one device and the paper's §4.6 describes this design without a figure of its own; "
       "the one-worker pool here holds 256 blocks, so rank 0, holding 2 of SmolLM2's 3 KV heads, fits 1.5x as "
       "many in the same memory."),
    "p5_1_served_engine": Comparison([
        Figure("served / batched (phase 3.6) tok/s, equal work, fp32", "beyond the blog",
               cpu("serve-workload", "Ratios the phase aims for", ("equal",), "measured"), None),
        Figure("served / vLLM's CPU build tok/s, equal work, bf16", "beyond the blog",
               cpu("vllm-cpu-peer", "Same requests", ("equal", "served"), "ours / vLLM"), None),
        Figure("served / vLLM's CPU build tok/s, mixed work, bf16", "beyond the blog",
               cpu("vllm-cpu-peer", "Same requests", ("mixed", "served"), "ours / vLLM"), None),
    ], "The blog has no served engine; what the later layers cost a step is measured against phase 3.6's engine "
       "on requests that use none of them, and against vLLM's CPU build on the same requests."),
    "p5_2_async_engine": Comparison([
        Figure("clients stepped by one engine thread", "beyond the blog", "a design, not a figure: the tests check it",
               "a design, not a figure"),
    ], "The blog runs one batch to completion in one process; its timings are on phase 5.6's server, the first "
       "place a client reaches the async engine."),
    "p5_3_metrics": Comparison([
        Figure("vLLM-named series equal to ours at one scrape", "beyond the blog",
               "all of them, at every scrape a test makes", "not run yet"),
    ], "The blog has no metrics endpoint; these are counts of what the engine did, not timings."),
    "p5_4_pool_view": Comparison([
        Figure("copy-on-write copies in cow_demo's replay", "the paper's Fig. 8 (a drawing)",
               cpu("pool-replay-cow-demo", "cow_demo replay", (), "copies"), None),
        Figure("preemptions in preempt_demo's replay", "beyond the blog",
               cpu("pool-replay-preempt-demo", "preempt_demo replay", (), "preemptions"), None),
    ], "The blog draws no pool; the paper's figures are drawings, these replays are the engine's own steps."),
    "p5_5_openai_api": Comparison([
        Figure("OpenAI request fields refused rather than ignored", "beyond the blog",
               "logprobs, echo, suffix, best_of > 1, tools", "the same"),
    ], "The blog has no API; this phase is a wire format, checked by tests, with nothing to time."),
    "p5_6_http_server": Comparison([
        Figure("completed req/s at 0.5 req/s offered", "beyond the blog",
               cpu("bench-serve", "streaming chat requests", ("0.50",), "req/s"), None),
        Figure("completed req/s at 8 req/s offered", "beyond the blog",
               cpu("bench-serve", "streaming chat requests", ("8.00",), "req/s"), None),
        Figure("TTFT p50 (ms) at 0.5 req/s", "beyond the blog",
               cpu("bench-serve", "streaming chat requests", ("0.50",), "TTFT p50 (ms)"), None),
        Figure("TTFT p50 (ms) at 8 req/s", "beyond the blog",
               cpu("bench-serve", "streaming chat requests", ("8.00",), "TTFT p50 (ms)"), None),
    ], "The blog has no server; these are the load points where queueing starts to show on 2 CPU cores. "
       "The GPU machines it ran on had no fastapi or uvicorn, so this table has no GPU row."),
}
