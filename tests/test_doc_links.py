"""Every relative link in the pages a reader follows (the READMEs, docs/, results/'s READMEs) leads somewhere:
the file exists, and a `#heading` after it names a heading of that page. Pages move between the READMEs and
docs/measurements/, so a link written for one place is easily left pointing at the old one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *ROOT.glob("phases/*/README.md"), *ROOT.glob("docs/**/*.md"),
                *ROOT.glob("results/**/README.md")])
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", text))


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


def broken_links(page: Path) -> list[str]:
    """The relative links of `page` that lead nowhere, each with why."""
    problems = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):           # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            problems.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{target}: no heading #{anchor} there")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_leads_somewhere(page):
    assert broken_links(page) == []


def test_the_check_finds_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "b.md").write_text("# Title\n\n## The blog vs ours\n")
    page = tmp_path / "a.md"
    page.write_text("[ok](b.md#the-blog-vs-ours) [gone](c.md) [bad](b.md#measured) [web](https://x.org/y)\n"
                    "```\n[in code](nowhere.md)\n```\n")
    assert broken_links(page) == ["c.md: no such file", "b.md#measured: no heading #measured there"]
