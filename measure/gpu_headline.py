"""`make gpu-headline` (`python -m measure.gpu_headline`): the headline GPU figures in one run of at most 8 minutes;
`--run demos` (the blog's demos at GPU sizes) and `--run paper` (preempt_demo, rate_sweep): two more such runs.

GPU time comes in short windows: the whole gpu tier and every demo (`make gpu-check`)
do not fit one. This runs the parts of measure/headline_parts.py in order, most
valuable first: correctness (a fixed slice of the gpu tier), throughput against HF
(equal and mixed work), nano-vllm's bench.py workload, the decode step's wall and
GPU time, prefill, prefix caching. Each step is its own process, killed (with anything
it started) when its part's time box runs out; the part then reports what its finished
steps saved. The summary,
`results/gpu-headline_<gpu>_<model>.{json,md}` (every figure, its target, met or
not; each part's status and seconds; device, commit, versions), is written after
every part, so it is there however the run ends. Step reports go to its folder; demos' also to results/.

On a bare CUDA box (other torch, triton and transformers versions, no network, no
fastapi or uvicorn, no packaged model): put the wheels it lacks in `.whl/` and run
`bash scripts/gpu_headline.sh`, which installs them into a folder on PYTHONPATH,
runs this, and packs what it wrote into $OUT. The default model there is
`dummy:qwen3-0.6b` (Qwen3-0.6B's shapes, random weights, EOS ignored); nothing
on this path imports the server or needs the packaged model.

`python -m measure.gpu_headline --device cpu --model tiny` is the dry run: every
command at its smallest (`--quick`), the tier's tests collected but not run, so a
typo fails on a CPU (tests/test_gpu_headline.py) and not in a GPU window.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from measure.headline_parts import (HEADLINE_ENGINE, NANO_VLLM_PUBLISHED, RUNS, STEP_DIR, Part, Setup, Step,
                                   StepResult, nano_vllm_tok_s)
from measure.report import REPO_ROOT, RESULTS_DIR, Report, environment_meta, save_report

GPU_MODEL = "dummy:qwen3-0.6b"   # Qwen3-0.6B's shapes with random weights: nothing to download
DRY_RUN_MODEL = "tiny"
DRY_RUN_BOX_SCALE = 4     # a CPU runs the quick commands slower than a GPU runs the real ones
MIN_STEP_S = 1.0          # a step given less than this is skipped, not started
LOG_TAIL_LINES = 3        # lines of a failed step's output kept in the summary
REFUSED_EXIT_STATUS = 2   # `python -m common` refused the input with one line


def run_step(python: str, step: Step, folder: Path, timeout_s: float, threads: int | None = None) -> StepResult:
    """One step in its own process group (so a kill takes its compile workers too), output in output.log.
    threads: the CPU threads it may use, when steps run side by side (OpenMP threads that outnumber the
    cores spin at every barrier, and each step then runs many times slower)."""
    folder.mkdir(parents=True, exist_ok=True)
    argv = [python] + [a.replace(STEP_DIR, str(folder)) for a in step.argv]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads)) if threads else None
    start = time.perf_counter()
    with open(folder / "output.log", "w") as log:
        proc = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=env)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return StepResult(step.name, "timeout", time.perf_counter() - start, folder,
                              f"stopped at its part's time box ({timeout_s:.0f} s left)")
        except BaseException:   # Ctrl-C or a kill of this run: its own session would outlive us otherwise
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    seconds = time.perf_counter() - start
    if rc == 0:
        return StepResult(step.name, "ok", seconds, folder, ", ".join(p.name for p in sorted(folder.glob("*.md"))))
    tail = [line for line in (folder / "output.log").read_text().splitlines() if line.strip()][-LOG_TAIL_LINES:]
    return StepResult(step.name, "refused" if rc == REFUSED_EXIT_STATUS else "failed", seconds, folder,
                      " | ".join(tail))


def run_part(part: Part, setup: Setup, python: str, folder: Path, box_s: float, results_dir: Path) -> dict:
    """Every step of `part` inside its box; then the figures its finished steps saved. On a GPU the steps run
    one at a time (two would share the GPU and skew each other's timings); the CPU dry run, which times
    nothing, runs one per core."""
    steps = part.steps(setup)
    jobs = (os.cpu_count() or 1) if setup.dry else 1
    threads = max(1, (os.cpu_count() or 1) // jobs) if jobs > 1 else None   # OpenMP threads per step
    start = time.perf_counter()
    deadline = start + box_s

    def run_one(step: Step) -> StepResult:
        left = deadline - time.perf_counter()
        print(f"[gpu-headline] {part.name}/{step.name} ({left:.0f} s left in the box)", flush=True)
        if left < MIN_STEP_S:
            return StepResult(step.name, "skipped", 0.0, folder / step.name, "its part's time box was spent")
        result = run_step(python, step, folder / step.name, left, threads)
        print(f"[gpu-headline]   {step.name}: {result.status} in {result.seconds:.0f} s {result.detail}", flush=True)
        return result

    with ThreadPoolExecutor(max_workers=jobs) as pool:    # threads only wait: each step is its own process
        results = list(pool.map(run_one, steps))
    for step, result in zip(steps, results):
        if step.to_results and result.status == "ok":
            for path in result.folder.iterdir():
                if path.suffix in (".json", ".md", ".png"):
                    shutil.copy2(path, results_dir / path.name)
    try:
        figures = part.figures(results, setup)
        problem = ""
    except Exception as e:   # a report without the figure's fields: the part says so, the run goes on
        figures, problem = [], f"its figures could not be read: {type(e).__name__}: {e}"
    statuses = {r.status for r in results}
    status = ("failed" if statuses & {"failed", "refused"} or problem else
              "timeout" if statuses & {"timeout", "skipped"} else "ok")
    return dict(part=part.name, box_s=box_s, estimate_s=part.estimate_s, seconds=time.perf_counter() - start,
                status=status, problem=problem,
                steps=[dict(step=r.name, status=r.status, seconds=r.seconds, detail=r.detail) for r in results],
                figures=[vars(f) for f in figures], nano_vllm_tok_s=nano_vllm_tok_s(results))


def summary(setup: Setup, parts: list[dict], seconds: float, run: str = "headline") -> Report:
    meta = environment_meta(device=setup.device, model=setup.model, dtype=setup.dtype)
    meta.update(triton=triton_version(), seconds=round(seconds, 1), dry_run=setup.dry, run=run,
                boxes={p["part"]: p["box_s"] for p in parts})
    report = Report("gpu_headline" if run == "headline" else f"gpu_headline_{run}", meta=meta)
    t = report.table("Every figure against its target", ["part", "figure", "target", "measured", "met"])
    for p in parts:
        for f in p["figures"]:
            t.add_row(p["part"], f["figure"], f["target"], f["measured"], {True: "yes", False: "no"}.get(f["met"], "-"))
    t.notes.append(f"{meta.get('device_name')}, {setup.model} in {setup.dtype}, commit {meta['commit']}; torch "
                   f"{meta['torch']}, triton {meta['triton']}, transformers {meta['transformers']}; "
                   f"{seconds:.0f} s in all" + (" (CPU dry run: quick settings, tests collected only)" if setup.dry
                                                else ""))
    if run == "headline":
        ours = next((p["nano_vllm_tok_s"] for p in parts if p["nano_vllm_tok_s"]), None)
        n = report.table("nano-vllm's bench.py workload (256 sequences, prompts and outputs of 100-1024 tokens): "
                         "published tok/s and ours", ["engine", "hardware", "tok/s", "source"])
        for row in NANO_VLLM_PUBLISHED:
            n.add_row(*row)
        n.add_row(f"ours ({HEADLINE_ENGINE})", meta.get("device_name"), ours or math.nan, "this run")
    s = report.table("Parts, each in its time box", ["part", "box s", "estimate s", "seconds", "status", "steps ok"])
    d = report.table("Steps", ["part", "step", "status", "seconds", "reports / what went wrong"])
    if any(p["estimate_s"] for p in parts):
        s.notes.append("estimate: a GPU step's start, plus its forward passes at an eager pass's cost, plus its "
                       "waits by design (measure/headline_parts.py); the box adds a margin")
    for p in parts:
        s.add_row(p["part"], p["box_s"], p["estimate_s"] or "-", p["seconds"], p["status"],
                  f"{sum(x['status'] == 'ok' for x in p['steps'])}/{len(p['steps'])}")
        if p["problem"]:
            s.notes.append(f"{p['part']}: {p['problem']}")
        for x in p["steps"]:
            d.add_row(p["part"], x["step"], x["status"], x["seconds"], x["detail"])
    report.data = dict(parts=parts)
    return report


def triton_version() -> str:
    try:
        from importlib.metadata import version
        return version("triton")
    except Exception:
        return "not installed"


def parse_boxes(pairs: list[str], parts: list[Part]) -> dict[str, float]:
    boxes = {}
    for pair in pairs:
        name, _, seconds = pair.partition("=")
        if name not in {p.name for p in parts} or not seconds:
            raise SystemExit(f"error: --box takes PART=SECONDS, PART one of {[p.name for p in parts]}; not {pair!r}")
        boxes[name] = float(seconds)
    return boxes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m measure.gpu_headline", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None, help="cuda (default when present), or cpu for the dry run")
    p.add_argument("--model", default=None, help=f"default: {GPU_MODEL} on CUDA, {DRY_RUN_MODEL} on the CPU")
    p.add_argument("--dtype", default=None, help="default: bf16 on CUDA, fp32 on the CPU")
    p.add_argument("--run", default="headline", choices=list(RUNS),
                   help="headline (default), demos (the blog's demos at GPU sizes) or paper (preempt_demo, "
                        "rate_sweep): each at most 8 minutes")
    p.add_argument("--parts", nargs="+", default=None, choices=sorted({x.name for r in RUNS.values() for x in r}),
                   help="only these parts of the run")
    p.add_argument("--box", nargs="+", default=[], metavar="PART=SECONDS", help="another time box for a part")
    p.add_argument("--results-dir", default=str(RESULTS_DIR), help="where the summary and the step reports go")
    p.add_argument("--python", default=sys.executable, help="the Python that runs each step")
    args = p.parse_args(argv)

    import torch
    device = args.device or ("cuda" if torch.cuda.is_available() else None)
    if device is None or (device.startswith("cuda") and not torch.cuda.is_available()):
        print("error: no CUDA GPU here; the CPU dry run is `python -m measure.gpu_headline --device cpu --model tiny`",
              file=sys.stderr)
        return REFUSED_EXIT_STATUS
    dry = not device.startswith("cuda")
    setup = Setup(device, args.model or (DRY_RUN_MODEL if dry else GPU_MODEL),
                  args.dtype or ("fp32" if dry else "bf16"), dry)
    run_parts = RUNS[args.run]
    boxes = parse_boxes(args.box, run_parts)
    results_dir = Path(args.results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    parts: list[dict] = []
    report = summary(setup, parts, 0.0, args.run)
    path = save_report(report, results_dir)
    run_folder = results_dir / report.stem()
    for part in [x for x in run_parts if args.parts is None or x.name in args.parts]:
        box = boxes.get(part.name, part.box_s * (DRY_RUN_BOX_SCALE if dry else 1))
        parts.append(run_part(part, setup, args.python, run_folder / part.name, box, results_dir))
        report = summary(setup, parts, time.perf_counter() - start, args.run)
        path = save_report(report, results_dir)   # after every part: there however the run ends
    print(path.with_suffix(".md").read_text())
    print(f"saved {path}")
    return 0 if all(x["status"] == "ok" for x in parts) else 1


if __name__ == "__main__":
    sys.exit(main())
