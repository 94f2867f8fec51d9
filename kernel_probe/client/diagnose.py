"""``diagnose()``: the few cluster queries the verdict needs, and its result.

Shared by the blocking and the asyncio client: they run the same queries in the same
order (membership, the process groups, the flight recorder's entries from each group's
oldest unfinished collective on, the main threads' stacks) and hand the answers here.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Generator, Iterable, Mapping

from ..diagnosis import slow as slow_core
from ..diagnosis import verdict as core
from ..diagnosis.values import as_float, as_int, as_text
from .errors import ProbeError
from .profiles import Call

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
WINDOW_STEPS = slow_core.WINDOW_STEPS


# --- why is it slow (diagnosis.slow): asked after the hang checks; the per-rank statements run
# whole on each rank (its newest steps, its history in bins, its newest host samples)
SLOW_STEPS_SQL = ("SELECT step, start, duration_ms, data_ms, forward_ms, backward_ms, comm_wait_ms, optimizer_ms, "
                  "cpu_ms, gc_ms FROM steps ORDER BY step DESC LIMIT $n")
HISTORY_BIN_SEC = 2.0  # the step-time history the change point is searched in: bins of this many seconds
HISTORY_SEC = 1800.0  # ... over the last this many seconds
SLOW_HISTORY_SQL = ("SELECT floor(start / $bin) * $bin AS bin_start, median(duration_ms) AS step_ms, "
                    "median(coalesce(duration_ms - comm_wait_ms, cpu_ms)) AS own_ms, count(*) AS steps "
                    "FROM steps WHERE start >= $since AND duration_ms IS NOT NULL GROUP BY 1 ORDER BY 1")
SLOW_HOST_SQL = ("SELECT avg(load1) AS load1, avg(others_cpu_pct) AS others_cpu_pct, "
                 "avg(run_delay_pct) AS run_delay_pct, avg(main_cpu_pct) AS main_cpu_pct, "
                 "min(mem_available_bytes) AS mem_available_bytes, max(mem_pressure_pct) AS mem_pressure_pct, "
                 "count(*) AS samples, epoch_ms(get_current_timestamp()) / 1000.0 AS now "
                 "FROM (SELECT * FROM host ORDER BY ts DESC LIMIT 5)")
SLOW_ARRIVALS_SQL = ("SELECT _rank, group_id, group_name, collective_seq_id, ts, op, is_p2p FROM collectives "
                     "WHERE source = 'flight_recorder' AND NOT coalesce(is_p2p, false) AND ts >= $since")


def slow_evidence(now: float, timeout: float, window: int = slow_core.WINDOW_STEPS
                  ) -> Generator[Call, Any, dict[str, Any]]:
    """The rows the slow verdict reads, as the queries a client runs (``profiles.drive`` or
    ``drive_async`` carry them out). A query that fails leaves its evidence out, never the verdict."""
    answers: list[Any] = []

    def ask(sql: str, **kwargs: Any) -> Generator[Call, Any, Any]:
        try:
            answer = yield Call("query", (sql,), {"timeout": timeout, **kwargs})
        except ProbeError:
            return None
        answers.append(answer)
        return answer

    steps = yield from ask(SLOW_STEPS_SQL, per_rank=True, params={"n": int(window)})
    step_rows = records(steps.df) if steps is not None else []
    starts = [v for v in (as_float(r.get("start")) for r in step_rows) if v is not None]
    history = yield from ask(SLOW_HISTORY_SQL, per_rank=True,
                             params={"bin": HISTORY_BIN_SEC, "since": now - HISTORY_SEC})
    q0 = time.monotonic()
    host = yield from ask(SLOW_HOST_SQL, per_rank=True)
    q1 = time.monotonic()
    arrivals = None
    if starts:
        arrivals = yield from ask(SLOW_ARRIVALS_SQL, params={"since": min(starts)})
    host_rows = records(host.df) if host is not None else []
    return {"steps": step_rows, "history": records(history.df) if history is not None else [],
            "host": host_rows, "collectives": records(arrivals.df) if arrivals is not None else [],
            "offsets_ms": clock_offsets_ms(host_rows, q1 - q0), "answers": answers, "window": window}


def clock_offsets_ms(host_rows: Iterable[Mapping[str, Any]], spread_sec: float) -> dict[int, float]:
    """Each host's clock offset from the first host's, from the ``now`` every rank read within one
    query of ``spread_sec``: applied only where it exceeds what the query's own length could make
    of it (one machine, or hosts in sync, get none)."""
    nows: dict[str, list[tuple[int, float]]] = {}
    for row in host_rows:
        rank, now, host = as_int(row.get("_rank")), as_float(row.get("now")), as_text(row.get("_host"))
        if rank is not None and now is not None:
            nows.setdefault(host or "", []).append((rank, now))
    if len(nows) < 2:
        return {}
    hosts = sorted(nows)
    ref = min(n for _, n in nows[hosts[0]])
    out: dict[int, float] = {}
    for h in hosts[1:]:
        offset = min(n for _, n in nows[h]) - ref
        if abs(offset) > spread_sec:
            out.update({r: offset * 1000.0 for r, _ in nows[h]})
    return out


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
          stacks: "QueryResult", now: float, min_wait: float = core.MIN_WAIT_SEC,
          slow: Mapping[str, Any] | None = None) -> DiagnoseResult:
    """The verdict: the hang checks first; where they find nothing, why the job is slow (``slow``:
    what ``slow_evidence`` returned)."""
    answers = [a for a in (groups, entries, stacks) if a is not None]
    verdict = core.diagnose(list(nodes_raw.get("members") or ()), records(groups.df),
                            records(entries.df) if entries is not None else [], records(stacks.df), now,
                            departures=list(nodes_raw.get("departures") or ()), min_wait=min_wait)
    if slow is not None and verdict.healthy:
        verdict = with_slow(verdict, slow)
        answers += [a for a in slow.get("answers") or () if a is not None]
    return DiagnoseResult(verdict, merged_coverage(answers))


def with_slow(verdict: core.Verdict, slow: Mapping[str, Any]) -> core.Verdict:
    """A job with no hang: the slow verdict's findings, its sentence after the hang checks' one."""
    report = slow_core.analyse(slow.get("steps") or [], slow.get("collectives") or [], slow.get("history") or [],
                               slow.get("host") or [], slow.get("offsets_ms") or {},
                               window=slow.get("window") or slow_core.WINDOW_STEPS)
    summary = report.summary if report.findings else f"{verdict.summary} {report.summary}"
    return core.Verdict(summary, report.findings, verdict.checked + report.checked)
