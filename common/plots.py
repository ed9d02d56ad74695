"""Matplotlib figures drawn from a Report's `data` (never from live objects),
so a plot can be redrawn from a saved results/*.json at any time.

Each helper saves one PNG and closes its figure. Agg backend: no display needed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

FIG_DPI = 120
WIDE = (9, 4.5)


def _finish(fig, path: Path | str, title: str | None = None) -> Path:
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=FIG_DPI)
    plt.close(fig)
    return Path(path)


def lines(path, x: Sequence, series: dict[str, Sequence], xlabel: str, ylabel: str,
          title: str | None = None, logx: bool = False, logy: bool = False, marker: str = "o") -> Path:
    """One axis, one line per series (all sharing x)."""
    fig, ax = plt.subplots(figsize=WIDE)
    for label, ys in series.items():
        ax.plot(x, ys, marker=marker, label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    return _finish(fig, path, title)


def twin_lines(path, x: Sequence, left: tuple[str, Sequence], right: tuple[str, Sequence],
               xlabel: str, title: str | None = None, logx: bool = False) -> Path:
    """Two quantities with different units against one x: left and right y axes."""
    fig, ax = plt.subplots(figsize=WIDE)
    ax.plot(x, left[1], marker="o", color="tab:blue", label=left[0])
    ax.set_ylabel(left[0], color="tab:blue")
    ax2 = ax.twinx()
    ax2.plot(x, right[1], marker="s", color="tab:orange", label=right[0])
    ax2.set_ylabel(right[0], color="tab:orange")
    ax.set_xlabel(xlabel)
    if logx:
        ax.set_xscale("log", base=2)
    ax.grid(alpha=0.3)
    return _finish(fig, path, title)


def bars(path, labels: Sequence[str], series: dict[str, Sequence], ylabel: str,
         title: str | None = None, logy: bool = False) -> Path:
    """Grouped bars: one group per label, one bar per series."""
    fig, ax = plt.subplots(figsize=WIDE)
    n = max(len(series), 1)
    width = 0.8 / n
    for i, (name, ys) in enumerate(series.items()):
        ax.bar([j + i * width for j in range(len(labels))], ys, width, label=name)
    ax.set_xticks([j + width * (n - 1) / 2 for j in range(len(labels))])
    ax.set_xticklabels(labels, rotation=20, ha="right")
    ax.set_ylabel(ylabel)
    if logy:
        ax.set_yscale("log")
    ax.grid(alpha=0.3, axis="y")
    ax.legend()
    return _finish(fig, path, title)


def timelines(path, panels: dict[str, list[dict]], xlabel: str = "time (s)", title: str | None = None) -> Path:
    """Gantt charts, one panel per scheduler: which sequence occupies which slot when.

    panels: {name: [{"slot": int, "start": float, "end": float, "label": str}, ...]}
    """
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 2.2 * len(panels) + 0.5), sharex=True, squeeze=False)
    cmap = plt.get_cmap("tab10")
    for ax, (name, spans) in zip(axes[:, 0], panels.items()):
        for s in spans:
            color = cmap(hash(s["label"]) % 10) if not isinstance(s.get("color"), int) else cmap(s["color"] % 10)
            ax.barh(s["slot"], s["end"] - s["start"], left=s["start"], color=color, edgecolor="black", height=0.8)
            ax.text(s["start"] + (s["end"] - s["start"]) / 2, s["slot"], s["label"], ha="center", va="center", fontsize=8)
        n_slots = 1 + max((s["slot"] for s in spans), default=0)
        ax.set_yticks(range(n_slots))
        ax.set_yticklabels([f"slot {i}" for i in range(n_slots)])
        ax.invert_yaxis()
        ax.set_title(name, loc="left", fontsize=10)
        ax.grid(alpha=0.3, axis="x")
    axes[-1, 0].set_xlabel(xlabel)
    return _finish(fig, path, title)
