"""Parsing and refusals: one read-only SELECT (a WITH is fine) in DuckDB's dialect, or
a one-line PlanError with line and column.

Planning costs about 10 us of CPU per character of SQL (sqlglot, then the planner's passes over
the tree): a 2 MB ``IN (...)`` list kept a root busy for ~40 s. So the text is capped before
sqlglot sees it, and any one list (``IN``, ``VALUES``, an array) right after parsing, before any
planning; past either the query is refused with one line (``code="too_large"``)."""

from __future__ import annotations

import logging
import re
from typing import Any

from ._sqlglot import exp, sqlglot
from .model import PlanError

# Statement kinds refused anywhere in the tree (sqlglot class names; missing ones skipped).
_REFUSED_KINDS = ("Insert", "Update", "Delete", "Merge", "Create", "Drop", "Alter", "Copy",
                  "Attach", "Detach", "Set", "Pragma", "Command", "Use", "Install", "Load",
                  "TruncateTable", "Transaction", "Commit", "Rollback", "Describe", "Show",
                  "Summarize", "Kill", "Grant", "Revoke", "Comment", "Analyze", "Cache",
                  "Uncache", "Refresh", "Export")


MAX_SQL_CHARS = 64 * 1024  # characters of one query's SQL text
MAX_LIST_ITEMS = 10_000  # items of one literal list in it (IN, VALUES, an array)
# bytes of one value built by repeat()/lpad()/rpad() from literals: DuckDB builds it in one call,
# outside its memory limit and its interrupt (a rank running SQL itself has no engine process
# to bound it)
MAX_LITERAL_VALUE_BYTES = 64 * 2**20

_quieted = False


def check_size(sql: str) -> None:
    """``PlanError`` ("too_large") for SQL text too long to plan."""
    if len(sql) > MAX_SQL_CHARS:
        raise PlanError(f"the query is {len(sql)} characters, over the {MAX_SQL_CHARS} a query may have: "
                        "filter on ranges (BETWEEN) instead of long lists", code="too_large")


def _literal_int(node: Any) -> int | None:
    if isinstance(node, exp.Literal) and not node.is_string:
        try:
            return int(float(node.this))
        except (ValueError, OverflowError):
            return None
    return None


def _built_bytes(node: Any) -> int | None:
    """The size of the value ``repeat``/``lpad``/``rpad`` builds, where literals say it."""
    if isinstance(node, exp.Repeat):
        times = _literal_int(node.args.get("times"))
        text = node.this
        return None if times is None else times * (len(text.this) if isinstance(text, exp.Literal) else 1)
    if isinstance(node, exp.Pad):
        return _literal_int(node.expression)
    return None


def _check_lists(stmt: Any) -> None:
    for node in stmt.walk():
        items = node.args.get("expressions") if isinstance(node, exp.Expression) else None
        if isinstance(items, list) and len(items) > MAX_LIST_ITEMS:
            raise PlanError(f"a list of {len(items)} items in the query, over the {MAX_LIST_ITEMS} one list may "
                            "have: filter on ranges instead", code="too_large")
        size = _built_bytes(node)
        if size is not None and size > MAX_LITERAL_VALUE_BYTES:
            raise PlanError(f"{node.sql(dialect='duckdb')[:60]} builds a value of {size / 2**20:.0f} MiB, over the "
                            f"{MAX_LITERAL_VALUE_BYTES // 2**20} MiB one value may have", code="too_large")


def _parse(sql: str) -> Any:
    global _quieted
    from sqlglot.errors import ParseError, TokenError

    if not _quieted:
        logging.getLogger("sqlglot").addFilter(_QuietFallback())
        _quieted = True
    if not isinstance(sql, str):
        raise PlanError(f"a query is SQL text, got {type(sql).__name__}", code="refused")
    check_size(sql)
    try:
        stmts = [s for s in sqlglot.parse(sql, read="duckdb") if s is not None]
    except ParseError as e:
        err = e.errors[0] if e.errors else {}
        line, col = err.get("line"), err.get("col")
        desc = _clean_desc(str(err.get("description") or str(e).splitlines()[0]))
        near = str(err.get("highlight") or "").strip()
        where = f" at line {line}, column {col}" if line is not None else ""
        raise PlanError(f"syntax error{where}{f' near {near!r}' if near else ''}: {desc}",
                        code="syntax", line=line, col=col) from None
    except TokenError as e:
        line, col = _unterminated(sql)
        if line is not None:
            raise PlanError(f"syntax error at line {line}, column {col}: unterminated quote",
                            code="syntax", line=line, col=col) from None
        raise PlanError(f"syntax error: {str(e).splitlines()[0]}", code="syntax") from None
    tail = "a cluster query is one read-only SELECT"
    if not stmts:
        raise PlanError(f"the query is empty: {tail}", code="refused")
    if len(stmts) > 1:
        raise PlanError(f"{len(stmts)} statements given: {tail}", code="refused")
    stmt = stmts[0]
    _check_lists(stmt)
    refused = tuple(getattr(exp, k) for k in _REFUSED_KINDS if hasattr(exp, k))
    bad = stmt if isinstance(stmt, refused) else stmt.find(*refused)
    if bad is not None or not isinstance(stmt, (exp.Query, exp.Values)):
        raise PlanError(f"{_verb(sql, bad if bad is not None else stmt)} is not allowed: {tail}",
                        code="refused")
    if any(s.args.get("into") for s in stmt.find_all(exp.Select)):
        raise PlanError(f"SELECT INTO creates a table and is not allowed: {tail}", code="refused")
    return stmt


def _clean_desc(desc: str) -> str:
    # sqlglot reports an incomplete clause in terms of its own classes
    m = re.match(r"Required keyword: '\w+' missing for <class '[\w.]*?(\w+)'>", desc)
    return f"incomplete {m.group(1).upper()}" if m else desc


def _unterminated(sql: str) -> tuple[int | None, int | None]:
    """(line, column) of a quote that is never closed, if that is what broke tokenizing."""
    i, n, opened = 0, len(sql), None
    while i < n:
        ch = sql[i]
        if opened is None:
            if sql.startswith("--", i):
                j = sql.find("\n", i)
                i = n if j < 0 else j
            elif sql.startswith("/*", i):
                j = sql.find("*/", i + 2)
                i = n if j < 0 else j + 2
                continue
            elif ch in "'\"":
                opened = i
        elif ch == sql[opened]:
            if i + 1 < n and sql[i + 1] == ch:
                i += 1  # doubled quote: an escaped quote inside the literal
            else:
                opened = None
        i += 1
    if opened is None:
        return None, None
    line = sql.count("\n", 0, opened) + 1
    col = opened - (sql.rfind("\n", 0, opened) + 1) + 1
    return line, col


class _QuietFallback(logging.Filter):
    """sqlglot warns on stderr when it falls back to a generic Command; we refuse those."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Falling back to parsing as a 'Command'" not in record.getMessage()


def _verb(sql: str, node: Any) -> str:
    """What a refused statement is, in the user's words (INSERT, COPY, PRAGMA...)."""
    if isinstance(node, exp.Command):
        return str(node.this).upper()
    try:
        toks = sqlglot.tokenize(sql, read="duckdb")
    except Exception:
        toks = []
    word = toks[0].text.upper() if toks else ""
    if word and word != "WITH" and word.isalpha():
        return word
    return type(node).__name__.upper()

