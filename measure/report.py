"""Results: what a demo returns, how it prints, and how it is saved.

A demo returns a `Report`: one or more `Table`s plus free-form `data` (the raw
numbers a plot needs) and `meta` (device, model, dtype, versions, commit). A
Report is plain JSON, so the same object travels back from a Modal GPU worker
and is printed and saved on the caller's machine exactly like a local run.
"""

from __future__ import annotations

import json
import platform
import re
import subprocess
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
# Two folders, so a reader's runs never touch what git tracks: runs/ (git-ignored) takes every
# report by default; results/ holds the reference runs the READMEs quote, and changes only on
# purpose (`--reference`, scripts/measure_all.sh).
RESULTS_DIR = REPO_ROOT / "results"
RUNS_DIR = REPO_ROOT / "runs"


@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # printed under the table

    def add_row(self, *cells: Any) -> None:
        if len(cells) != len(self.columns):
            raise ValueError(f"row has {len(cells)} cells, table '{self.title}' has {len(self.columns)} columns")
        self.rows.append(list(cells))


def shorten(text: str, width: int, ellipsis: str = "…") -> str:
    """`text` cut to at most `width` characters for a table cell, ending in `ellipsis` where it was cut."""
    return text if len(text) <= width else text[:width - len(ellipsis)] + ellipsis


@dataclass
class Report:
    demo: str
    tables: list[Table] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def table(self, title: str, columns: list[str]) -> Table:
        t = Table(title, columns)
        self.tables.append(t)
        return t

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Report":
        return cls(d["demo"], [Table(**t) for t in d["tables"]], d.get("data", {}), d.get("meta", {}))

    def stem(self) -> str:
        """File name stem: demo, device and model, e.g. `sweep_cpu_smollm2-135m`."""
        device = self.meta.get("device_name") or self.meta.get("device", "unknown")
        model = self.meta.get("model", "unknown")
        return "_".join(_slug(p) for p in (self.demo, device, model))


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9.+-]+", "-", str(s)).strip("-").lower()


def git_commit() -> str:
    """This checkout's short commit (+dirty when tracked files changed); "unknown" outside a git checkout."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT,
                             capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=5)
        commit = out.stdout.strip() or "unknown"
        return commit + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def environment_meta(device: str | None = None, model: str | None = None, dtype: str | None = None) -> dict[str, Any]:
    """Everything a result needs to be compared later: where, what, which versions."""
    import torch
    import transformers

    meta: dict[str, Any] = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "model": model, "dtype": dtype, "device": device,
        "torch": torch.__version__, "transformers": transformers.__version__,
        "python": platform.python_version(), "commit": git_commit(),
    }
    if device and device.startswith("cuda") and torch.cuda.is_available():
        meta["device_name"] = torch.cuda.get_device_name(0)
    else:
        import os
        meta["device_name"] = "cpu"
        meta["cpu"] = platform.processor() or platform.machine()
        meta["cpu_threads"] = torch.get_num_threads()
        meta["cpu_count"] = os.cpu_count()
    return meta


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "pass" if v else "FAIL"
    if isinstance(v, float):
        if v != v:  # NaN
            return "-"
        return f"{v:,.2f}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def print_report(report: Report, console=None) -> None:
    from rich.console import Console
    from rich.table import Table as RichTable

    console = console or Console()
    m = report.meta
    why = f" ({m['dtype_reason']})" if m.get("dtype_reason") else ""
    console.print(f"[bold]{report.demo}[/bold]  model={m.get('model')}  device={m.get('device_name', m.get('device'))}"
                  f"  dtype={m.get('dtype')}{why}  commit={m.get('commit')}")
    for t in report.tables:
        rt = RichTable(title=t.title, title_justify="left")
        for i, c in enumerate(t.columns):
            rt.add_column(c, justify="left" if i == 0 and t.rows and isinstance(t.rows[0][0], str) else "right")
        for row in t.rows:
            rt.add_row(*[_fmt(v) for v in row])
        console.print(rt)
        for n in t.notes:
            console.print(f"  {n}")


def to_markdown(report: Report) -> str:
    """The tables as GitHub markdown, with the measurement context, for READMEs."""
    m = report.meta
    dtype = f"{m['dtype']}, " if m.get("dtype") else ""     # a demo that runs no model has none
    lines = [f"_{report.demo}: {m.get('model')} on {m.get('device_name', m.get('device'))}, {dtype}"
             f"torch {m.get('torch')}, transformers {m.get('transformers')}, {m.get('date')}, commit {m.get('commit')}_", ""]
    if m.get("dtype_reason"):
        lines += [f"_dtype {m['dtype']}: {m['dtype_reason']}_", ""]
    for t in report.tables:
        lines += [f"**{t.title}**", "", "| " + " | ".join(t.columns) + " |",
                  "|" + "|".join("---:" for _ in t.columns) + "|"]
        lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in t.rows]
        lines += [""] + [f"{n}  " for n in t.notes] + ([""] if t.notes else [])
    return "\n".join(lines)


# to_markdown's first line, read back: the dtype is left out by a demo that runs no model.
MARKDOWN_HEADER = re.compile(r"^_(?P<demo>\w+): (?P<model>\S+) on (?P<device>[^,]+), (?:(?P<dtype>[^,]+), )?"
                             r"torch .*commit (?P<commit>[\w+]+)_$")


def read_markdown(path: Path | str) -> tuple[dict, dict[str, list[list[str]]]]:
    """A saved report's markdown read back (for a report kept only as markdown, such as the GPU baseline's):
    its header's fields (demo, model, device, dtype or None, commit) and its tables as cell text,
    {title: [header row, body rows...]}."""
    path = Path(path)
    lines = path.read_text().splitlines()
    header = MARKDOWN_HEADER.match(lines[0].strip()) if lines else None
    if not header:
        raise ValueError(f"{path}: no report header on its first line")
    tables: dict[str, list[list[str]]] = {}
    title = None
    for line in lines[1:]:
        if line.startswith("**") and line.rstrip().endswith("**"):
            title = line.strip().strip("*")
            tables[title] = []
        elif line.startswith("|") and title is not None and not set(line) <= set("|-: "):
            tables[title].append([c.strip() for c in line.strip().strip("|").split("|")])
    return header.groupdict(), tables


def save_report(report: Report, results_dir: Path | str = RUNS_DIR) -> Path:
    """Write `<stem>.json` and `<stem>.md` under `results_dir` (runs/ by default); return the JSON path."""
    results_dir = Path(results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{report.stem()}.json"
    path.write_text(json.dumps(report.to_dict(), indent=2, default=float) + "\n")
    (results_dir / f"{report.stem()}.md").write_text(to_markdown(report) + "\n")
    return path
