"""``gc``: the rank's garbage-collection pauses, from ``gc.callbacks``.

A collection stops every Python thread of the process (it holds the GIL), so a rank whose
steps are slow because it collects more than the others is a memory/GC straggler. The
callback runs on whichever thread triggered the collection: two clock reads and one tuple
appended to a bounded ring, nothing else. ``total_ms`` (all pauses so far) lets the step
clock give each step its ``gc_ms``.
"""

from __future__ import annotations

import gc
import time
from typing import Any, Callable

from ..ring import Ring


class GcPauses:
    """Rows ``(ts, generation, duration_ms, collected)``; ``total_ms`` since installed."""

    def __init__(self, rows: int, clock: Callable[[], float] = time.perf_counter,
                 wall: Callable[[], float] = time.time) -> None:
        self.rows = Ring(rows)
        self._append = self.rows.append
        self._clock, self._wall = clock, wall
        self._start: float | None = None
        self.total_ms = 0.0
        self.installed = False

    def callback(self, phase: str, info: dict[str, Any]) -> None:
        try:
            if phase == "start":
                self._start = self._clock()
                return
            start, self._start = self._start, None
            if start is None:
                return
            ms = (self._clock() - start) * 1000.0
            self.total_ms += ms
            self._append((self._wall(), info.get("generation"), ms, info.get("collected")))
        except Exception:  # never in the way of a collection
            pass

    def install(self) -> None:
        if not self.installed:
            gc.callbacks.append(self.callback)
            self.installed = True

    def uninstall(self) -> None:
        if self.installed:
            try:
                gc.callbacks.remove(self.callback)
            except ValueError:
                pass
            self.installed = False

    def total(self) -> float:
        return self.total_ms
