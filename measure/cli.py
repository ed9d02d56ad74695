"""`python -m common <demo> [--model M --device D --dtype T --<option> ...]` (or `python -m measure`)

Runs any registered demo locally, prints its tables, saves JSON + markdown
(and a PNG when the demo has a plot) under runs/, which git ignores; with
`--reference` under results/, the reference runs the READMEs quote.
`--list` lists demos.
`python -m common serve [--model M --port 8000 ...]` starts the OpenAI-compatible
server of phase 5.6 instead (see phases/p5_6_http_server).

Only the module that defines the chosen demo is imported (measure/demos.py),
so a demo that needs a package missing here fails alone. Bad input (an
unknown demo or model, `--device cuda` without a GPU, a missing package)
ends with one line on stderr and exit status 2, not a traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from common.model import ModelNotAvailable, pick_device, pick_dtype
from measure import demos as registry
from measure.bench import cpu_threads
from measure.report import REPO_ROOT, RESULTS_DIR, RUNS_DIR, print_report, save_report

USAGE_ERROR = 2   # exit status for bad input, as argparse uses
SERVE = "serve"


class BadInput(Exception):
    """Something the user asked for cannot be done here; its message is the whole explanation."""


def build_parser(demo: registry.Demo) -> argparse.ArgumentParser:
    """The command line of one demo: the common flags, then the demo's own options."""
    p = argparse.ArgumentParser(prog=f"python -m common {demo.name}", description=f"[{demo.phase}] {demo.help}")
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m (default), tiny, dummy:<arch>, or a HF id/path")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--dtype", default=None,
                   help="bf16, fp16 or fp32 (default: bf16 on a GPU or a CPU with native bf16, else fp32)")
    p.add_argument("--reference", action="store_true",
                   help="save under results/, the reference runs the READMEs quote (default: runs/, git-ignored)")
    p.add_argument("--results-dir", default=None, help="save JSON/markdown/PNG in this folder instead")
    p.add_argument("--no-save", action="store_true", help="print only, save nothing")
    p.add_argument("--quick", action="store_true", help="the smallest settings that still run every code path")
    if "threads" not in {o.name for o in demo.options}:
        p.add_argument("--threads", type=int, default=0,
                       help="CPU intra-op threads (0: torch's default); 1 is steadier on a shared CPU")
    for o in demo.options:
        help = f"{o.help} (default: {o.cpu} on CPU, {o.gpu if o.gpu is not None else o.cpu} on GPU)"
        if o.positional:
            p.add_argument(o.name, type=o.type, nargs="*" if o.many else "?", default=None, choices=o.choices, help=help)
            continue
        flag = "--" + o.name.replace("_", "-")
        p.add_argument(flag, dest=o.name, type=o.type, nargs="+" if o.many else None, default=None, choices=o.choices,
                       help=help)
    return p


def top_usage() -> str:
    return ("usage: python -m common <demo> [--model M] [--device cpu|cuda] [--dtype bf16|fp16|fp32] [options]\n"
            "       python -m common <demo> --help      that demo's options\n"
            "       python -m common --list             every demo, with its phase and what it prints\n"
            "       python -m common serve [--help]     the OpenAI-compatible server (phase 5)\n\n"
            f"demos: {' '.join(registry.names())}")


def run_demo(name: str, model: str = "smollm2-135m", device: str | None = None, dtype: str | None = None,
             options: dict | None = None, quick: bool = False, threads: int = 0):
    """Resolve the options for this device, run the demo (with `threads` CPU threads if > 0), return its Report."""
    demo = registry.get(name)
    cfg = registry.RunConfig(model=model, device=device, dtype=dtype, quick=quick)
    cfg.options = demo.resolve(cfg.on_gpu, options)
    with cpu_threads(threads):
        return demo.run(cfg)


def output_dir(results_dir: str | None = None, reference: bool = False) -> Path:
    """Where a run's reports go: the folder named, else results/ for a reference run, else runs/."""
    return Path(results_dir) if results_dir else RESULTS_DIR if reference else RUNS_DIR


def where_saved(folder: Path) -> str:
    """The last line a demo prints: the folder its reports went to, and what that folder is."""
    shown = folder.relative_to(REPO_ROOT) if folder.is_relative_to(REPO_ROOT) else folder
    if folder.resolve() == RUNS_DIR.resolve():
        return f"reports saved in {shown}/ (your own runs, ignored by git; results/ holds the reference runs)"
    if folder.resolve() == RESULTS_DIR.resolve():
        return f"reports saved in {shown}/ (the reference runs the READMEs quote)"
    return f"reports saved in {shown}/"


def save_outputs(name: str, report, results_dir: Path | str = RUNS_DIR) -> list[Path]:
    """JSON + markdown, and the demo's plot if it has one. Without the packages the plot needs (matplotlib,
    or the demo's own module, for a report made on another machine), one line says so and the rest is saved."""
    paths = [save_report(report, results_dir)]
    paths.append(paths[0].with_suffix(".md"))
    try:
        demo = registry.get(name)
    except registry.MissingPackage as e:
        print(f"{e} (no plot; the tables are saved)", file=sys.stderr)
        return paths
    if demo.writes is not None:
        paths.append(demo.writes(report, Path(results_dir)))
    if demo.plot is not None:
        png = Path(results_dir) / f"{report.stem()}.png"
        try:
            demo.plot(report, png)
            paths.append(png)
        except ModuleNotFoundError as e:
            package = registry.missing_distribution(e)
            if package is None:
                raise
            print(registry.MissingPackage(f"the plot of '{name}'", package), "(the tables are saved)",
                  file=sys.stderr)
    return paths


def list_demos() -> None:
    loaded, missing = registry.load_all()
    for name in registry.names():
        if name in loaded:
            d = loaded[name]
            print(f"  {d.name:<16} [{d.phase}] {d.help}")
        else:
            print(f"  {name:<16} (unavailable: {missing[name]})")


def check_device_and_dtype(device: str | None, dtype: str | None) -> None:
    """Refuse a device or dtype this machine cannot give before anything loads."""
    try:
        pick_dtype(dtype, pick_device(device))
    except ValueError as e:
        raise BadInput(str(e)) from e


def serve(argv: list[str]) -> int:
    try:
        from phases.p5_6_http_server.launch import main as serve_main
    except ModuleNotFoundError as e:
        package = registry.missing_distribution(e)
        if package is None:
            raise
        raise registry.MissingPackage("`python -m common serve`", package) from e
    return serve_main(argv)


def run_command(argv: list[str]) -> int:
    if argv[:1] == [SERVE]:  # the HTTP server (phase 5) is a long-running command, not a demo
        return serve(argv[1:])
    if not argv or argv[0] in ("-h", "--help"):
        print(top_usage())
        return 0
    if argv[0] == "--list":
        list_demos()
        return 0
    name = argv[0]
    if name.startswith("-"):
        raise BadInput(f"expected a demo name first, got '{name}'\n{top_usage()}")
    demo = registry.get(name)
    args = build_parser(demo).parse_args(argv[1:])
    check_device_and_dtype(args.device, args.dtype)
    given = {o.name: getattr(args, o.name) for o in demo.options if getattr(args, o.name) is not None}
    report = run_demo(name, args.model, args.device, args.dtype, given, quick=args.quick,
                      threads=getattr(args, "threads", 0) or 0)
    print_report(report)
    if not args.no_save:
        folder = output_dir(args.results_dir, args.reference)
        for path in save_outputs(name, report, folder):
            print(f"saved {path}")
        print(where_saved(folder))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        return run_command(argv)
    except (BadInput, registry.UnknownDemo, registry.MissingPackage, ModelNotAvailable) as e:
        print(f"error: {e}", file=sys.stderr)
        return USAGE_ERROR


if __name__ == "__main__":
    sys.exit(main())
