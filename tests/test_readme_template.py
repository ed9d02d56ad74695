"""Every phase README follows one template, so a reader finds the same things in the same places:

    # Phase N: title
    **Adds:** ...                        at most 5 lines (tests/test_readme_adds.py)
    ## Files, in reading order           one bullet per .py file of the folder, one line each
    ## <how it works>                    any number of sections on the idea itself
    ## Run it                            the demo, the tests, the notebook
    ## The blog vs ours                  one table, the blog's figures beside ours (device, model, commit)
    ## Measurements                      a link to docs/measurements/<folder>.md, the full reports

Measurement narratives and long detail live on that page, so a README stays short enough to read in one
sitting (MAX_WORDS)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
READMES = sorted(ROOT.glob("phases/*/README.md"))
MAX_WORDS = 1500
MAX_FILE_LINE = 160     # characters: one line per file, not a paragraph
FILES = "Files, in reading order"
RUN = "Run it"
BLOG = "The blog vs ours"
MEASUREMENTS = "Measurements"


def headings(text: str) -> list[str]:
    """The `## ` headings outside code blocks, in order."""
    out, fenced = [], False
    for line in text.split("\n"):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("## "):
            out.append(line[3:].strip())
    return out


def section(text: str, title: str) -> str:
    """The body of the `## title` section (up to the next `## ` heading)."""
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    return m.group(1) if m else ""


def template_problems(text: str, folder: str, py_files: set[str], measurements_exists: bool) -> list[str]:
    """What keeps `text` (the README of phases/<folder>) from the template; [] if nothing."""
    problems = []
    hs = headings(text)
    if not hs or hs[0] != FILES:
        problems.append(f"the first section is {hs[0] if hs else None!r}, not {FILES!r}")
    tail = [h for h in hs if h in (RUN, BLOG, MEASUREMENTS)]
    if tail != [RUN, BLOG, MEASUREMENTS]:
        problems.append(f"sections {tail} are not exactly {[RUN, BLOG, MEASUREMENTS]}, in that order")
    elif hs[-3:] != [RUN, BLOG, MEASUREMENTS]:
        problems.append(f"the README does not end with {[RUN, BLOG, MEASUREMENTS]}: {hs[-3:]}")
    listed = []
    for line in section(text, FILES).strip().split("\n"):
        m = re.match(r"- `([\w/]+\.py)`: \S", line)
        if not m:
            problems.append(f"not a one-line file bullet (- `name.py`: what it holds): {line[:60]!r}")
            continue
        listed.append(m.group(1))
        if len(line) > MAX_FILE_LINE:
            problems.append(f"the line for {m.group(1)} is {len(line)} characters long")
    if sorted(listed) != sorted(py_files):
        problems.append(f"files listed {sorted(listed)} are not the folder's {sorted(py_files)}")
    if "<!-- blog-vs-ours:" not in section(text, BLOG):
        problems.append("the blog-vs-ours table is not in its section")
    if "<!-- results:" in text:
        problems.append("a measurement table: those go on the measurements page")
    link = f"docs/measurements/{folder}.md"
    if link not in section(text, MEASUREMENTS):
        problems.append(f"the Measurements section does not link {link}")
    elif not measurements_exists:
        problems.append(f"{link} does not exist")
    words = len(text.split())
    if words > MAX_WORDS:
        problems.append(f"{words} words, more than {MAX_WORDS}")
    return problems


def folder_py_files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*.py") if p.name != "__init__.py"}


@pytest.mark.parametrize("readme", READMES, ids=lambda p: p.parent.name)
def test_phase_readme_follows_the_template(readme):
    folder = readme.parent
    exists = (ROOT / "docs" / "measurements" / f"{folder.name}.md").exists()
    assert template_problems(readme.read_text(), folder.name, folder_py_files(folder), exists) == []


GOOD = """# Phase 9: x

**Adds:** one idea.

## Files, in reading order

- `a.py`: the idea.
- `demo.py`: its demo.

## How it works

Prose.

## Run it

```bash
make x
```

## The blog vs ours

<!-- blog-vs-ours: p9_x -->
| figure | blog | ours |
<!-- /blog-vs-ours -->

## Measurements

[docs/measurements/p9_x.md](../../docs/measurements/p9_x.md)
"""


@pytest.mark.parametrize("edit, problem", [
    (lambda t: t.replace("- `demo.py`: its demo.\n", ""), "not the folder's"),
    (lambda t: t.replace("- `a.py`: the idea.", "- `a.py`: the idea,\n  over two lines."), "one-line file bullet"),
    (lambda t: t.replace("## Files, in reading order", "## Files"), "the first section"),
    (lambda t: t.replace("## Measurements\n", "## Notes\n"), "in that order"),
    (lambda t: t + "\n## Tests\n", "does not end with"),
    (lambda t: t.replace("<!-- blog-vs-ours: p9_x -->", ""), "blog-vs-ours"),
    (lambda t: t + "<!-- results: x.md -->\n", "measurement table"),
    (lambda t: t.replace("docs/measurements/p9_x.md", "results/"), "does not link"),
    (lambda t: t + "word " * 1500, "words"),
])
def test_the_check_fails_a_broken_readme(edit, problem):
    files = {"a.py", "demo.py"}
    assert template_problems(GOOD, "p9_x", files, True) == []
    problems = template_problems(edit(GOOD), "p9_x", files, True)
    assert any(problem in p for p in problems), problems
