"""Rows as an agent reads them: a Markdown or CSV table within a byte cap that says what was
cut, and the same rows as strict JSON values for the structured answer (the Jupyter server's
REST routes answer with the same values: ``client.payloads.json_safe`` / ``table_rows``).
Pure functions."""

from __future__ import annotations

import csv
import io
from typing import Any, Iterable, Sequence

MAX_CELL_CHARS = 200  # one cell in the text; the structured rows keep the value whole


def _cell(value: Any, markdown: bool) -> str:
    text = "" if value is None else (f"{value:.6g}" if isinstance(value, float) else str(value))
    if len(text) > MAX_CELL_CHARS:
        text = text[:MAX_CELL_CHARS - 1] + "…"
    if markdown:
        text = text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")
    return text


def table_text(columns: Sequence[str], rows: Sequence[Sequence[Any]], *, fmt: str = "markdown",
               max_bytes: int = 32_000, total_rows: int | None = None) -> tuple[str, int]:
    """The rows as a Markdown (or CSV) table of at most ``max_bytes`` UTF-8 bytes, and how many
    rows it shows. A last line says what was cut: rows past the byte cap, and rows the caller
    left out before (``total_rows`` more than ``len(rows)``)."""
    total = len(rows) if total_rows is None else total_rows
    if not columns:
        return "(no columns)", 0
    markdown = fmt != "csv"
    lines: list[str] = []
    if markdown:
        lines.append("| " + " | ".join(_cell(c, True) for c in columns) + " |")
        lines.append("|" + "---|" * len(columns))
    else:
        lines.append(_csv_line(columns))
    used = sum(len(line.encode()) + 1 for line in lines)
    shown = 0
    for row in rows:
        line = ("| " + " | ".join(_cell(v, True) for v in row) + " |") if markdown else _csv_line(
            [_cell(v, False) for v in row])
        size = len(line.encode()) + 1
        if used + size > max_bytes - 120:  # room for the note
            break
        lines.append(line)
        used += size
        shown += 1
    if not rows:
        lines.append("(no rows)")
    elif shown < total:
        lines.append(f"(showing {shown} of {total} rows"
                     + (f"; cut at {max_bytes} bytes" if shown < len(rows) else "")
                     + "; ask with a smaller LIMIT or fewer columns for the rest)")
    return "\n".join(lines), shown


def _csv_line(values: Iterable[Any]) -> str:
    buf = io.StringIO()
    csv.writer(buf, lineterminator="").writerow(values)
    return buf.getvalue()


def records(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[dict[str, Any]]:
    """Rows as dicts for the structured answer (a repeated column name keeps its first value)."""
    out = []
    for row in rows:
        item: dict[str, Any] = {}
        for name, value in zip(columns, row):
            item.setdefault(name, value)
        out.append(item)
    return out
