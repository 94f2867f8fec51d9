"""``diagnose()``: the few cluster queries the verdict needs, and its result.

Shared by the blocking and the asyncio client: they run the same queries in the same
order (membership, the process groups, the flight recorder's entries from each group's
oldest unfinished collective on, the main threads' stacks) and hand the answers here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Mapping

from ..diagnosis import verdict as core
from ..diagnosis.values import as_int

if TYPE_CHECKING:
    import pandas as pd

    from .results import QueryResult

GROUPS_SQL = ("SELECT _rank, group_id, group_name, group_desc, ranks, backend, last_enqueued, last_started, "
              "last_completed FROM process_groups")
STACKS_SQL = "SELECT * FROM stacks WHERE is_main ORDER BY _rank, depth"  # '*': frame_type where it exists
_ENTRY_COLUMNS = ("_rank, source, ts, op, group_id, group_name, group_desc, collective_seq_id, p2p_seq_id, op_id, "
                  "is_p2p, state, input_sizes, input_dtypes")
# entries of a group before its oldest unfinished one are kept for context, not more
CONTEXT_ENTRIES = 2
MIN_WAIT_SEC = core.MIN_WAIT_SEC


def records(df: "pd.DataFrame | None") -> list[dict[str, Any]]:
    return [] if df is None else df.to_dict("records")


def entries_query(groups: Iterable[Mapping[str, Any]]) -> tuple[str, dict[str, Any]] | None:
    """The flight recorder's entries the verdict reads: per group (by name, or id where
    the entries carry no name), those from a little before the oldest collective a rank
    has not completed. None when no group is known."""
    floor: dict[tuple[str, Any], int] = {}
    for g in groups:
        name, gid = g.get("group_name"), as_int(g.get("group_id"))
        key = ("group_name", name) if isinstance(name, str) and name else ("group_id", gid)
        if key[1] is None:
            continue
        done = as_int(g.get("last_completed"))
        start = max(0, (done if done is not None else 0) - CONTEXT_ENTRIES + 1)
        floor[key] = min(floor.get(key, start), start)
    if not floor:
        return None
    clauses, params = [], {}
    for i, ((column, value), start) in enumerate(sorted(floor.items(), key=lambda kv: (kv[0][0], str(kv[0][1])))):
        clauses.append(f"({column} = $g{i} AND (op_id >= $n{i} OR collective_seq_id >= $n{i}))")
        params[f"g{i}"], params[f"n{i}"] = value, start
    sql = (f"SELECT {_ENTRY_COLUMNS} FROM collectives WHERE source = 'flight_recorder' AND ("
           + " OR ".join(clauses) + ") ORDER BY _rank, group_id, op_id")
    return sql, params


def merged_coverage(answers: Iterable["QueryResult"]) -> dict[str, Any]:
    """Which ranks every query reached: targeted (any), answered (all), failed (any)."""
    targeted: set[int] = set()
    answered: set[int] | None = None
    failed: dict[Any, str] = {}
    for a in answers:
        c = a.coverage or {}
        targeted |= {int(r) for r in c.get("targeted") or ()}
        got = {int(r) for r in c.get("answered") or ()}
        answered = got if answered is None else answered & got
        for rank, why in (c.get("failed") or {}).items():
            failed.setdefault(rank, why)
    answered = answered or set()
    return {"targeted": sorted(targeted), "answered": sorted(answered), "failed": failed,
            "partial": bool(failed) or answered != targeted}


class DiagnoseResult:
    """``summary`` (one sentence), ``findings`` (a DataFrame: kind, ranks, group, seq,
    detail, evidence), ``checked`` (what was looked at), ``coverage`` (which ranks
    answered every query), ``verdict`` (the rows as the core gave them)."""

    def __init__(self, verdict: core.Verdict, coverage: dict[str, Any]) -> None:
        self.verdict = verdict
        self.coverage = coverage
        self._df: "pd.DataFrame | None" = None

    @property
    def summary(self) -> str:
        return self.verdict.summary

    @property
    def checked(self) -> tuple[str, ...]:
        coverage = self.coverage
        extra = ()
        if coverage.get("partial"):
            missing = sorted(set(coverage.get("targeted") or ()) - set(coverage.get("answered") or ()))
            extra = (f"not every rank answered: {core.ranks_text(missing)} missing" if missing
                     else "not every rank answered",)
        return self.verdict.checked + extra

    @property
    def healthy(self) -> bool:
        return self.verdict.healthy

    @property
    def findings(self) -> "pd.DataFrame":
        if self._df is None:
            import pandas as pd

            rows = core.findings_rows(self.verdict)
            df = pd.DataFrame(rows, columns=list(core.FINDING_COLUMNS))
            df["seq"] = pd.array([r["seq"] for r in rows], dtype="Int64")
            df.attrs["summary"] = self.summary
            self._df = df
        return self._df

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: summary, findings (lists of dicts), checked, coverage."""
        return {**self.verdict.to_dict(), "checked": list(self.checked),
                "coverage": {k: v for k, v in self.coverage.items()}}

    def text(self) -> str:
        lines = [self.verdict.summary]
        body = core.Verdict(self.summary, self.verdict.findings, self.checked).text().splitlines()[1:]
        return "\n".join(lines + body)

    def __repr__(self) -> str:
        return f"<DiagnoseResult {len(self.verdict.findings)} findings · {self.summary}>"


def build(nodes_raw: Mapping[str, Any], groups: "QueryResult", entries: "QueryResult | None",
          stacks: "QueryResult", now: float, min_wait: float = core.MIN_WAIT_SEC) -> DiagnoseResult:
    answers = [a for a in (groups, entries, stacks) if a is not None]
    verdict = core.diagnose(list(nodes_raw.get("members") or ()), records(groups.df),
                            records(entries.df) if entries is not None else [], records(stacks.df), now,
                            departures=list(nodes_raw.get("departures") or ()), min_wait=min_wait)
    return DiagnoseResult(verdict, merged_coverage(answers))
