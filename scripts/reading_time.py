"""How long each phase takes to read, from its own folder: README words / 230 + concept lines / 20.

A phase's concept is every `.py` file in its folder but its demos (`demo.py`,
`*_demo.py`), counted as non-blank lines, comments and docstrings included:
a reader reads them. Whatever is not the phase's idea (benches, tuning,
ahead-of-time checks, alternative paths) belongs in `measure/` or `extras/`,
so it does not count here, and a reader does not meet it on the way.

    python scripts/reading_time.py            the table (markdown)
    python scripts/reading_time.py --check    exit 1 if a phase is over MAX_MINUTES
    python scripts/reading_time.py --readme   write the table into README.md, between its markers
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PHASES = ROOT / "phases"
README_WORDS_PER_MIN = 230     # prose, read with care
CODE_LINES_PER_MIN = 20        # code, read line by line
README = ROOT / "README.md"
MARKERS = ("<!-- reading-time -->", "<!-- /reading-time -->")   # the README's table sits between them
MAX_MINUTES = 25               # no phase over this
TARGET_MINUTES = 15            # most phases under this


def phase_dirs() -> list[pathlib.Path]:
    """Phase folders in reading order (p3_10 after p3_9)."""
    dirs = [d for d in PHASES.iterdir() if d.is_dir() and re.match(r"p\d", d.name)]
    return sorted(dirs, key=reading_order)


def reading_order(phase: pathlib.Path) -> tuple[int, int]:
    """p3_10_cuda_graphs -> (3, 10); p0_generate -> (0, 0)."""
    major, minor = re.match(r"p(\d+)(?:_(\d+))?", phase.name).groups()
    return int(major), int(minor or 0)


def is_demo(path: pathlib.Path) -> bool:
    return path.name == "demo.py" or path.name.endswith("_demo.py")


def concept_files(phase: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in phase.rglob("*.py") if not is_demo(p) and "__pycache__" not in p.parts)


def nonblank_lines(path: pathlib.Path) -> int:
    return sum(1 for line in path.read_text().splitlines() if line.strip())


def measure(phase: pathlib.Path) -> dict:
    words = len((phase / "README.md").read_text().split())
    lines = sum(nonblank_lines(p) for p in concept_files(phase))
    return {"phase": phase.name, "words": words, "lines": lines, "files": len(concept_files(phase)),
            "minutes": words / README_WORDS_PER_MIN + lines / CODE_LINES_PER_MIN}


def table(rows: list[dict]) -> str:
    out = ["| phase | README words | concept lines | concept files | minutes |", "| --- | ---: | ---: | ---: | ---: |"]
    out += [f"| {r['phase']} | {r['words']} | {r['lines']} | {r['files']} | {r['minutes']:.0f} |" for r in rows]
    total = sum(r["minutes"] for r in rows)
    out.append(f"| all {len(rows)} phases | {sum(r['words'] for r in rows)} | {sum(r['lines'] for r in rows)} | "
               f"{sum(r['files'] for r in rows)} | {total:.0f} |")
    return "\n".join(out)


def write_readme(text: str) -> None:
    """Put `text` between the README's markers, in place of what was there."""
    readme = README.read_text()
    start, end = readme.index(MARKERS[0]) + len(MARKERS[0]), readme.index(MARKERS[1])
    README.write_text(readme[:start] + "\n" + text + "\n" + readme[end:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help=f"fail if a phase is over {MAX_MINUTES} minutes")
    parser.add_argument("--readme", action="store_true", help="write the table into README.md")
    args = parser.parse_args(argv)
    rows = [measure(d) for d in phase_dirs()]
    print(table(rows))
    if args.readme:
        write_readme(table(rows))
    over = [r for r in rows if r["minutes"] > MAX_MINUTES]
    under = sum(r["minutes"] < TARGET_MINUTES for r in rows)
    print(f"\n{under} of {len(rows)} phases under {TARGET_MINUTES} minutes; over {MAX_MINUTES}: "
          + (", ".join(f"{r['phase']} ({r['minutes']:.0f})" for r in over) or "none"))
    return 1 if args.check and over else 0


if __name__ == "__main__":
    sys.exit(main())
