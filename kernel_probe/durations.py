"""How long, as every message says it: a member's age ("12 s" ago), how long ranks have
waited, how far apart they stopped. Pure, imports nothing: the membership view, the
diagnosis and the front ends all use ``duration_text``, so the same wait reads the same.
"""

from __future__ import annotations


def duration_text(seconds: float | None) -> str:
    """'0.4 s', '12 s', '3 min', '2.5 h'; '' when unknown. A negative duration (clocks apart) is 0."""
    if seconds is None or seconds != seconds:
        return ""
    seconds = max(0.0, float(seconds))
    if seconds < 9.95:
        return f"{seconds:.1f} s"
    if seconds < 59.5:
        return f"{seconds:.0f} s"
    if seconds < 3570:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


__all__ = ["duration_text"]
