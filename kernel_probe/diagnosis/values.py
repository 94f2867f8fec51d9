"""Readers of the values the diagnosis gets in rows: plain Python, numpy or pandas values,
where NaN (pandas' NULL) and None mean "not known". One home for the verdict and the
post-mortem analysis."""

from __future__ import annotations

from typing import Any

__all__ = ["as_float", "as_int", "is_true", "as_text"]


def as_float(value: Any) -> float | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if number == number else None  # NaN (pandas' NULL) is no number


def as_int(value: Any) -> int | None:
    number = as_float(value)
    return None if number is None else int(number)


def is_true(value: Any) -> bool:
    """A flag from a bool, numpy's bool or pandas' NULL (NaN, None: not set)."""
    return value is not None and value == value and bool(value)


def as_text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None
