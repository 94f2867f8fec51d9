"""The bounded ring every recorder appends to.

Recording is ``ring.append(row)``: ``collections.deque(maxlen=N).append`` of one tuple,
atomic under the GIL, O(1), no lock; the oldest row falls off when the ring is full.
Readers (the probe thread, at query time) take ``snapshot()``. It sits on the bottom floor,
below ``progress`` (the steps' recorder) and ``tables`` (every other recorder), so both use it.
"""

from __future__ import annotations

from collections import deque


class Ring:
    """A bounded FIFO of rows (tuples). ``append`` is the deque's own bound method."""

    __slots__ = ("_rows", "append", "maxlen")

    def __init__(self, maxlen: int) -> None:
        self._rows: deque = deque(maxlen=max(0, int(maxlen)))
        self.append = self._rows.append
        self.maxlen: int = self._rows.maxlen

    def snapshot(self) -> list:
        """A list copy, oldest first, safe while other threads append.

        ``list(deque)`` runs in C without releasing the GIL, so it cannot interleave
        with an append; the retry only matters on a free-threaded build."""
        rows = self._rows
        for _ in range(16):
            try:
                return list(rows)
            except RuntimeError:  # deque mutated during iteration
                continue
        return list(rows.copy())

    def newest(self) -> object:
        """The row appended last, or None: one read, atomic under the GIL (no copy of the ring)."""
        try:
            return self._rows[-1]
        except IndexError:
            return None

    def clear(self) -> None:
        self._rows.clear()

    def __len__(self) -> int:
        return len(self._rows)

    def __repr__(self) -> str:
        return f"Ring({len(self._rows)}/{self.maxlen})"
