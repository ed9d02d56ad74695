"""Phase 3.10's demos: `graph_bench` (the decode step and its kernel) and `graph_workload` (the engine among all).

graph_bench, four sections (`--sections`; tune only when named):
  kernel  phase 3.9's tuned kernel beside SDPA and phase 3.5's kernel, one layer (measure/decode_bench.py)
  step    one decode step of `batch` sequences (prompts of `prompt_len` tokens), median wall ms
          (the blog's ms/tok: every sequence makes one token per step): phase 3.8's decode pass
          built from Python lists, this phase's static step run eagerly, and replayed as a CUDA
          graph, and the graph with overlapped steps (extras/p3_10_cuda_graphs/overlap.py: the host
          builds step N+1 while the GPU runs step N); for a graph, its replay's GPU time and wall / GPU
          (the host overhead left).
          At batch 1, HF generate with the compiled static cache for comparison (GPU).
  host    the step section's engines with each decode pass stubbed out (zero logits, no model): the host's own
          ms per step and us per sequence, the part a graph does not remove and overlapped steps must hide.
  tune    (GPU) phase 3.9's launch-config sweep (measure/decode_bench.py)
graph_workload: workload_bench's equal and mixed work through phases 3.6, 3.8 and 3.10 (`graphs`, and
  `overlap` for the overlapped steps; GPU default, or `--engines ... overlap`) and the HF peers,
  ratios against this phase's targets (measure/workload_bench.py).
"""

from __future__ import annotations

from functools import partial

import torch

from measure.demos import Option, RunConfig, demo, run_sections
from measure.harness import EngineRun, EngineRunner, measure, pool_problems, submit, workload_pool_blocks
from measure.hf_peers import HF_COMPILED, HF_STATIC
from measure.report import Report
from measure.step_bench import FIRST_TOKEN_ID, decode_step_ms, prefill_everything, replay_ms
from measure.workload import Request
from measure.workload_bench import run_workload_bench, workload_options
from phases.p3_1_block_allocator.allocator import DEFAULT_BLOCK_SIZE, blocks_for
from phases.p3_6_batched_engine.attention import use_paged_attention
from phases.p3_6_batched_engine.demo import ALL_ENGINES as P3_6_ENGINES
from phases.p3_8_chunked_prefill.demo import CHUNKED
from phases.p3_8_chunked_prefill.engine import DEFAULT_MAX_NUM_BATCHED_TOKENS, ChunkedPrefillEngine
from measure.decode_bench import KERNEL_OPTIONS, KERNEL_QUICK, kernel_section, tune_section
from phases.p3_10_cuda_graphs.engine import StaticDecodeEngine
from extras.p3_10_cuda_graphs.overlap import OverlappedDecodeEngine

STEP_SLACK_TOKENS = 16   # pool room per sequence beyond its prompt and timed steps (the warm-up steps)
TARGETS = {  # (workload, faster, slower) -> the ratio this phase aims for
    ("equal", "graphs", "hf_compiled"): 1.5,
    ("equal", "graphs", "hf_cb"): 10.0,
    ("mixed", "graphs", "hf_compiled"): 3.0,
    ("equal", "overlap", "hf_compiled"): 1.5,   # the same targets for the overlapped steps
    ("mixed", "overlap", "hf_compiled"): 3.0,
}


# --- step ------------------------------------------------------------------------------------------
STEP_ENGINES = {
    "p3_8 (decode pass from lists)": lambda lm, n, blocks: ChunkedPrefillEngine(lm, max_running=n, n_blocks=blocks),
    "p3_10 static, eager": lambda lm, n, blocks: StaticDecodeEngine(lm, max_running=n, n_blocks=blocks,
                                                                   cuda_graphs=False),
    "p3_10 static, CUDA graph": lambda lm, n, blocks: StaticDecodeEngine(lm, max_running=n, n_blocks=blocks),
    "p3_10 CUDA graph, overlapped": lambda lm, n, blocks: OverlappedDecodeEngine(lm, max_running=n, n_blocks=blocks),
}


def step_section(cfg: RunConfig, lm, report: Report, step_engines: dict | None = None) -> None:
    """step_engines: name -> make(lm, batch, blocks), default STEP_ENGINES."""
    on_cuda = torch.device(lm.device).type == "cuda"
    engines = {k: f for k, f in (step_engines or STEP_ENGINES).items() if on_cuda or "graph" not in k}
    t = report.table(f"one decode step, {cfg.prompt_len}-token prompts (median of {cfg.steps} steps)",
                     ["batch", "engine", "ms/step", "tok/s", "GPU ms (graph replay)", "wall / GPU"])
    rows = []
    for batch in cfg.batch_sizes:
        for name, make in engines.items():
            blocks = batch * blocks_for(cfg.prompt_len + cfg.steps + STEP_SLACK_TOKENS, cfg.block_size)
            r = decode_step_ms(lambda lm_, n: make(lm_, n, blocks), lm, batch, cfg.prompt_len, cfg.steps)
            engine = r.pop("engine")
            graph = getattr(getattr(engine, "runner", None), "last_graph", None)   # the runner replays graphs
            gpu = replay_ms(engine.runner.graphs[graph][0]) if graph else None
            t.add_row(batch, name, r["ms"], r["tok_s"], gpu if gpu else "-", r["ms"] / gpu if gpu else "-")
            rows.append(dict(r, engine=name, gpu_ms=gpu))
            del engine
        if batch == 1 and on_cuda:
            one = Request(prompt_ids=list(range(FIRST_TOKEN_ID, FIRST_TOKEN_ID + cfg.prompt_len)),
                          max_new_tokens=cfg.hf_new_tokens, ignore_eos=True)
            hf = measure(lm, HF_COMPILED, [one], 1)
            t.add_row(1, "HF generate, static cache, compiled", 1e3 / hf["tok_s"], hf["tok_s"], "-", "-")
            rows.append(dict(batch=1, engine="hf_compiled", ms=1e3 / hf["tok_s"], tok_s=hf["tok_s"]))
    t.notes.append("ms/step is the blog's ms/tok: wall time of one decode step, every sequence one token. HF compiled "
                   f"at batch 1: wall time of generate / {cfg.hf_new_tokens} tokens (its prefill included).")
    report.data["step"] = rows


# --- host ------------------------------------------------------------------------------------------
HOST_RUNS = 8     # the host section's timed steps are cut into up to this many runs; the fastest is reported too
STUB_VOCAB = 8   # logits columns the stub returns: argmax over a real vocabulary is device work, not host work


def stub_decode_forward(engine) -> None:
    """Replace `engine`'s decode passes by a stub returning zero logits [rows, STUB_VOCAB] (every row draws
    token 0; the step bench ignores EOS): what is left of a step is the host's work. Prefill passes still run."""
    runner = engine.runner
    real = runner.forward
    zeros = torch.zeros(engine.max_running, 1, STUB_VOCAB, device=engine.lm.device)   # [rows, 1 position, V]

    def forward(input_ids, position_ids, batch, logits_to_keep=1):
        if not batch.is_decode:
            return real(input_ids, position_ids, batch, logits_to_keep)
        return zeros[:batch.block_tables.shape[0]]     # phase 3.6's decode pass: [S, 1, V]

    runner.forward = forward
    if hasattr(runner, "replay"):                      # p3_10's static step: [bucket, V]
        runner.replay = lambda batch: zeros[:batch.block_tables.shape[0], 0]


HOST_ENGINES = {name: make for name, make in STEP_ENGINES.items() if "graph" not in name} | {
    "p3_10 static, overlapped": lambda lm, n, blocks: OverlappedDecodeEngine(lm, max_running=n, n_blocks=blocks,
                                                                            cuda_graphs=False),
}


def host_section(cfg: RunConfig, lm, report: Report) -> None:
    """The step section's engines with the model stubbed out: the host's own time per decode step."""
    runs = max(1, min(HOST_RUNS, cfg.host_steps // cfg.block_size))   # each run at least a block's steps
    t = report.table(f"the host's share of one decode step: the forward pass stubbed out, {cfg.prompt_len}-token "
                     f"prompts ({cfg.host_steps} steps in {runs} runs)",
                     ["batch", "engine", "host ms/step, mean", "fastest run", "us per sequence (fastest)"])
    rows = []
    for batch in cfg.host_batches:
        for name, make in HOST_ENGINES.items():
            blocks = batch * blocks_for(cfg.prompt_len + cfg.host_steps + STEP_SLACK_TOKENS, cfg.block_size)

            def build(lm_, n, make=make, blocks=blocks):
                engine = make(lm_, n, blocks)
                stub_decode_forward(engine)
                return engine

            r = decode_step_ms(build, lm, batch, cfg.prompt_len, cfg.host_steps, runs=runs)
            del r["engine"]
            ms = r["mean_ms"]      # a mean, as overlapped steps are timed: it counts the steps that cross a block
            best = r["best_run_ms"]
            t.add_row(batch, name, ms, best, 1e3 * best / batch)
            rows.append(dict(batch=batch, engine=name, host_ms=ms, best_run_ms=best, us_per_seq=1e3 * best / batch))
    t.notes.append("Each decode pass returns zero logits at once (no model, no graph replay, no kernel), so the time "
                   "left is Python and the step's few small tensor ops: the floor under a step's wall time, which "
                   "overlapped steps hide behind the GPU's work when it is shorter than that work. The fastest run "
                   "(its mean per step) is the steadier reading on a shared machine, where other work steals the "
                   "CPU now and then. Each run is at least a block's worth of steps, so each holds a step where every "
                   "sequence takes a new block.")
    report.data["host"] = rows


@demo("graph_bench", phase="p3_10",
      help="the decode step: eager vs static buffers vs CUDA graphs per batch size; the tuned decode kernel vs "
           "phase 3.5's and SDPA (GB/s, share of HBM); the launch-config sweep",
      options=[Option("sections", str, cpu=["kernel", "step", "host"], gpu=["kernel", "step", "host"], many=True,
                      help="kernel, step, host and/or tune", choices=("kernel", "step", "host", "tune")),
               Option("batch_sizes", int, cpu=[1, 4, 16], gpu=[1, 8, 32, 64, 128, 256], many=True,
                      help="decode-step batch sizes"),
               Option("prompt_len", int, cpu=32, gpu=256, help="prompt tokens per sequence in the step section"),
               Option("steps", int, cpu=5, gpu=30, help="timed decode steps per cell"),
               Option("hf_new_tokens", int, cpu=32, gpu=256, help="tokens HF generates at batch 1 (GPU)"),
               Option("host_batches", int, cpu=[1, 64, 256], gpu=[1, 64, 256], many=True,
                      help="host section batch sizes"),
               Option("host_steps", int, cpu=50, gpu=50, help="timed decode steps per cell in the host section"),
               *KERNEL_OPTIONS])
def graph_bench(cfg: RunConfig) -> Report:
    cfg.use_quick(**KERNEL_QUICK, batch_sizes=[1, 2], steps=2, prompt_len=8,
                  hf_new_tokens=4, host_batches=[1, 3], host_steps=3)
    lm = cfg.load()
    report = cfg.new_report("graph_bench")
    return run_sections(cfg, lm, report, {"kernel": kernel_section, "step": step_section, "host": host_section,
                                          "tune": tune_section})


# --- the engine as measure/harness.py runs engines ----------------------------------------------------
# One engine per (model, pool shape), kept between runs: its graphs are captured once, when it is built (as a
# server captures at startup, outside any request), so the harness's warm-up run captures them and the timed
# run replays them, just as HF's compiled peer compiles in its warm-up run.
_WARM_ENGINES: dict[tuple, StaticDecodeEngine] = {}


def capture_all(runner) -> int:
    """Capture every bucket's graph (one split each) now, largest first, instead of at first use. Rows are
    empty: nothing is written to the pool. Returns the graphs captured."""
    if not runner.cuda_graphs:
        return 0
    if runner.buffers.n_rows:
        raise RuntimeError("capture_all runs before the first decode step (the buffers hold no sequence)")
    n_before = len(runner.graphs)
    with use_paged_attention(runner.lm.model, runner.attention_name):
        for bucket in reversed(runner.buckets):
            runner.replay(runner.decode_batch(bucket, 0))
    return len(runner.graphs) - n_before


def warm_graph_engine(lm, max_running: int, block_size: int, n_blocks: int,
                      engine_cls: type = StaticDecodeEngine) -> StaticDecodeEngine:
    key = (engine_cls, id(lm.model), max_running, block_size, n_blocks)
    if key not in _WARM_ENGINES:
        engine = engine_cls(lm, max_running=max_running, block_size=block_size, n_blocks=n_blocks,
                            max_num_batched_tokens=DEFAULT_MAX_NUM_BATCHED_TOKENS)
        capture_all(engine.runner)
        _WARM_ENGINES.clear()                  # one at a time: each holds a KV pool
        _WARM_ENGINES[key] = engine
    return _WARM_ENGINES[key]


def run_graphs(lm, requests: list[Request], max_running: int, block_size: int = DEFAULT_BLOCK_SIZE,
               engine_cls: type = StaticDecodeEngine) -> EngineRun:
    n_blocks = workload_pool_blocks(lm, requests, block_size)
    engine = warm_graph_engine(lm, max_running, block_size, n_blocks, engine_cls)
    done_before, steps_before, static_before = len(engine.finished), engine.n_steps, engine.runner.n_static_steps
    submit(engine, lm, requests)
    engine.run()
    finished = sorted(engine.finished[done_before:], key=lambda s: s.seq_id)
    assert not pool_problems(engine.allocator), "blocks leaked"
    settings = dict(max_running=max_running, block_size=block_size, pool_blocks=n_blocks,
                    max_num_batched_tokens=engine.prefill.max_num_batched_tokens, cuda_graphs=engine.runner.cuda_graphs,
                    buckets=engine.runner.buckets)
    return EngineRun.from_sequences(finished, engine.peak_blocks_used * engine.allocator.bytes_per_block,
                                    note=f"{engine.runner.n_static_steps - static_before} static decode steps of "
                                         f"{engine.n_steps - steps_before}, " +
                                         (f"{len(engine.runner.graphs)} graphs (captured when the engine was built)"
                                          if engine.runner.cuda_graphs else "run eagerly (no CUDA)")
                                    + (f", {engine.n_overlapped_steps} overlapped, {engine.n_wasted_rows} rows wasted on "
                                       "an EOS in flight" if issubclass(engine_cls, OverlappedDecodeEngine) else ""),
                                    settings=settings)


GRAPHS = EngineRunner("graphs", "StaticDecodeEngine (p3_10): static buffers, bucketed batches, CUDA graphs on CUDA",
                      run_graphs)
OVERLAP = EngineRunner("overlap", "OverlappedDecodeEngine (p3_10): the graphs engine, step N+1 launched before step "
                       "N's tokens are read", partial(run_graphs, engine_cls=OverlappedDecodeEngine))
ENGINES = P3_6_ENGINES + [CHUNKED, GRAPHS, OVERLAP, HF_STATIC, HF_COMPILED]


def prefilled_graph_engine(lm, requests: list[Request], engine_cls: type = StaticDecodeEngine) -> StaticDecodeEngine:
    """Every request admitted and prefilled, its graph captured: the next step is one full-batch decode step."""
    engine = engine_cls(lm, max_running=len(requests), n_blocks=workload_pool_blocks(lm, requests, DEFAULT_BLOCK_SIZE))
    for r in requests:
        engine.add(r.prompt_ids, r.max_new_tokens, ignore_eos=True)
    prefill_everything(engine)
    engine.step()
    return engine


@demo("graph_workload", phase="p3_10",
      help="workload_bench's equal and mixed work through phases 3.6, 3.8, 3.10 and HF's engines; this phase's targets",
      options=workload_options(["hf_static", "batched", "chunked", "graphs"],
                               ["hf_static", "hf_compiled", "hf_cb", "batched", "chunked", "graphs", "overlap"],
                               [e.name for e in ENGINES] + ["hf_cb"]))
def graph_workload(cfg: RunConfig) -> Report:
    return run_workload_bench(cfg, ENGINES, focus="graphs", targets=TARGETS, profile_engine=prefilled_graph_engine,
                              name="graph_workload")
