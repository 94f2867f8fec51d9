"""A magic's line (and cell) parsed into one command object before anything runs.

``%%cluster_sql [--timeout S] [--ranks SPEC] [--strict] [--per-rank] [--local] [--explain]
[--profile] [-o NAME] [NAME <<]`` with the SQL in the cell, or the line form
``x = %cluster_sql [options] SELECT ...``. Options come first; the SQL is kept as typed
(no shell-style unquoting), so quotes inside it survive. ``$name`` in the SQL names a
Python variable bound as a DuckDB query parameter, never pasted into the text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from IPython.core.error import UsageError

from kernel_probe.frontend import RankRanges, rank_ranges

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*$")
_FLAGS = {"--strict": "strict", "--per-rank": "per_rank", "--local": "local", "--explain": "explain",
          "--profile": "profile"}
_VALUED = {"--timeout", "--ranks", "-o", "--out"}

SQL_USAGE = ("usage: %%cluster_sql [--timeout S] [--ranks SPEC] [--strict] [--per-rank] [--local] [--explain] "
             "[--profile] [-o NAME] [NAME <<]  (SQL in the cell), or  x = %cluster_sql [options] SELECT ...")


@dataclass
class SQLCommand:
    sql: str
    timeout: float | None = None
    ranks: RankRanges | None = None
    strict: bool | None = None  # None: the ClusterSQL.strict setting
    per_rank: bool = False
    local: bool = False
    explain: bool = False
    profile: bool = False  # also print where the time went, hop by hop
    out: str | None = None  # -o NAME / NAME <<: where the full DataFrame goes
    param_names: list[str] = field(default_factory=list)

    def params(self, namespace: Mapping[str, Any]) -> dict[str, Any] | None:
        """The values of ``$name`` from the user's namespace; ``UsageError`` naming a missing one."""
        if not self.param_names:
            return None
        missing = [n for n in self.param_names if n not in namespace]
        if missing:
            raise UsageError(f"${missing[0]}: no variable {missing[0]!r} is defined in this notebook")
        return {n: namespace[n] for n in self.param_names}  # the client makes them plain (or says why not)


def _read_option(tokens: list[str], i: int, flags: Mapping[str, str] | set[str], valued: set[str],
                 usage: str) -> tuple[str, str | bool, int]:
    """The option at ``tokens[i]`` -> (name, its value or True for a flag, the index after it)."""
    tok = tokens[i]
    name, eq, value = tok.partition("=")
    if name in flags and not eq:
        return name, True, i + 1
    if name not in valued:
        raise UsageError(f"unknown option {tok!r}; {usage}")
    if eq:
        return name, value, i + 1
    if i + 1 >= len(tokens):
        raise UsageError(f"option {name} needs a value; {usage}")
    return name, tokens[i + 1], i + 2


def _take_options(tokens: list[str], usage: str) -> tuple[dict[str, str | bool], int]:
    """Leading options of ``tokens`` -> (options, index of the first token that is not one)."""
    opts: dict[str, str | bool] = {}
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok == "--":  # explicit end of options
            return opts, i + 1
        if not tok.startswith("-") or tok.startswith("---") or re.match(r"-\d", tok):
            break  # SQL: a word, a --- comment, a negative number
        name, value, i = _read_option(tokens, i, _FLAGS, _VALUED, usage)
        opts[name] = value
    return opts, i


def parse_sql_command(line: str, cell: str | None = None) -> SQLCommand:
    """``line`` (and ``cell`` for the cell magic) -> an ``SQLCommand``; ``UsageError`` if malformed."""
    tokens = line.split()
    opts, used = _take_options(tokens, SQL_USAGE)
    rest = tokens[used:]
    out = opts.get("-o") or opts.get("--out")
    if len(rest) >= 2 and rest[1] == "<<" or len(rest) >= 1 and rest[0].endswith("<<") and rest[0] != "<<":
        target = rest[0][:-2] if rest[0].endswith("<<") else rest[0]
        rest = rest[1:] if rest[0].endswith("<<") else rest[2:]
        if out:
            raise UsageError("give either -o NAME or NAME <<, not both")
        out = target
    if out is not None and not _IDENT.match(str(out)):
        raise UsageError(f"{out!r} is not a valid Python variable name")
    # the SQL: the rest of the line as typed (from where the options ended) plus the cell
    line_sql = _after_tokens(line, len(tokens) - len(rest))
    sql = "\n".join(part for part in (line_sql, cell or "") if part.strip()).strip()
    if not sql:
        raise UsageError("no SQL to run; " + SQL_USAGE)
    cmd = SQLCommand(sql=sql, out=str(out) if out else None)
    if "--timeout" in opts:
        cmd.timeout = _positive(opts["--timeout"], "--timeout")
    if "--ranks" in opts:
        try:
            cmd.ranks = rank_ranges(str(opts["--ranks"]))
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    cmd.strict = True if opts.get("--strict") else None
    cmd.per_rank = bool(opts.get("--per-rank"))
    cmd.local = bool(opts.get("--local"))
    cmd.explain = bool(opts.get("--explain"))
    cmd.profile = bool(opts.get("--profile"))
    cmd.param_names = parameter_names(sql)
    return cmd


def _after_tokens(line: str, n: int) -> str:
    """``line`` without its first ``n`` whitespace-separated tokens (the rest as typed)."""
    pos = 0
    for _ in range(n):
        m = re.compile(r"\s*\S+").match(line, pos)
        if m is None:
            return ""
        pos = m.end()
    return line[pos:].strip()


def _positive(value: str | bool, name: str, zero: bool = False) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise UsageError(f"{name} takes a number of seconds, not {value!r}") from None
    if not (number >= 0 if zero else number > 0) or number == float("inf"):
        raise UsageError(f"{name} must be {'0 or more' if zero else 'more than 0'} seconds")
    return number


def parameter_names(sql: str) -> list[str]:
    """Names of ``$name`` parameters, in order of first use; those inside string literals,
    quoted identifiers and comments do not count (DuckDB's own tokenizer rules, via sqlglot)."""
    from sqlglot.dialects.duckdb import DuckDB
    from sqlglot.errors import TokenError

    try:
        tokens = DuckDB().tokenize(sql)
    except TokenError:
        return []  # the probe reports the syntax error with its line and column
    names: list[str] = []
    for dollar, name in zip(tokens, tokens[1:]):
        if dollar.token_type.name == "PARAMETER" and dollar.text == "$" and name.start == dollar.end + 1 \
                and _IDENT.match(name.text) and name.text not in names:
            names.append(name.text)
    return names


@dataclass
class OptionsCommand:
    """The options of ``%cluster_connect``, ``%cluster_stacks`` and ``%cluster_nodes``."""

    positional: list[str]
    options: dict[str, str]


def parse_options(line: str, valued: set[str], usage: str, max_positional: int = 0,
                  flags: frozenset[str] = frozenset()) -> OptionsCommand:
    """A simple ``[POSITIONAL] [--opt VALUE] [--flag]...`` line; ``UsageError`` for anything
    else. A flag given is in ``options`` as ``"True"``."""
    tokens = line.split()
    positional: list[str] = []
    options: dict[str, str] = {}
    i = 0
    while i < len(tokens):
        if tokens[i].startswith("-"):
            name, value, i = _read_option(tokens, i, flags, valued, usage)
            options[name] = str(value)
        else:
            positional.append(tokens[i])
            i += 1
    if len(positional) > max_positional:
        raise UsageError(f"unexpected {' '.join(positional[max_positional:])!r}; {usage}")
    return OptionsCommand(positional, options)


def seconds_option(cmd: OptionsCommand, name: str, default: float, zero: bool = False) -> float:
    return _positive(cmd.options[name], name, zero) if name in cmd.options else default


def ranks_option(cmd: OptionsCommand) -> RankRanges | None:
    """``--ranks`` as ranges; the client checks them against the job's size, then expands them."""
    try:
        return rank_ranges(cmd.options.get("--ranks"))
    except ValueError as exc:
        raise UsageError(str(exc)) from None


PROFILE_USAGE = "usage: %cluster_profile [--ranks SPEC] [--steps N] [--out FILE] [--timeout S] [-o NAME]"


@dataclass
class ProfileCommand:
    """The options of ``%cluster_profile``."""

    ranks: RankRanges | None
    steps: int
    out: str | None
    timeout: float | None
    name: str | None


def parse_profile_command(line: str) -> ProfileCommand:
    """``%cluster_profile`` options -> a ``ProfileCommand``; ``UsageError`` if malformed."""
    cmd = parse_options(line, {"--ranks", "--steps", "--out", "--timeout", "-o"}, PROFILE_USAGE)
    steps_text = cmd.options.get("--steps", "2")
    if not steps_text.isdigit() or int(steps_text) < 1:
        raise UsageError(f"--steps needs a whole number of steps >= 1, got {steps_text!r}; {PROFILE_USAGE}")
    name = cmd.options.get("-o")
    if name is not None and not name.isidentifier():
        raise UsageError(f"-o needs a Python name, got {name!r}; {PROFILE_USAGE}")
    timeout = seconds_option(cmd, "--timeout", 0.0) or None
    return ProfileCommand(ranks_option(cmd), int(steps_text), cmd.options.get("--out"), timeout, name)
