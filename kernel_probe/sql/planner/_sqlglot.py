"""sqlglot, imported on first use: a rank that only decodes a plan (``Plan.from_dict``)
never pays for it. ``exp.Select`` imports sqlglot the first time and is a plain
attribute afterwards."""

from __future__ import annotations

import importlib
from typing import Any


class _Lazy:
    def __init__(self, module: str) -> None:
        self.__dict__["_module"] = module

    def __getattr__(self, attr: str) -> Any:
        value = getattr(importlib.import_module(self.__dict__["_module"]), attr)
        setattr(self, attr, value)  # found directly next time
        return value


exp: Any = _Lazy("sqlglot.expressions")
sqlglot: Any = _Lazy("sqlglot")


class _Never:
    """What nothing is an instance of (a sqlglot without PositionalColumn)."""


def positional_column() -> type:
    """exp.PositionalColumn (DuckDB's #1), where this sqlglot has it."""
    return getattr(exp, "PositionalColumn", _Never)
