"""A/B of the served engine on equal work: this tree against another (the tree before a change), alternating.

    .venv/bin/python scripts/engine_ab.py --before /tmp/before --runs 3 --out results/legibility-ab_cpu_smollm2-135m.md

Each run is a fresh process that imports the served engine from one tree, loads the packaged model on the
CPU, runs the equal-work requests once to warm up, then once timed (`ServingEngine.run`, no HTTP). It reports
output tokens per second of wall time, and the process's CPU time per output token, which other processes on
a shared machine disturb less than the wall time. The arms' order reverses every other run (ABBA).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
N_REQUESTS = 32          # equal work: prompts of 16-128 random ids, 64 output tokens each, EOS ignored
ONE_RUN = r"""
import json, sys, time
import torch
from common.model import load_model
from measure.workload import equal_work
try:
    from phases.p5_1_served_engine.engine import ServingEngine
except ImportError:                      # a tree from before phase 5 was cut into six
    from phases.p5_serving.isolation import ServingEngine
n_requests, dtype, threads = int(sys.argv[1]), getattr(torch, sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(threads)
lm = load_model("smollm2-135m", device="cpu", dtype=dtype)
requests = equal_work(lm.model.config.vocab_size, n=n_requests)

def once():
    engine = ServingEngine(lm)
    for r in requests:
        engine.add(r.prompt_ids, max_new_tokens=r.max_new_tokens, ignore_eos=True)
    wall, cpu = time.perf_counter(), time.process_time()
    tokens = sum(len(s.output_ids) for s in engine.run())
    return tokens, time.perf_counter() - wall, time.process_time() - cpu

once()
tokens, wall, cpu = once()
print(json.dumps({"tokens": tokens, "tok_s": tokens / wall, "cpu_ms_per_token": 1e3 * cpu / tokens}))
"""


def one_run(tree: Path, dtype: str, threads: int) -> dict:
    out = subprocess.run([sys.executable, "-c", ONE_RUN, str(N_REQUESTS), dtype, str(threads)], cwd=tree,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="a checkout of the tree to compare against")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    arms = {"before": args.before.resolve(), "after": HERE}
    runs: dict[str, list[dict]] = {a: [] for a in arms}
    for i in range(args.runs):
        for arm in (list(arms) if i % 2 == 0 else list(reversed(arms))):
            runs[arm].append(one_run(arms[arm], args.dtype, args.threads))
            print(f"run {i + 1}/{args.runs} {arm:6s} {runs[arm][-1]}", flush=True)
    med = {a: {k: statistics.median(r[k] for r in rs) for k in ("tok_s", "cpu_ms_per_token")} for a, rs in runs.items()}
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=args.before, capture_output=True, text=True)
    lines = [f"# The served engine before and after: equal work on the CPU ({args.dtype}, {args.threads} threads)", "",
             f"{N_REQUESTS} requests, prompts of 16-128 random ids, 64 output tokens each, EOS ignored; "
             f"SmolLM2-135M; {args.runs} alternating runs per arm, each a fresh process, warmed up; medians.", "",
             f"- before: `{rev.stdout.strip()}`; after: this commit's tree", "",
             "| arm | tok/s (wall) | CPU ms per token | runs (tok/s) |", "| --- | ---: | ---: | --- |"]
    for arm, m in med.items():
        lines.append(f"| {arm} | {m['tok_s']:.1f} | {m['cpu_ms_per_token']:.2f} | "
                     + ", ".join(f"{r['tok_s']:.1f}" for r in runs[arm]) + " |")
    ratio = med["after"]["tok_s"] / med["before"]["tok_s"]
    cpu_ratio = med["before"]["cpu_ms_per_token"] / med["after"]["cpu_ms_per_token"]
    lines += ["", f"after / before: {ratio:.3f}x in tokens per second, {cpu_ratio:.3f}x in CPU time per token."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
