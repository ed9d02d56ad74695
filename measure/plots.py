"""Matplotlib figures drawn from a Report's `data` (never from live objects),
so a plot can be redrawn from a saved results/*.json at any time. Every plot of
the project goes through here: no phase imports matplotlib.

Each helper saves one PNG and closes its figure. Agg backend: no display needed.
A figure of several axes is `draw_panels(path, [line_panel(...), bar_panel(...)])`;
`lines`, `bars` and `side_by_side` are the one-row shapes the demos use most.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402

FIG_DPI = 120
WIDE = (9, 4.5)


def _finish(fig, path: Path | str, title: str | None = None) -> Path:
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=FIG_DPI)
    plt.close(fig)
    return Path(path)


# --- panels: one axis each, drawn side by side by `draw_panels` -----------------------------------
Panel = Callable[[Axes], None]   # draws one axis; `draw_panels` puts a row of them in one PNG


def line_panel(x: Sequence, series: dict[str, Sequence], xlabel: str, ylabel: str, title: str | None = None,
               logx: bool = False, logy: bool = False, ticks_at_x: bool = False, from_zero: bool = False,
               marker: str = "o", styles: dict[str, dict] | None = None, hlines: dict[str, float] | None = None,
               legend_fontsize: int | None = None) -> Panel:
    """One line per series against x (log2 x with `logx`, a tick at every x with `ticks_at_x`, y from
    zero with `from_zero`, so a 5% gap looks like one); `styles` {series: matplotlib line options} overrides
    a series' look; `hlines` {label: y} adds dashed grey reference lines."""
    def draw(ax: Axes) -> None:
        for label, ys in series.items():
            ax.plot(x, ys, **{"marker": marker, "label": label, **(styles or {}).get(label, {})})
        for label, y in (hlines or {}).items():
            ax.axhline(y, color="gray", ls="--", label=label)
        if logx:
            ax.set_xscale("log", base=2)
        if ticks_at_x:
            ax.set_xticks(list(x), [str(v) for v in x])
        if logy:
            ax.set_yscale("log")
        if from_zero:
            ax.set_ylim(bottom=0)
        ax.set(xlabel=xlabel, ylabel=ylabel)
        if title:
            ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=legend_fontsize)
    return draw


def bar_panel(labels: Sequence[str], series: dict[str, Sequence], ylabel: str | None = None,
              title: str | None = None, logy: bool = False, slanted: bool = False,
              bar_colors: Sequence[str] | None = None, bands: dict[str, tuple[float, float, str]] | None = None,
              legend: bool = True, legend_fontsize: int | None = None) -> Panel:
    """Grouped bars: one group per label, one bar per series (x labels slanted with `slanted`).
    `bar_colors` colours each bar of a single series; `bands` {label: (lo, hi, color)} shades reference
    ranges behind the bars."""
    def draw(ax: Axes) -> None:
        n = max(len(series), 1)
        width = 0.8 / n
        for i, (name, ys) in enumerate(series.items()):
            # bars coloured one by one carry their meaning in the colours (and the title), not a legend entry
            ax.bar([j + i * width for j in range(len(labels))], ys, width,
                   label=name if bar_colors is None else None,
                   color=list(bar_colors) if bar_colors is not None else None)
        for label, (lo, hi, color) in (bands or {}).items():
            ax.axhspan(lo, hi, color=color, alpha=0.15, label=label)
        ax.set_xticks([j + width * (n - 1) / 2 for j in range(len(labels))])
        ax.set_xticklabels(labels, **(dict(rotation=20, ha="right") if slanted else {}))
        if ylabel:
            ax.set_ylabel(ylabel)
        if logy:
            ax.set_yscale("log")
        if title:
            ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3, axis="y")
        if legend:
            ax.legend(fontsize=legend_fontsize)
    return draw


def draw_panels(path, panels: list[Panel], title: str | None = None,
                panel_size: tuple[float, float] = (5.5, 4.5)) -> Path:
    """The panels next to each other, left to right, in one PNG."""
    fig, axes = plt.subplots(1, len(panels), figsize=(panel_size[0] * len(panels), panel_size[1]), squeeze=False)
    for ax, draw in zip(axes[0], panels):
        draw(ax)
    return _finish(fig, path, title)


# --- one-panel figures and the common shapes ------------------------------------------------------
def lines(path, x: Sequence, series: dict[str, Sequence], xlabel: str, ylabel: str,
          title: str | None = None, logx: bool = False, logy: bool = False, marker: str = "o") -> Path:
    """One axis, one line per series (all sharing x)."""
    return draw_panels(path, [line_panel(x, series, xlabel, ylabel, logx=logx, logy=logy, marker=marker)], title,
                       panel_size=WIDE)


def bars(path, labels: Sequence[str], series: dict[str, Sequence], ylabel: str,
         title: str | None = None, logy: bool = False) -> Path:
    """Grouped bars: one group per label, one bar per series."""
    return draw_panels(path, [bar_panel(labels, series, ylabel, logy=logy, slanted=True)], title, panel_size=WIDE)


def side_by_side(path, x: Sequence, panels: dict[str, dict[str, Sequence]], xlabel: str,
                 title: str | None = None) -> Path:
    """Line panels next to each other, one per quantity ({y label: {series: ys}}), against one x on a
    log2 axis with a tick at every x; each y axis starts at zero."""
    return draw_panels(path, [line_panel(x, series, xlabel, ylabel, logx=True, ticks_at_x=True, from_zero=True)
                              for ylabel, series in panels.items()], title)


def twin_lines(path, x: Sequence, left: tuple[str, Sequence], right: tuple[str, Sequence],
               xlabel: str, title: str | None = None, logx: bool = False, right_logy: bool = False) -> Path:
    """Two quantities with different units against one x: left and right y axes."""
    fig, ax = plt.subplots(figsize=WIDE)
    ax.plot(x, left[1], marker="o", color="tab:blue", label=left[0])
    ax.set_ylabel(left[0], color="tab:blue")
    ax2 = ax.twinx()
    ax2.plot(x, right[1], marker="s", color="tab:orange", label=right[0])
    ax2.set_ylabel(right[0], color="tab:orange")
    if right_logy:
        ax2.set_yscale("log")
    ax.set_xlabel(xlabel)
    if logx:
        ax.set_xscale("log", base=2)
    ax.grid(alpha=0.3)
    return _finish(fig, path, title)


def hbars_used_and_wasted(path, labels: Sequence[str], used: Sequence, wasted: Sequence, used_label: str,
                          wasted_label: str, xlabel: str, title: str | None = None) -> Path:
    """One horizontal bar per label: the part put to use, then (hatched grey) the part spent for nothing."""
    fig, ax = plt.subplots(figsize=(9, 3.5))
    ax.barh(labels, used, color="tab:blue", label=used_label)
    ax.barh(labels, wasted, left=used, color="lightgrey", hatch="//", edgecolor="grey", label=wasted_label)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=2, fontsize=8, frameon=False)
    if title:
        ax.set_title(title)
    return _finish(fig, path)


def gantt(path, panels: dict[str, list[dict]], n_rows: int, row_name: str, xlabel: str,
          title: str | None = None, inches_per_row: float = 0.4, fontsize: int = 8) -> Path:
    """Who holds which row (a slot, a block) when: one panel per name, one bar per holding.

    panels: {panel title: [{"row": int, "start": float, "end": float, "label": str, "color": int,
                            "hatched": bool}]}; `color` indexes the tab10 palette; a hatched span is drawn
    light grey (held for nothing) and unlabelled; a label goes on a span only where it fits.
    """
    height = 1.2 + len(panels) * max(1.2, inches_per_row * n_rows)
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, height), sharex=True, squeeze=False)
    cmap = plt.get_cmap("tab10")
    end = max((s["end"] for spans in panels.values() for s in spans), default=1)
    for ax, (name, spans) in zip(axes[:, 0], panels.items()):
        for s in spans:
            hatched = s.get("hatched", False)
            ax.barh(s["row"], s["end"] - s["start"], left=s["start"], height=0.8, edgecolor="black",
                    linewidth=0.5, color="lightgrey" if hatched else cmap(s["color"] % 10),
                    hatch="//" if hatched else None)
            if not hatched and s["end"] - s["start"] > end / 80:   # too narrow a bar gets no label
                ax.text((s["start"] + s["end"]) / 2, s["row"], s["label"], ha="center", va="center",
                        fontsize=fontsize)
        ax.set_yticks(range(n_rows), [f"{row_name} {i}" for i in range(n_rows)])
        ax.set_ylim(n_rows - 0.5, -0.5)
        if name:
            ax.set_title(name, loc="left", fontsize=10)
        ax.grid(alpha=0.3, axis="x")
    axes[-1, 0].set_xlim(left=0)
    axes[-1, 0].set_xlabel(xlabel)
    return _finish(fig, path, title)


def per_batch_timings(path, rows: list[dict], series: dict[str, str], ylabel: str, title: str | None = None) -> Path:
    """Kernel benchmarks: one panel per batch size, milliseconds against context length (log-log).

    rows: [{"batch", "context", <key>: ms or None}]; series: {key: line label}. A series
    with any None in a panel (not timed here, e.g. a kernel on a CPU) is left out of it.
    """
    from matplotlib.ticker import NullLocator

    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(4.2 * len(batches), 3.6), squeeze=False, sharey=True)
    for ax, b in zip(axes[0], batches):
        sel = sorted((r for r in rows if r["batch"] == b), key=lambda r: r["context"])
        ctx = [r["context"] for r in sel]
        for key, label in series.items():
            ys = [r[key] for r in sel]
            if all(y is not None for y in ys):
                ax.plot(ctx, ys, marker="o", label=label)
        ax.set(title=f"batch {b}", xlabel="context (tokens)", yscale="log")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ctx, [str(c) for c in ctx])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel(ylabel)
    axes[0][0].legend(fontsize=8)
    return _finish(fig, path, title)


# --- address translation, drawn: the virtual-memory analogy ------------------------------------------------
def table_walks(path, panels: list[dict], title: str | None = None) -> Path:
    """Side-by-side drawings of one address translated through a table.

    Each panel dict: title, owner (who holds the table), unit ("page" / "block"), unit_size, table (physical id
    of each logical unit), n_physical, others ({physical id: owner} of the rest), address (the walked one),
    address_name ("address" / "token")."""
    fig, axes = plt.subplots(1, len(panels), figsize=(6.4 * len(panels), 4.2))
    for ax, p in zip(list(axes) if len(panels) > 1 else [axes], panels):
        logical, offset = divmod(p["address"], p["unit_size"])
        n, m = len(p["table"]), p["n_physical"]
        ax.set_xlim(-0.5, max(n, m) + 0.5)
        ax.set_ylim(-0.8, 3.6)
        ax.axis("off")
        ax.set_title(p["title"], fontsize=10)
        ax.text(-0.4, 3.25, f"{p['owner']}: logical {p['unit']}s", fontsize=8, va="center")
        ax.text(-0.4, 0.85, f"physical {p['unit']}s (shared by everyone)", fontsize=8, va="center")
        for i, phys in enumerate(p["table"]):
            walked = i == logical
            ax.add_patch(plt.Rectangle((i, 2.6), 0.9, 0.45, color="tab:orange" if walked else "tab:blue", alpha=0.8))
            ax.text(i + 0.45, 2.82, str(i), ha="center", va="center", fontsize=8, color="white")
            ax.annotate("", xy=(phys + 0.45, 0.65), xytext=(i + 0.45, 2.55),
                        arrowprops=dict(arrowstyle="->", color="tab:orange" if walked else "tab:blue",
                                        lw=1.8 if walked else 0.8))
            ax.text(i + 0.45, 2.35, f"->{phys}", ha="center", fontsize=7)
        mine = set(p["table"])
        for j in range(m):
            color = "tab:orange" if j == p["table"][logical] else "tab:blue" if j in mine else \
                "lightgray" if j in p["others"] else "white"
            ax.add_patch(plt.Rectangle((j, 0.2), 0.9, 0.45, facecolor=color, edgecolor="black", lw=0.5))
            ax.text(j + 0.45, 0.05, str(j), ha="center", va="top", fontsize=7)
            if j in p["others"]:
                ax.text(j + 0.45, 0.42, p["others"][j], ha="center", va="center", fontsize=6)
        phys = p["table"][logical]
        ax.text(-0.4, -0.55, f"{p['address_name']} {p['address']} = {p['unit']} {logical} x {p['unit_size']} + "
                f"{offset}  ->  table[{logical}] = physical {p['unit']} {phys}, offset {offset}", fontsize=8)
    return _finish(fig, path, title)
