"""Every README figure quoted from results/ equals the report it comes from, and every phase README
has its blog-vs-ours table (scripts/sync_readme_tables.py --check, scripts/blog_vs_ours.py)."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _script(name: str):
    sys.path.insert(0, str(ROOT / "scripts"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sync = _script("sync_readme_tables")
blog = _script("blog_vs_ours")


def test_readmes_equal_the_results_they_quote():
    readmes = sync.pages()
    assert [p for r in readmes for p in sync.sync(r, check=True)] == []


def test_every_phase_has_a_comparison():
    phases = sorted(p.name for p in (ROOT / "phases").iterdir() if (p / "README.md").exists())
    assert sorted(blog.COMPARISONS) == phases


@pytest.mark.parametrize("phase", sorted(blog.COMPARISONS))
def test_comparison_renders_with_device_and_commit_of_every_figure(phase):
    comparison = blog.COMPARISONS[phase]
    text = blog.render(comparison)
    assert comparison.why and comparison.why in text
    for f in comparison.figures:
        for cell in (f.cpu, f.gpu):
            if isinstance(cell, (blog.Cell, blog.Note)):
                _, header = blog.lookup(cell)
                assert f"`results/{cell.report}.md`" in text and f"commit {header['commit']}" in text


def _report(tmp_path, monkeypatch) -> None:
    (tmp_path / "r.md").write_text(
        "_demo_x: tiny on cpu, float32, torch 2.13.0, transformers 5.23.0, 2026-11-23 10:00 UTC, commit abc1234_\n\n"
        "**speed at each batch**\n\n| batch | engine | tok/s |\n|---:|---:|---:|\n| 1 | a | 10.5 |\n| 1 | b | 12 |\n\n"
        "blocks copied in the whole run: 3  \n")
    monkeypatch.setattr(blog, "RESULTS", tmp_path)


def test_lookup_finds_a_cell_by_title_row_and_column(tmp_path, monkeypatch):
    _report(tmp_path, monkeypatch)
    text, header = blog.lookup(blog.Cell("r", "speed", ("1", "b"), "tok/s"))
    assert text == "12" and header["commit"] == "abc1234" and header["device"] == "cpu"
    assert blog.lookup(blog.Note("r", r"copied in the whole run: (\d+)"))[0] == "3"


@pytest.mark.parametrize("cell", [blog.Cell("r", "speed", ("1",), "tok/s"),          # two rows match
                                  blog.Cell("r", "speed", ("2", "a"), "tok/s"),      # none does
                                  blog.Cell("r", "speed", ("1", "a"), "ms/step"),    # no such column
                                  blog.Cell("r", "memory", ("1", "a"), "tok/s"),     # no such table
                                  blog.Note("r", r"moved: (\d+)")])
def test_lookup_refuses_what_the_report_does_not_say(tmp_path, monkeypatch, cell):
    _report(tmp_path, monkeypatch)
    with pytest.raises(KeyError):
        blog.lookup(cell)
