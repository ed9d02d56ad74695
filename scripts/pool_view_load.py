"""Is /pool smooth under a benchmark's load? Headless Chromium on the page while the server is loaded.

    .venv/bin/python scripts/pool_view_load.py --requests 16 --max-tokens 64 --out results/pool-view-load_cpu.md

One process: the server on the packaged model (fp32, the pool sized from memory as `serve` sizes it), the
page open in Debian's chromium (Playwright, that executable), then `--requests` completions sent at once.
The page counts, with the browser's own instruments: long tasks (main-thread work over 50 ms, the
PerformanceObserver "longtask" entry: what a reader feels as a stall), animation frames, and the steps it
drew; the engine counts the steps it made. The page draws only the newest frame per animation frame, so
"steps drawn" below "steps made" is frames skipped by design, not lag.
"""

from __future__ import annotations

import argparse
import os
import shutil
import threading
import time
from pathlib import Path

import httpx
import torch

from common.model import load_model
from measure.background_server import BackgroundServer
from phases.p5_6_http_server.server import create_app

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle. Story number {i}:"
PROBE_JS = """() => {
  window.__probe = {long: [], frames: 0, steps: new Set()};
  new PerformanceObserver(l => l.getEntries().forEach(e => window.__probe.long.push(e.duration)))
    .observe({type: 'longtask', buffered: true});
  const tick = () => { window.__probe.frames++; window.__probe.steps.add(document.body.dataset.step);
                       requestAnimationFrame(tick); };
  requestAnimationFrame(tick);
}"""


def main() -> None:
    from playwright.sync_api import sync_playwright

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--model", default="smollm2-135m", help="tiny steps far faster: a harder test of the page")
    ap.add_argument("--n-blocks", type=int, default=None, help="the pool (default: sized as serve sizes it)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    lm = load_model(args.model, device="cpu", dtype=torch.float32)
    app = create_app(lm, max_running=args.requests, n_blocks=args.n_blocks)
    executable = os.environ.get("CHROMIUM") or shutil.which("chromium")
    with BackgroundServer(app) as srv, sync_playwright() as p:
        engine = app.state.engine.engine
        browser = p.chromium.launch(executable_path=executable, headless=True, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        errors = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.goto(srv.url + "/pool")
        page.wait_for_function("document.body.dataset.step !== undefined")
        page.evaluate(PROBE_JS)
        steps0, t0 = engine.n_steps, time.perf_counter()
        answers = []
        threads = [threading.Thread(target=lambda i=i: answers.append(httpx.post(
            srv.base_url + "/completions", timeout=600, trust_env=False,
            json={"model": lm.name, "prompt": PROMPT.format(i=i), "max_tokens": args.max_tokens,
                  "ignore_eos": True}).status_code)) for i in range(args.requests)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall, steps = time.perf_counter() - t0, engine.n_steps - steps0
        time.sleep(0.5)
        probe = page.evaluate("() => ({long: window.__probe.long, frames: window.__probe.frames, "
                              "steps: window.__probe.steps.size})")
        n_blocks = page.evaluate("document.querySelectorAll('#grid .cell').length")
        browser.close()
    long = sorted(probe["long"])
    rows = [("requests, all 200", f"{args.requests} x {args.max_tokens} tokens, {answers.count(200)} answered 200"),
            ("blocks drawn", n_blocks), ("wall (s)", f"{wall:.2f}"), ("engine steps", steps),
            ("engine steps/s", f"{steps / wall:.1f}"), ("animation frames/s", f"{probe['frames'] / wall:.1f}"),
            ("distinct steps drawn", probe["steps"]), ("long tasks (> 50 ms)", len(long)),
            ("longest task (ms)", f"{long[-1]:.0f}" if long else "none"), ("console errors", len(errors))]
    table = "\n".join(["| | |", "|---|---:|", *[f"| {k} | {v} |" for k, v in rows]])
    print(table)
    if args.out:
        command = (f"python scripts/pool_view_load.py --model {args.model} --requests {args.requests} "
                   f"--max-tokens {args.max_tokens}" + (f" --n-blocks {args.n_blocks}" if args.n_blocks else ""))
        section = (f"## {args.model}, {n_blocks} blocks\n\n`{command}`: fp32, one CPU thread for the engine; "
                   "the page open in Debian's chromium (headless, Playwright) on the same machine.\n\n" + table + "\n")
        if not args.out.exists():
            args.out.write_text("# /pool under load: headless Chromium on the page while the server serves a burst\n\n"
                                + " ".join(__doc__.split("\n\n")[2].split()) + "\n")
        args.out.write_text(args.out.read_text() + "\n" + section)


if __name__ == "__main__":
    main()
