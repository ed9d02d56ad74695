"""`python -m common <demo> [--model M --device D --dtype T --<option> ...]`

Runs any registered demo locally, prints its tables, saves JSON + markdown
(and a PNG when the demo has a plot) under results/. `--list` lists demos.
`python -m common serve [--model M --port 8000 ...]` starts the OpenAI-compatible
server of phase 5 instead (see phases/p5_serving).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from common import demos as registry
from common.bench import cpu_threads
from common.report import RESULTS_DIR, print_report, save_report


def build_parser(all_demos: dict[str, registry.Demo]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m common", description="Run one demo of the inference-engine phases.")
    p.add_argument("--list", action="store_true", help="list the demos and exit")
    sub = p.add_subparsers(dest="demo", metavar="<demo>")
    for d in all_demos.values():
        sp = sub.add_parser(d.name, help=d.help, description=f"[{d.phase}] {d.help}")
        sp.add_argument("--model", default="smollm2-135m", help="smollm2-135m (default), tiny, dummy:<arch>, or a HF id/path")
        sp.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
        sp.add_argument("--dtype", default=None, help="bf16 (default), fp16 or fp32")
        sp.add_argument("--results-dir", default=str(RESULTS_DIR), help="where JSON/markdown/PNG go")
        sp.add_argument("--no-save", action="store_true", help="print only, save nothing")
        if "threads" not in {o.name for o in d.options}:
            sp.add_argument("--threads", type=int, default=0,
                            help="CPU intra-op threads (0: torch's default); 1 is steadier on a shared CPU")
        for o in d.options:
            flag = "--" + o.name.replace("_", "-")
            sp.add_argument(flag, dest=o.name, type=o.type, nargs="+" if o.many else None, default=None,
                            help=f"{o.help} (default: {o.cpu} on CPU, {o.gpu if o.gpu is not None else o.cpu} on GPU)")
    return p


def run_demo(name: str, model: str = "smollm2-135m", device: str | None = None, dtype: str | None = None,
             options: dict | None = None, quick: bool = False, threads: int = 0):
    """Resolve the options for this device, run the demo (with `threads` CPU threads if > 0), return its Report."""
    demo = registry.get(name)
    cfg = registry.RunConfig(model=model, device=device, dtype=dtype, quick=quick)
    cfg.options = demo.resolve(cfg.on_gpu, options)
    with cpu_threads(threads):
        return demo.run(cfg)


def save_outputs(name: str, report, results_dir: Path | str = RESULTS_DIR) -> list[Path]:
    """JSON + markdown, and the demo's plot if it has one. Returns the paths written."""
    demo = registry.get(name)
    paths = [save_report(report, results_dir)]
    paths.append(paths[0].with_suffix(".md"))
    if demo.plot is not None:
        png = Path(results_dir) / f"{report.stem()}.png"
        demo.plot(report, png)
        paths.append(png)
    return paths


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # the HTTP server (phase 5) is a long-running command, not a demo
        from phases.p5_serving.launch import main as serve
        return serve(argv[1:])
    all_demos = registry.load_all()
    parser = build_parser(all_demos)
    args = parser.parse_args(argv)
    if args.list or not args.demo:
        for d in all_demos.values():
            print(f"  {d.name:<16} [{d.phase}] {d.help}")
        return 0
    demo = all_demos[args.demo]
    given = {o.name: getattr(args, o.name) for o in demo.options if getattr(args, o.name) is not None}
    report = run_demo(args.demo, args.model, args.device, args.dtype, given, threads=getattr(args, "threads", 0) or 0)
    print_report(report)
    if not args.no_save:
        for path in save_outputs(args.demo, report, args.results_dir):
            print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
