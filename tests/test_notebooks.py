"""The committed notebooks show their outputs, and each agrees with its plain-text copy.

Executing them is tested beside each phase's own tests (tests/test_p*.py call tests.nbrun.run_notebook).
"""

from pathlib import Path

import pytest

from tests.nbrun import run_notebooks

ROOT = Path(__file__).resolve().parent.parent


def test_every_notebook_has_a_text_copy():
    ipynbs = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))
    copies = sorted(p.stem for p in run_notebooks.text_copies())
    assert ipynbs and ipynbs == copies


@pytest.mark.parametrize("py_path", run_notebooks.text_copies(), ids=lambda p: p.stem)
def test_committed_notebook_is_executed_and_paired(py_path):
    assert run_notebooks.problems_with(py_path) == []


def test_check_catches_a_stripped_notebook(tmp_path, monkeypatch):
    import nbformat
    import shutil

    src = run_notebooks.text_copies()[0]
    shutil.copy(src, tmp_path / src.name)
    nb = nbformat.read(src.with_suffix(".ipynb"), as_version=4)
    for c in nb.cells:
        if c.cell_type == "code":
            c.outputs, c.execution_count = [], None
    nbformat.write(nb, tmp_path / src.with_suffix(".ipynb").name)
    monkeypatch.setattr(run_notebooks, "ROOT", tmp_path)
    problems = run_notebooks.problems_with(tmp_path / src.name)
    assert any("without outputs" in p for p in problems)


def test_check_catches_a_warning_that_names_a_local_path(tmp_path, monkeypatch):
    import nbformat
    import shutil

    src = run_notebooks.text_copies()[0]
    shutil.copy(src, tmp_path / src.name)
    nb = nbformat.read(src.with_suffix(".ipynb"), as_version=4)
    first_code = next(c for c in nb.cells if c.cell_type == "code")
    first_code.outputs.append(nbformat.v4.new_output(
        "stream", name="stderr", text="/home/x/.venv/lib/python3.12/site-packages/tqdm/auto.py:21: TqdmWarning\n"))
    nbformat.write(nb, tmp_path / src.with_suffix(".ipynb").name)
    monkeypatch.setattr(run_notebooks, "ROOT", tmp_path)
    problems = run_notebooks.problems_with(tmp_path / src.name)
    assert any("names a path" in p for p in problems)
