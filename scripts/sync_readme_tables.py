"""Copy measured tables from results/*.md into the READMEs, so a README never quotes stale numbers.

A README marks where a result goes:

    <!-- results: tput_cpu_smollm2-135m -->
    (anything here is replaced)
    <!-- /results -->

(a report in a folder under results/ is named with its folder: `p3_3/tput_cpu_smollm2-135m`;
docs/measured.md and the phases' pages in docs/measurements/ are filled the same way),

and every phase README has its "blog vs ours" table, built by scripts/blog_vs_ours.py from
the figures it looks up in results/:

    <!-- blog-vs-ours: p2_1_naive_batching -->
    (replaced)
    <!-- /blog-vs-ours -->

Run `python scripts/sync_readme_tables.py` after `scripts/measure_all.sh`;
`--check` exits 1 if a README is out of date, names a missing result, or a phase
README lacks its blog table (tests/test_readme_tables.py runs it).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import blog_vs_ours  # noqa: E402  (a sibling script)

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"(<!-- results: (?P<stem>[\w.+/-]+) -->\n)(?P<body>.*?)(<!-- /results -->)", re.S)
BLOG_BLOCK = re.compile(r"(<!-- blog-vs-ours: (?P<phase>\w+) -->\n)(?P<body>.*?)(<!-- /blog-vs-ours -->)", re.S)


def sync(readme: Path, check: bool) -> list[str]:
    text = readme.read_text()
    problems: list[str] = []

    def fill(m: re.Match) -> str:
        src = ROOT / "results" / f"{m['stem']}.md"
        if not src.exists():
            problems.append(f"{readme.relative_to(ROOT)}: no results/{m['stem']}.md")
            return m.group(0)
        return m.group(1) + src.read_text().rstrip() + "\n" + m.group(4)

    def fill_blog(m: re.Match) -> str:
        comparison = blog_vs_ours.COMPARISONS.get(m["phase"])
        if comparison is None:
            problems.append(f"{readme.relative_to(ROOT)}: no comparison named {m['phase']} in blog_vs_ours.py")
            return m.group(0)
        try:
            return m.group(1) + blog_vs_ours.render(comparison) + "\n" + m.group(4)
        except (KeyError, ValueError, OSError) as e:
            problems.append(f"{readme.relative_to(ROOT)}: {e}")
            return m.group(0)

    new = BLOG_BLOCK.sub(fill_blog, BLOCK.sub(fill, text))
    phase = readme.parent.name
    if readme.parent.parent.name == "phases" and f"<!-- blog-vs-ours: {phase} -->" not in text:
        problems.append(f"{readme.relative_to(ROOT)}: no blog-vs-ours table (<!-- blog-vs-ours: {phase} -->)")
    if new != text:
        if check:
            problems.append(f"{readme.relative_to(ROOT)}: tables differ from results/")
        else:
            readme.write_text(new)
            print(f"updated {readme.relative_to(ROOT)}")
    return problems


def pages() -> list[Path]:
    """Every page that may quote results/: the READMEs and each phase's measurements page."""
    return [ROOT / "README.md", *sorted(ROOT.glob("phases/*/README.md")), ROOT / "docs" / "measured.md",
            *sorted(ROOT.glob("docs/measurements/*.md"))]


def main(argv: list[str]) -> int:
    check = "--check" in argv
    readmes = pages()
    problems = [p for r in readmes if r.exists() for p in sync(r, check)]
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
