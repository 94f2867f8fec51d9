"""The heartbeat schedule of one probe: when to send the next report.

Rules of this file:

- Pure arithmetic. No clock, no sockets, no threads: the caller asks for a delay,
  sleeps on its own poller, and tells the schedule what happened.
- Periodic interval: starts at ``base``; after each acknowledged *stable* round (the
  sender had the full membership and nothing changed) it is multiplied by ``factor``.
  Anything else (an unstable round, a change, ``set_role``, a failure) puts it back
  to ``base``.
- Every periodic interval is capped at ``cap = min(max_interval, stale - stale // 4 - 1)``
  (18 s at the defaults) so that a member never goes stale between two reports, even
  when ``base`` itself is larger than the cap.
- A failed report is retried soon, never after a full base tick: ``retry_base`` doubling
  per consecutive failure up to ``retry_max``. A success clears the failure streak and
  the round after it runs at base.
"""

from __future__ import annotations

import math

__all__ = ["Backoff"]


def _positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


class Backoff:
    """Report schedule: a periodic interval with stable-round backoff and fast retries."""

    def __init__(
        self,
        base: float = 10.0,
        max_interval: float = 120.0,
        factor: float = 2.0,
        stale: float = 25.0,
        enabled: bool = True,
        retry_base: float = 0.05,
        retry_max: float = 1.0,
    ) -> None:
        self.base = _positive("base", base)
        self.max_interval = _positive("max_interval", max_interval)
        self.factor = _positive("factor", factor)
        if self.factor < 1.0:
            # a factor below 1 would shrink the interval on stability: surely a typo
            raise ValueError(f"factor must be >= 1, got {factor!r}")
        self.stale = _positive("stale", stale)
        self.enabled = bool(enabled)
        self.retry_base = _positive("retry_base", retry_base)
        self.retry_max = _positive("retry_max", retry_max)
        # STALE - STALE/4 - 1 in integer quarters (25 -> 18): a report always lands before one TTL.
        # The floor of 0.1 keeps a tiny stale value from producing a busy loop.
        self.cap: float = max(0.1, min(self.max_interval, self.stale - self.stale // 4 - 1))
        self._current = self.base
        self._failures = 0

    @property
    def failures(self) -> int:
        """Consecutive failed reports since the last success."""
        return self._failures

    def interval(self) -> float:
        """Delay until the next periodic report (always <= cap)."""
        return min(self._current, self.cap)

    def on_success(self, stable: bool) -> float:
        """A report was acknowledged; returns the new periodic interval.

        The first success after failures stays at base (the failure's reset holds for
        one round): growth resumes only from a round that was itself uneventful.
        """
        recovered = self._failures > 0
        self._failures = 0
        if stable and self.enabled and not recovered:
            # cap the stored value too, so one unstable round is not needed to come back down
            self._current = min(self._current * self.factor, self.cap)
        else:
            self._current = min(self.base, self.cap)
        return self.interval()

    def on_failure(self) -> float:
        """A report failed; returns the retry delay (short, exponential, bounded)."""
        delay = min(self.retry_base * (2.0 ** min(self._failures, 64)), self.retry_max)
        self._failures += 1
        # after the retries succeed we are back in an unconverged world: report at base
        self._current = min(self.base, self.cap)
        return delay

    def reset(self) -> float:
        """A membership change or set_role: back to base (capped); returns it.

        The failure streak is left alone: a change says nothing about the parent link.
        """
        self._current = min(self.base, self.cap)
        return self.interval()

    def __repr__(self) -> str:
        return (
            f"Backoff(interval={self.interval():g}, cap={self.cap:g}, "
            f"failures={self._failures}, enabled={self.enabled})"
        )
