"""Every phase README opens, right after its `# Phase ...` title, with a short **Adds:** paragraph:
what the phase adds to the one before, in at most 5 lines of at most 80 characters.
scripts/lessons.py uses that paragraph as the body of the phase's lesson commit."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
READMES = sorted(ROOT.glob("phases/*/README.md"))
MAX_LINES = 5
MAX_WIDTH = 80
WORDS_KEPT_OUT = ("issue", "issues", "owed")   # the reader doesn't know our issues or what is owed


def adds_problems(text: str) -> list[str]:
    """What is wrong with the paragraph after the title; [] if nothing."""
    lines = text.split("\n")
    if not lines[0].startswith("# Phase"):
        return ["the first line is not a `# Phase ...` title"]
    rest = "\n".join(lines[1:]).strip()
    para = rest.split("\n\n", 1)[0].split("\n")
    problems = []
    if not para[0].startswith("**Adds:**"):
        problems.append(f"the first paragraph starts with {para[0][:30]!r}, not '**Adds:**'")
    if len(para) > MAX_LINES:
        problems.append(f"the Adds paragraph has {len(para)} lines, more than {MAX_LINES}")
    problems += [f"line {i} is {len(s)} characters long" for i, s in enumerate(para, 1) if len(s) > MAX_WIDTH]
    words = set(re.findall(r"[a-z]+", " ".join(para).lower()))
    problems += [f"it says {w!r}" for w in WORDS_KEPT_OUT if w in words]
    return problems


def test_there_are_phase_readmes():
    assert len(READMES) >= 19


@pytest.mark.parametrize("readme", READMES, ids=lambda p: p.parent.name)
def test_readme_opens_with_a_short_adds_paragraph(readme):
    assert adds_problems(readme.read_text()) == []


GOOD = "# Phase 9: x\n\n**Adds:** one idea.\nIn two lines.\n\n## Run it\n"


@pytest.mark.parametrize("text, problem", [
    ("# Phase 9: x\n\n**Adds:** one\n2\n3\n4\n5\n6\n\n## Run it\n", "6 lines"),
    ("# Phase 9: x\n\n**What this adds:** one idea.\n", "not '**Adds:**'"),
    ("# Phase 9: x\n\nSome intro.\n\n**Adds:** one idea.\n", "not '**Adds:**'"),
    ("# Phase 9: x\n\n**Adds:** " + "word " * 30 + "\n", "characters long"),
    ("# Phase 9: x\n\n**Adds:** the speedup owed to issue #1.\n", "'issue'"),
])
def test_the_check_fails_a_bad_opening(text, problem):
    assert adds_problems(GOOD) == []
    problems = adds_problems(text)
    assert any(problem in p for p in problems), problems
