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


def test_rerunning_keeps_the_ids_of_unchanged_cells(tmp_path):
    import nbformat

    previous = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1"), nbformat.v4.new_markdown_cell("# a")])
    nbformat.write(previous, tmp_path / "nb.ipynb")
    fresh = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# a"), nbformat.v4.new_code_cell("x = 2")])
    fresh_code_id = fresh.cells[1].id
    run_notebooks.keep_cell_ids(fresh, tmp_path / "nb.ipynb")
    assert fresh.cells[0].id == previous.cells[1].id          # unchanged (moved) cell: its old id
    assert fresh.cells[1].id == fresh_code_id                 # edited cell: a new id


def test_the_kernels_environment_leaves_the_callers_alone(monkeypatch):
    monkeypatch.setenv("PYTHONWARNINGS", "default")
    monkeypatch.delenv("PYTHONPATH", raising=False)
    env = run_notebooks.kernel_environment()
    assert env["PYTHONWARNINGS"].split(",") == ["default", *run_notebooks.QUIET_WARNINGS]
    assert env["PYTHONPATH"] == str(run_notebooks.ROOT)
    import os
    assert os.environ["PYTHONWARNINGS"] == "default" and "PYTHONPATH" not in os.environ
