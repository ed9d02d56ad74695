"""A/B of the served engine over HTTP: this tree against another (the tree before a change), alternating.

    .venv/bin/python scripts/serve_ab.py --before /tmp/before --runs 3 --out results/pool-view-ab_cpu_smollm2-135m.md

Each run is a fresh process on one CPU thread: a server (BackgroundServer) on the packaged model, fp32, then
`--requests` completions sent at once, `--max-tokens` tokens each (EOS ignored). It reports the wall time
from the first send to the last answer, and the CPU time the process spent in it (every thread: engine,
server, clients), which other processes on a shared machine disturb far less than the wall time. Arms:
`before` (the other tree), `off` (this tree, no page, no events), `view` (this tree, one client reading
/pool/stream throughout), `events` (this tree, KV events on, a ZMQ subscriber reading). The arms' order
reverses every other run (ABBA), so drift touches each alike.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle. Story number {i}:"


def one_run(arm: str, n_requests: int, max_tokens: int) -> dict:
    """In this process: serve, load, time. The tree on sys.path decides the code (before or after)."""
    import httpx
    import torch

    from common.model import load_model
    try:
        from measure.background_server import BackgroundServer
        from phases.p5_6_http_server.server import create_app
    except ModuleNotFoundError:   # a tree from before phase 5 was cut into 5.1-5.6: one folder, by name
        import importlib
        BackgroundServer = importlib.import_module("phases.p5_serving.launch").BackgroundServer
        create_app = importlib.import_module("phases.p5_serving.server").create_app

    torch.set_num_threads(1)
    lm = load_model("smollm2-135m", device="cpu", dtype=torch.float32)
    kw = {"kv_events_endpoint": "tcp://127.0.0.1:0"} if arm == "events" else {}
    app = create_app(lm, max_running=n_requests, **kw)
    stop = threading.Event()
    with BackgroundServer(app) as srv:
        def ask(i: int) -> int:
            r = httpx.post(srv.base_url + "/completions", timeout=600, trust_env=False,
                           json={"model": lm.name, "prompt": PROMPT.format(i=i), "max_tokens": max_tokens,
                                 "temperature": 0, "ignore_eos": True})
            return r.json()["usage"]["completion_tokens"]

        readers = []
        if arm == "view":
            def read_view():
                with httpx.stream("GET", srv.url + "/pool/stream", timeout=600, trust_env=False) as s:
                    for _ in s.iter_lines():
                        if stop.is_set():
                            return
            readers.append(threading.Thread(target=read_view, daemon=True))
        if arm == "events":
            import zmq
            sub = zmq.Context.instance().socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(app.state.server.kv_events.endpoint)

            def read_events():
                while not stop.is_set():
                    if sub.poll(100):
                        sub.recv_multipart()
            readers.append(threading.Thread(target=read_events, daemon=True))
        for t in readers:
            t.start()
        ask(-1)  # warm-up
        time.sleep(0.5)
        t0, c0 = time.perf_counter(), time.process_time()
        results = [0] * n_requests
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, ask(i))) for i in range(n_requests)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        stop.set()
    tokens = sum(results)
    return {"arm": arm, "wall_s": wall, "cpu_s": cpu, "tokens": tokens, "tok_s": tokens / wall,
            "cpu_ms_per_token": 1000 * cpu / tokens}


def spawn(tree: Path, arm: str, args) -> dict:
    code = (f"import sys, json; sys.path.insert(0, {str(tree)!r}); sys.path.insert(1, {str(HERE / 'scripts')!r})\n"
            f"from serve_ab import one_run\n"
            f"print('RESULT', json.dumps(one_run({arm!r}, {args.requests}, {args.max_tokens})))")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(tree))
    done = subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, capture_output=True, text=True,
                          timeout=1200)
    line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    if done.returncode or not line:
        raise RuntimeError(f"{arm} in {tree} failed:\n{done.stdout}\n{done.stderr}")
    return json.loads(line[0][len("RESULT "):])


def git(tree: Path, *a: str) -> str:
    return subprocess.run(["git", *a], cwd=tree, capture_output=True, text=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", type=Path, required=True, help="a checkout of the tree before the change")
    ap.add_argument("--before-commit", default="", help="its commit, for the report")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--arms", nargs="+", default=["before", "off", "view", "events"])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    rows = []
    for run in range(1, args.runs + 1):
        for arm in (args.arms if run % 2 else args.arms[::-1]):
            r = spawn(args.before if arm == "before" else HERE, arm, args)
            r["run"] = run
            rows.append(r)
            print(f"run {run} {arm:>7}: {r['tokens']} tokens in {r['wall_s']:.2f} s = {r['tok_s']:.1f} tok/s, "
                  f"CPU {r['cpu_ms_per_token']:.2f} ms/token", flush=True)
    if args.out:
        def median(arm: str, key: str) -> float:
            xs = sorted(r[key] for r in rows if r["arm"] == arm)
            return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2
        tok_s = {a: median(a, "tok_s") for a in args.arms}
        cpu = {a: median(a, "cpu_ms_per_token") for a in args.arms}
        lines = [f"| {r['run']} | {r['arm']} | {r['tokens']} | {r['wall_s']:.2f} | {r['tok_s']:.1f} | "
                 f"{r['cpu_ms_per_token']:.2f} |" for r in rows]
        args.out.write_text("\n".join([
            f"# The served engine with the pool view and KV events off, on and before them: alternating runs",
            "",
            f"`python scripts/serve_ab.py --before <checkout of {args.before_commit or 'the tree before'}> "
            f"--runs {args.runs} --requests {args.requests} --max-tokens {args.max_tokens}` "
            f"(after: {git(HERE, 'rev-parse', '--short', 'HEAD')}). One machine (CPU, no GPU), smollm2-135m, fp32, "
            f"one CPU thread; {args.requests} completions sent at once, {args.max_tokens} tokens each (EOS "
            "ignored), over HTTP, after one warm-up request; wall time from the first send to the last answer, "
            "and the CPU time of the process (all its threads) over the same span, per token generated. The "
            "arms' order reverses every other run.",
            "", "| run | arm | tokens | wall (s) | tok/s | CPU ms per token |", "|---:|---|---:|---:|---:|---:|",
            *lines, "",
            "| arm | median tok/s | / before | median CPU ms per token | / before |", "|---|---:|---:|---:|---:|",
            *[f"| {a} | {tok_s[a]:.1f} | {tok_s[a] / tok_s['before']:.3f}x | {cpu[a]:.2f} | "
              f"{cpu[a] / cpu['before']:.3f}x |" for a in args.arms], "",
            "before: the tree before the view and the events; off: this tree, nobody watching, events off (the "
            "default); view: one client reading /pool/stream for the whole run; events: KV events on, one ZMQ "
            "subscriber reading.", ""]))


if __name__ == "__main__":
    main()
