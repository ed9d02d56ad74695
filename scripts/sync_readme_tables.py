"""Copy measured tables from results/*.md into the READMEs, so a README never quotes stale numbers.

A README marks where a result goes:

    <!-- results: tput_cpu_smollm2-135m -->
    (anything here is replaced)
    <!-- /results -->

Run `python scripts/sync_readme_tables.py` after `scripts/measure_all.sh`;
`--check` exits 1 if a README is out of date or names a missing result.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"(<!-- results: (?P<stem>[\w.+-]+) -->\n)(?P<body>.*?)(<!-- /results -->)", re.S)


def sync(readme: Path, check: bool) -> list[str]:
    text = readme.read_text()
    problems: list[str] = []

    def fill(m: re.Match) -> str:
        src = ROOT / "results" / f"{m['stem']}.md"
        if not src.exists():
            problems.append(f"{readme.relative_to(ROOT)}: no results/{m['stem']}.md")
            return m.group(0)
        return m.group(1) + src.read_text().rstrip() + "\n" + m.group(4)

    new = BLOCK.sub(fill, text)
    if new != text:
        if check:
            problems.append(f"{readme.relative_to(ROOT)}: tables differ from results/")
        else:
            readme.write_text(new)
            print(f"updated {readme.relative_to(ROOT)}")
    return problems


def main(argv: list[str]) -> int:
    check = "--check" in argv
    readmes = [ROOT / "README.md", *sorted(ROOT.glob("phases/*/README.md"))]
    problems = [p for r in readmes if r.exists() for p in sync(r, check)]
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
