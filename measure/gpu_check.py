"""`make gpu-check` (`python -m measure.gpu_check`): the gpu test tier, then every demo on the GPU.

On a machine with a CUDA GPU, one command:

1. runs the `gpu` test tier (`pytest -m gpu`: compiled kernels against their
   references, every engine against HF `generate` in fp32, every demo in
   quick mode, the server streaming on CUDA);
2. runs every demo with `--device cuda` and its GPU defaults, each in its own
   process with a time limit, so one failing or slow demo cannot stop the rest;
   each saves its own report under results/, named by GPU and model;
3. writes `results/gpu-check_<gpu>_<model>.{json,md}`: what passed, what failed
   and why, how long each part took.

The demos run on `dummy:qwen3-0.6b` by default: Qwen3-0.6B's architecture with
random weights, the same FLOPs and bytes per token, nothing to download (the
machines this runs on may have no network), EOS ignored.
It takes longer than a short GPU window: there, run `make gpu-headline`
(measure/gpu_headline.py) first, the headline figures in at most 8 minutes.
`modal run modal_run.py::gpu_check` runs step 1 in the Modal image;
`modal run modal_run.py::all_demos` runs step 2 fanned out over GPU containers.

Everything runs as subprocesses by name, so this module imports no phase.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from measure.demos import names as demo_names
from measure.report import REPO_ROOT, RESULTS_DIR, Report, environment_meta, print_report, save_report

GPU_RESULTS_MODEL = "dummy:qwen3-0.6b"
DEMO_TIMEOUT_S = 900          # one demo at GPU defaults; tput and preempt_demo are the longest
TIER_TIMEOUT_S = 3600
FAILURE_TAIL_LINES = 3        # lines of a failed demo's stderr kept in the report
REFUSED_EXIT_STATUS = 2       # `python -m common` refused the input with one line (see measure/cli.py)


def run_tier(python: str, junit: Path, extra: list[str] | None = None) -> tuple[dict, float]:
    """`pytest -m gpu` in the repo; returns (counts and failures from its junit XML, seconds)."""
    cmd = [python, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
           *(extra or [])]
    start = time.perf_counter()
    subprocess.run(cmd, cwd=REPO_ROOT, timeout=TIER_TIMEOUT_S)   # its output streams to the terminal
    return parse_junit(junit), time.perf_counter() - start


def junit_outcomes(path: Path) -> list[tuple[str, str, str]]:
    """(test id, passed | failed | errors | skipped, first line of its message) per test case; [] if no report."""
    if not path.exists():
        return []
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = next((child for child in case if child.tag in ("failure", "error", "skipped")), None)
        if outcome is None:
            cases.append((test_id, "passed", ""))
            continue
        message = (outcome.get("message") or outcome.text or "").strip().splitlines()
        key = {"failure": "failed", "error": "errors", "skipped": "skipped"}[outcome.tag]
        cases.append((test_id, key, message[0] if message else ""))
    return cases


def parse_junit(path: Path) -> dict:
    """{passed, failed, errors, skipped, failures: [(test id, first line of its message)]}."""
    counts = dict(passed=0, failed=0, errors=0, skipped=0, failures=[])
    if not path.exists():
        counts["errors"] = 1
        counts["failures"].append(("pytest", "no junit report: pytest did not run to its end"))
        return counts
    for test_id, key, message in junit_outcomes(path):
        counts[key] += 1
        if key in ("failed", "errors"):
            counts["failures"].append((test_id, message))
    return counts


def run_one_demo(python: str, name: str, model: str, results_dir: Path, quick: bool, timeout_s: float) -> dict:
    """One demo as `python -m common <name> --device cuda`, in its own process; how it ended."""
    cmd = [python, "-m", "common", name, "--device", "cuda", "--model", model, "--results-dir", str(results_dir)]
    cmd += ["--quick"] if quick else []
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return dict(demo=name, status="timeout", seconds=time.perf_counter() - start,
                    detail=f"did not finish in {timeout_s:.0f} s")
    seconds = time.perf_counter() - start
    saved = [line.removeprefix("saved ").strip() for line in done.stdout.splitlines() if line.startswith("saved ")]
    if done.returncode == 0:
        return dict(demo=name, status="ok", seconds=seconds, detail=", ".join(Path(p).name for p in saved))
    tail = [line for line in done.stderr.strip().splitlines() if line.strip()][-FAILURE_TAIL_LINES:]
    status = "refused" if done.returncode == REFUSED_EXIT_STATUS else "failed"
    return dict(demo=name, status=status, seconds=seconds, detail=" | ".join(tail))


def build_report(model: str, tier: dict | None, tier_s: float, demos: list[dict], quick: bool) -> Report:
    meta = environment_meta(device="cuda", model=model, dtype="bf16")
    meta["options"] = dict(quick=quick)
    report = Report("gpu_check", meta=meta)
    if tier is not None:
        t = report.table("gpu test tier (pytest -m gpu)", ["passed", "failed", "errors", "skipped", "seconds"])
        t.add_row(tier["passed"], tier["failed"], tier["errors"], tier["skipped"], tier_s)
        t.notes += [f"{test}: {message}" for test, message in tier["failures"]]
    if demos:
        d = report.table(f"every demo with --device cuda --model {model}" + (" --quick" if quick else ""),
                         ["demo", "status", "seconds", "result files / what went wrong"])
        for row in demos:
            d.add_row(row["demo"], row["status"], row["seconds"], row["detail"])
    report.data = dict(tier=tier, tier_seconds=tier_s, demos=demos)
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m measure.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=GPU_RESULTS_MODEL, help=f"model for the demos (default {GPU_RESULTS_MODEL})")
    p.add_argument("--demos", nargs="+", default=None, help="only these demos (default: every demo)")
    p.add_argument("--skip-tier", action="store_true", help="do not run the test tier")
    p.add_argument("--skip-demos", action="store_true", help="do not run the demos")
    p.add_argument("--quick", action="store_true", help="demos in quick mode (smallest settings)")
    p.add_argument("--demo-timeout", type=float, default=DEMO_TIMEOUT_S, help="seconds one demo may take")
    p.add_argument("--results-dir", default=str(RESULTS_DIR), help="where every report goes")
    p.add_argument("--python", default=sys.executable, help="the Python that runs pytest and the demos")
    args = p.parse_args(argv)

    import torch
    if not torch.cuda.is_available():
        print("error: gpu-check needs a CUDA GPU, and torch sees none here (the CPU suite is `make test`)",
              file=sys.stderr)
        return REFUSED_EXIT_STATUS
    unknown = set(args.demos or []) - set(demo_names())
    if unknown:
        print(f"error: unknown demo(s) {sorted(unknown)}; demos: {' '.join(demo_names())}", file=sys.stderr)
        return REFUSED_EXIT_STATUS
    results_dir = Path(args.results_dir)

    tier, tier_s = None, 0.0
    if not args.skip_tier:
        with tempfile.TemporaryDirectory() as tmp:
            tier, tier_s = run_tier(args.python, Path(tmp) / "junit.xml")
    demos = []
    if not args.skip_demos:
        for i, name in enumerate(args.demos or demo_names(), 1):
            print(f"[gpu-check] demo {i}/{len(args.demos or demo_names())}: {name}", flush=True)
            demos.append(run_one_demo(args.python, name, args.model, results_dir, args.quick, args.demo_timeout))
            print(f"[gpu-check]   {demos[-1]['status']} in {demos[-1]['seconds']:.0f} s {demos[-1]['detail']}",
                  flush=True)
    report = build_report(args.model, tier, tier_s, demos, args.quick)
    print_report(report)
    print(f"saved {save_report(report, results_dir)}")
    # A demo refused for a missing optional package (the server's, say) is listed, not counted as broken.
    failed = (tier is not None and (tier["failed"] or tier["errors"])) or \
        any(d["status"] in ("failed", "timeout") for d in demos)
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
