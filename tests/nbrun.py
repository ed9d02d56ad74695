"""Execute a notebook headless (what the notebook tests call).

A notebook's text copy (notebooks/NN_name.py, jupytext percent format) is what runs: it is the half
of the pair that is edited, and `tests/test_notebooks.py` checks the executed .ipynb agrees with it.
"""

from __future__ import annotations

import os
from pathlib import Path

import jupytext
import nbformat
from nbclient import NotebookClient

REPO_ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_TIMEOUT_S = 300


def run_notebook(name: str, timeout: int = NOTEBOOK_TIMEOUT_S) -> nbformat.NotebookNode:
    """Run notebooks/<name> (its .py copy) top to bottom in a fresh kernel of this venv; raise on any cell error."""
    nb = jupytext.read(REPO_ROOT / "notebooks" / Path(name).with_suffix(".py").name)
    env_pp = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = f"{REPO_ROOT}{os.pathsep}{env_pp}" if env_pp else str(REPO_ROOT)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(REPO_ROOT)}})
    client.execute()
    return nb
