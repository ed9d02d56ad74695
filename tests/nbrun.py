"""Execute a notebook headless (what the notebook tests call): scripts/run_notebooks.py's `run`.

A notebook's text copy (notebooks/NN_name.py, jupytext percent format) is what runs: it is the half
of the pair that is edited, and `tests/test_notebooks.py` checks the executed .ipynb agrees with it.
Nothing is written back.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import nbformat

REPO_ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_TIMEOUT_S = 300

_spec = importlib.util.spec_from_file_location("run_notebooks", REPO_ROOT / "scripts" / "run_notebooks.py")
run_notebooks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run_notebooks)


def run_notebook(name: str, timeout: int = NOTEBOOK_TIMEOUT_S) -> nbformat.NotebookNode:
    """Run notebooks/<name> (its .py copy) top to bottom in a fresh kernel of this venv; raise on any cell error."""
    return run_notebooks.run(REPO_ROOT / "notebooks" / Path(name).with_suffix(".py").name, timeout)
