"""Execute a notebook headless (what the notebook tests call): scripts/run_notebooks.py's `run`.

A notebook's text copy (notebooks/NN_name.py, jupytext percent format) is what runs: it is the half
of the pair that is edited, and `tests/test_notebooks.py` checks the executed .ipynb agrees with it.
Nothing is written back.

Each notebook runs in its own fresh kernel, and most of a kernel's time is one core importing
torch and transformers and running single-threaded cells. So the notebooks a session's tests will
ask for (each such test is marked `@pytest.mark.notebook("NN_name.ipynb")`; tests/conftest.py
hands the collected ones to `plan`) run NOTEBOOK_WORKERS at a time, in worker processes, when the
first of them is asked for; each test then checks its own notebook's outputs (or gets its error).
"""

from __future__ import annotations

import importlib.util
import os
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import nbformat

REPO_ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_TIMEOUT_S = 300
NOTEBOOK_WORKERS = max(1, min(2, os.cpu_count() or 1))   # CI has 2 cores

_spec = importlib.util.spec_from_file_location("run_notebooks", REPO_ROOT / "scripts" / "run_notebooks.py")
run_notebooks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run_notebooks)


_planned: list[str] = []                                     # notebooks this session's tests will ask for
_executed: dict[str, nbformat.NotebookNode | BaseException] = {}


def plan(names: list[str]) -> None:
    """The notebooks the collected tests will ask for: the first request runs them all, a few at a time."""
    _planned[:] = list(dict.fromkeys(names))


def _execute(name: str, timeout: int, threads: int | None = None) -> nbformat.NotebookNode:
    if threads:
        # Side by side, each kernel gets its share of the cores: oversubscribed OpenMP threads spin and
        # slow every kernel down (the kernel inherits this environment).
        os.environ["OMP_NUM_THREADS"] = str(threads)
    return run_notebooks.run(REPO_ROOT / "notebooks" / Path(name).with_suffix(".py").name, timeout)


def run_notebook(name: str, timeout: int = NOTEBOOK_TIMEOUT_S) -> nbformat.NotebookNode:
    """Run notebooks/<name> (its .py copy) top to bottom in a fresh kernel of this venv; raise on any cell error."""
    if name not in _executed:
        batch = [n for n in _planned if n not in _executed]
        batch = batch if name in batch else [name]
        # spawn, not fork: this process has torch's threads running, and a worker needs none of its state.
        workers = min(NOTEBOOK_WORKERS, len(batch))
        threads = max(1, (os.cpu_count() or 1) // workers)
        with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn")) as pool:
            futures = {n: pool.submit(_execute, n, timeout, threads) for n in batch}
            for n, future in futures.items():
                try:
                    _executed[n] = future.result()
                except Exception as err:          # kept for the test that asks for this notebook
                    _executed[n] = err
    result = _executed[name]
    if isinstance(result, BaseException):
        raise result
    return result
