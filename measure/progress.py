"""The transient progress bar every demo shows while it works (gone once the tables print).

    with progress_bar("sweep", total=len(sizes)) as bar:
        for ...:
            bar.describe("sweep: batch 8")   # optional: what it is doing now
            ...
            bar.advance()                    # one item done (bar.advance(n): n more; bar.update(n): n in all)

A scheduler's `run(progress=...)` callback takes (n_done, n_total):
pass `bar.callback`.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator


class Bar:
    """One task on a rich Progress display."""

    def __init__(self, progress, task):
        self._progress, self._task = progress, task

    def update(self, completed: int) -> None:
        """`completed` items are done."""
        self._progress.update(self._task, completed=completed)

    def advance(self, n: int = 1) -> None:
        """n more items are done (one by default)."""
        self._progress.advance(self._task, n)

    def describe(self, text: str) -> None:
        """Show `text` in front of the bar."""
        self._progress.update(self._task, description=text)

    def callback(self, n_done: int, n_total: int) -> None:
        """For `scheduler.run(progress=bar.callback)`."""
        self.update(n_done)


@contextmanager
def progress_bar(description: str, total: int | None) -> Iterator[Bar]:
    """A transient bar of `total` items (None: of unknown length), labelled `description`; yields its `Bar`."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  transient=True) as progress:
        yield Bar(progress, progress.add_task(description, total=total))
