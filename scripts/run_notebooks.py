"""Re-execute the notebooks in place, so the committed .ipynb files show their outputs and plots.

The rule for readable diffs: every notebook is a pair.

    notebooks/03_paging.py      the text you read and edit (jupytext "percent" format: `# %%` cells)
    notebooks/03_paging.ipynb   the same cells, executed, with outputs and plots (what GitHub renders)

Edit the .py, then run `make notebooks` (this script): it reads each .py, runs it top to bottom in a
fresh kernel from the repo root on the CPU, and writes the .ipynb beside it. Editing the .ipynb in
Jupyter works too, since both files carry jupytext's pairing metadata (`jupytext --sync`). Outputs
come from models that need no download (the packaged SmolLM2, or the locally built `tiny`), so
anyone can reproduce them.

    python scripts/run_notebooks.py              every notebook
    python scripts/run_notebooks.py 07 08        the ones whose names start with these
    python scripts/run_notebooks.py --check      no execution: exit 1 if a pair disagrees or outputs are missing
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import jupytext
import nbformat

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
PAIRING = "ipynb,py:percent"            # jupytext's name for the pair: the executed notebook + the text copy
CELL_TIMEOUT_S = 600
# tqdm.auto (imported by the model stack) and rich's live progress warn in a kernel without ipywidgets, naming
# the site-packages path of whoever ran them; that says nothing about the lesson, so the notebooks leave it out.
QUIET_WARNINGS = ("ignore:IProgress not found", 'ignore:install "ipywidgets" for Jupyter support')


def text_copies(prefixes: list[str] | None = None) -> list[Path]:
    """The notebooks' .py copies, sorted, optionally only those whose names start with a prefix."""
    paths = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.py"))
    return [p for p in paths if not prefixes or any(p.name.startswith(x) for x in prefixes)]


def cell_sources(nb: nbformat.NotebookNode) -> list[tuple[str, str]]:
    """(cell type, source) for every cell: what the two halves of a pair must agree on."""
    return [(c.cell_type, c.source.strip()) for c in nb.cells]


def run(py_path: Path, timeout: int = CELL_TIMEOUT_S) -> nbformat.NotebookNode:
    """Run one notebook from its .py copy, top to bottom, in a fresh kernel from the repo root (so `common`,
    `measure` and `phases` import); returns it with its outputs. Raises on a cell error. (The tests call this too.)"""
    from nbclient import NotebookClient

    nb = jupytext.read(py_path)
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    nb.metadata.setdefault("jupytext", {})["formats"] = PAIRING
    # record_timing=False: no per-cell timestamps in the metadata (execute() keeps the cells' ids), so
    # re-running changes only outputs.
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                            resources={"metadata": {"path": str(ROOT)}})
    client.execute(env=kernel_environment())
    return nb


def kernel_environment() -> dict[str, str]:
    """This process's environment for the kernel, plus the repo on PYTHONPATH and the quiet warnings; the
    calling process (a test session, say) keeps its own."""
    env = dict(os.environ)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths if str(ROOT) in paths else [str(ROOT), *paths])
    warnings = [w for w in env.get("PYTHONWARNINGS", "").split(",") if w]
    env["PYTHONWARNINGS"] = ",".join(warnings + [w for w in QUIET_WARNINGS if w not in warnings])
    return env


def keep_cell_ids(nb: nbformat.NotebookNode, previous: Path) -> None:
    """Give every cell whose (type, source) the previous .ipynb also has that cell's id: jupytext makes new
    ids on each read, and an unchanged cell should not show up in the diff for its id alone."""
    if not previous.exists():
        return
    old_ids: dict[tuple[str, str], list[str]] = {}
    for cell in nbformat.read(previous, as_version=4).cells:
        if "id" in cell:
            old_ids.setdefault((cell.cell_type, cell.source.strip()), []).append(cell.id)
    for cell in nb.cells:
        ids = old_ids.get((cell.cell_type, cell.source.strip()))
        if ids:
            cell.id = ids.pop(0)


def execute(py_path: Path) -> Path:
    """Run one notebook from its .py copy; write the executed .ipynb beside it."""
    out = py_path.with_suffix(".ipynb")
    nb = run(py_path)
    keep_cell_ids(nb, out)
    nbformat.write(nb, out)
    return out


def problems_with(py_path: Path) -> list[str]:
    """Why this pair is not committable: a missing or diverged .ipynb, or one without outputs."""
    ipynb = py_path.with_suffix(".ipynb")
    name = ipynb.relative_to(ROOT)
    if not ipynb.exists():
        return [f"{name}: missing (run `make notebooks`)"]
    executed = nbformat.read(ipynb, as_version=4)
    found = []
    if cell_sources(executed) != cell_sources(jupytext.read(py_path)):
        found.append(f"{name}: its cells differ from {py_path.name} (edit one, then `make notebooks`)")
    code = [c for c in executed.cells if c.cell_type == "code"]
    if any(c.execution_count is None for c in code) or not any(c.outputs for c in code):
        found.append(f"{name}: stored without outputs (run `make notebooks`)")
    shows = sum("plt.show()" in c.source for c in code)
    images = sum("image/png" in o.get("data", {}) for c in code for o in c.outputs)
    if images < shows:
        found.append(f"{name}: {shows} plots drawn but {images} stored")
    local = [str(ROOT), "site-packages"]      # where the run's machine keeps things: noise to every reader
    if any(path in str(o) for c in code for o in c.outputs for path in local):
        found.append(f"{name}: an output names a path of the machine that ran it (a library's warning?)")
    return found


def main(argv: list[str]) -> int:
    check = "--check" in argv
    paths = text_copies([a for a in argv if not a.startswith("--")])
    if check:
        orphans = [p for p in sorted(NOTEBOOKS.glob("*.ipynb")) if not p.with_suffix(".py").exists()]
        problems = [f"{p.relative_to(ROOT)}: no paired .py" for p in orphans]
        problems += [msg for p in paths for msg in problems_with(p)]
        for msg in problems:
            print(msg)
        return 1 if problems else 0
    for p in paths:
        t0 = time.perf_counter()
        print(f"{p.relative_to(ROOT)} ...", end=" ", flush=True)
        execute(p)
        print(f"{time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
