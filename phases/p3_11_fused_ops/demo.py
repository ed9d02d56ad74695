"""Phase 3.11's demos: `fused_bench` (what one decode step launches, and what it takes) and `fused_workload`.

fused_bench, two sections (`--sections`):
  kernels  the kernels one static decode step launches, phase 3.10's step against this phase's: every aten
           op that computes and every Triton launch (measure/kernel_count.py), counted as the step runs
           eagerly, per step and per layer, and by op. Any device: on a CPU the Triton kernels (the
           decode attention and the fused ones) run in the interpreter for the count, so the count is
           the GPU's.
  step     (CUDA) phase 3.10's graph-bench step section with this phase's engines: ms per decode step and
           the replayed graph's GPU time, per batch size, phase 3.10's graph against the fused graph (and
           the fused graph with overlapped steps); HF generate compiled at batch 1.
fused_workload: workload_bench's equal and mixed work, phase 3.10's `graphs` and `overlap` against the
  fused engines and the HF peers, ratios against phase 3.10's targets.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from functools import partial

import torch

from extras.p3_11_fused_ops.overlap import FusedOverlappedEngine
from measure.demos import Option, RunConfig, demo, run_sections
from measure.harness import EngineRunner
from measure.kernel_count import TRITON_PREFIX, Launches, count_launches
from measure.report import Report
from measure.step_bench import prefill_everything, random_prompts
from measure.workload_bench import run_workload_bench, workload_options
from phases.p3_1_block_allocator.allocator import DEFAULT_BLOCK_SIZE, blocks_for
from phases.p3_4_gather_kernel.dispatch import FORCE_KERNELS_ENV
from phases.p3_10_cuda_graphs.demo import ENGINES as P3_10_ENGINES
from phases.p3_10_cuda_graphs.demo import STEP_ENGINES as P3_10_STEP_ENGINES
from phases.p3_10_cuda_graphs.demo import TARGETS as P3_10_TARGETS
from phases.p3_10_cuda_graphs.demo import prefilled_graph_engine, run_graphs, step_section
from phases.p3_10_cuda_graphs.engine import StaticDecodeEngine
from phases.p3_11_fused_ops.engine import FusedDecodeEngine

COUNT_NEW_TOKENS = 4       # each counted request: its prefill, then decode steps (one of them counted)
TOP_OPS = 12               # rows of the by-op table


@contextmanager
def kernels_everywhere():
    """The Triton paths on any device (the interpreter on a CPU), so a count sees what a GPU would launch."""
    before = os.environ.get(FORCE_KERNELS_ENV)
    os.environ[FORCE_KERNELS_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[FORCE_KERNELS_ENV]
        else:
            os.environ[FORCE_KERNELS_ENV] = before


def count_decode_step(lm, engine_cls: type, batch: int, prompt_len: int, block_size: int) -> Launches:
    """The launches of one static decode step of `batch` sequences (the pass a graph would capture), eager."""
    blocks = batch * blocks_for(prompt_len + COUNT_NEW_TOKENS, block_size)
    engine = engine_cls(lm, max_running=batch, block_size=block_size, n_blocks=blocks, cuda_graphs=False,
                        buckets=[batch])
    for ids in random_prompts(lm.vocab_size, batch, prompt_len):
        engine.add(ids, COUNT_NEW_TOKENS, ignore_eos=True)
    prefill_everything(engine)
    counted: list[Launches] = []
    forward = engine.runner.static_forward

    def counted_forward(decode_batch):
        with count_launches() as launches:
            out = forward(decode_batch)
        counted.append(launches)
        return out

    engine.runner.static_forward = counted_forward
    engine.step()
    return counted[0]


COUNT_ENGINES = {"p3_10 static step": StaticDecodeEngine, "p3_11 fused step": FusedDecodeEngine}


def kernels_section(cfg: RunConfig, lm, report: Report) -> None:
    t = report.table(f"kernels launched by one decode step ({lm.n_layers} layers, {cfg.prompt_len_count}-token "
                     "prompts, the step run eagerly and counted)",
                     ["batch", "engine", "kernels", "per layer", "Triton launches", "aten ops"])
    rows, by_op = [], {}
    with kernels_everywhere():
        for batch in cfg.count_batches:
            for name, cls in COUNT_ENGINES.items():
                launches = count_decode_step(lm, cls, batch, cfg.prompt_len_count, cfg.block_size)
                t.add_row(batch, name, launches.total, launches.total / lm.n_layers, launches.triton,
                          launches.total - launches.triton)
                rows.append(dict(batch=batch, engine=name, kernels=launches.total, triton=launches.triton,
                                 by_op=dict(launches.by_op)))
                by_op.setdefault(batch, {})[name] = launches.by_op
    t.notes.append("kernels = aten ops that compute (views and allocations launch none) + Triton launches, as the "
                   "dispatcher and Triton see them (measure/kernel_count.py): a floor for a GPU, where a matmul can "
                   "be more than one kernel. " + ("On this CPU the Triton kernels ran in the interpreter for the "
                                                  "count." if torch.device(lm.device).type != "cuda" else ""))
    first = cfg.count_batches[0]
    names = list(COUNT_ENGINES)
    ops = by_op[first][names[0]] + by_op[first][names[1]]
    t2 = report.table(f"by op, batch {first}: launches per step", ["op", *names])
    for op, _ in ops.most_common(TOP_OPS):
        t2.add_row(op.removeprefix(TRITON_PREFIX) + (" (Triton)" if op.startswith(TRITON_PREFIX) else ""),
                   *(by_op[first][n][op] for n in names))
    report.data["kernels"] = rows


STEP_ENGINES = {
    "p3_10 static, CUDA graph": P3_10_STEP_ENGINES["p3_10 static, CUDA graph"],
    "p3_11 fused, CUDA graph": lambda lm, n, blocks: FusedDecodeEngine(lm, max_running=n, n_blocks=blocks),
    "p3_11 fused, CUDA graph, overlapped": lambda lm, n, blocks: FusedOverlappedEngine(lm, max_running=n,
                                                                                    n_blocks=blocks),
}


def fused_step_section(cfg: RunConfig, lm, report: Report) -> None:
    if torch.device(lm.device).type != "cuda":
        report.table("one decode step", ["section"]).notes.append(
            "skipped: the step section times CUDA graphs, and off CUDA the fused kernels run only in the "
            "interpreter; run it with --device cuda")
        return
    step_section(cfg, lm, report, STEP_ENGINES)


@demo("fused_bench", phase="p3_11",
      help="kernels per decode step, phase 3.10's vs the fused step (any device); the step's wall and GPU time (CUDA)",
      options=[Option("sections", str, cpu=["kernels"], gpu=["kernels", "step"], many=True, help="kernels and/or step",
                      choices=("kernels", "step")),
               Option("count_batches", int, cpu=[1, 4], gpu=[1, 64], many=True,
                      help="batch sizes of the kernel count (on a CPU the Triton kernels run in the interpreter: keep them small)"),
               Option("prompt_len_count", int, cpu=16, help="prompt tokens per sequence in the kernel count"),
               Option("batch_sizes", int, cpu=[1, 8], gpu=[1, 8, 32, 64, 128, 256], many=True,
                      help="step section batch sizes"),
               Option("prompt_len", int, cpu=32, gpu=256, help="prompt tokens per sequence in the step section"),
               Option("steps", int, cpu=5, gpu=30, help="timed decode steps per cell"),
               Option("hf_new_tokens", int, cpu=32, gpu=256, help="tokens HF generates at batch 1 (GPU)"),
               Option("block_size", int, cpu=DEFAULT_BLOCK_SIZE, help="tokens per KV block")])
def fused_bench(cfg: RunConfig) -> Report:
    cfg.use_quick(count_batches=[2], prompt_len_count=5, batch_sizes=[1, 2], steps=2, prompt_len=8, hf_new_tokens=4)
    lm = cfg.load()
    report = cfg.new_report("fused_bench")
    return run_sections(cfg, lm, report, {"kernels": kernels_section, "step": fused_step_section})


FUSED = EngineRunner("fused", "FusedDecodeEngine (p3_11): the graphs engine with fused norm, rotary and SwiGLU kernels "
                     "(on CUDA; elsewhere the same as graphs)", partial(run_graphs, engine_cls=FusedDecodeEngine))
FUSED_OVERLAP = EngineRunner("fused_overlap", "FusedOverlappedEngine (p3_11): the fused engine with overlapped steps",
                             partial(run_graphs, engine_cls=FusedOverlappedEngine))
ENGINES = P3_10_ENGINES + [FUSED, FUSED_OVERLAP]
# Phase 3.10's targets against HF's peers (compiled generate, generate_batch), asked of the fused engines too.
TARGETS = P3_10_TARGETS | {(work, fused, peer): ratio for (work, engine, peer), ratio in P3_10_TARGETS.items()
                          if engine == "graphs" for fused in ("fused", "fused_overlap")}


@demo("fused_workload", phase="p3_11",
      help="workload_bench's equal and mixed work: phase 3.10's graph engines against the fused ones and HF's",
      options=workload_options(["graphs", "fused"],
                               ["hf_compiled", "hf_cb", "graphs", "overlap", "fused", "fused_overlap"],
                               [e.name for e in ENGINES] + ["hf_cb"]))
def fused_workload(cfg: RunConfig) -> Report:
    return run_workload_bench(cfg, ENGINES, focus="fused", targets=TARGETS,
                              profile_engine=partial(prefilled_graph_engine, engine_cls=FusedDecodeEngine),
                              name="fused_workload")
