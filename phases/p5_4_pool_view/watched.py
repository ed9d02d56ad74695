"""`WatchedAsyncEngine`: phase 5.3's async engine with step observers and calls on its thread.

The /pool page's frames and the KV events want the engine between steps, on the engine thread that alone
may touch it: a step observer `(engine, outputs)` runs after each step's tokens are routed, and
`call_on_engine(fn)` runs `fn()` once between two steps (a page's first frame, a prefix-cache reset).
"""

from __future__ import annotations

import logging
from collections import deque

from phases.p5_3_metrics.metrics import MeteredAsyncEngine

log = logging.getLogger(__name__)


class WatchedAsyncEngine(MeteredAsyncEngine):
    def __init__(self, engine, **kwargs):
        super().__init__(engine, **kwargs)
        # Replaced whole, never mutated: the engine thread reads the old tuple or the new; empty, it costs nothing.
        self.step_observers: tuple = ()
        self._calls: deque = deque()

    def add_step_observer(self, observe) -> None:
        self.step_observers = (*self.step_observers, observe)

    def remove_step_observer(self, observe) -> None:
        # `!=`, not `is not`: a bound method is a new object at each access (equal, never identical)
        self.step_observers = tuple(o for o in self.step_observers if o != observe)

    def call_on_engine(self, fn) -> None:
        """Run `fn()` on the engine thread between two steps (reading or changing the engine safely)."""
        self._calls.append(fn)   # deque.append is atomic: no lock needed
        self._wake.set()

    # --- engine thread ----------------------------------------------------------------
    def _drain(self) -> None:
        while self._calls:
            try:
                self._calls.popleft()()
            except Exception:  # noqa: BLE001 - a failed call fails alone, never the engine thread
                log.exception("a call on the engine thread raised")
        super()._drain()

    def _dispatch(self, outputs) -> None:
        super()._dispatch(outputs)
        for observe in self.step_observers:
            try:
                observe(self.engine, outputs)
            except Exception:  # noqa: BLE001 - a broken watcher must not stop the engine: it is dropped
                log.exception("a step observer raised; it is removed")
                self.remove_step_observer(observe)

    def label_of(self, seq) -> str | None:
        """The label (the API's response id) of the request `seq` serves; None once it is over."""
        group = self.engine.group_or_none(seq)
        req = self._owner.get(group) if group is not None else None
        return req.label if req is not None else None
