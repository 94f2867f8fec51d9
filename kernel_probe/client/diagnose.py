"""``diagnose()``, written once for every client: which queries the verdict needs, in what
order, and the one pure analysis of their answers.

``Diagnosis.run`` is a flow (``calls``): it yields batches of client calls and gets their
answers, so the blocking ``Client`` and the ``DumpClient`` (``calls.drive``) and the
``AsyncClient`` (``calls.drive_async``, each batch at once) run the same queries in the
same order: membership, the process groups (each rank's status; each group's ranks once) and
the main threads' stacks; then the flight recorder's entries from each group's oldest
unfinished collective on. An ended job's dumps
(``EndedJob``) are asked their ends (``reason``) and last steps too, and the verdict puts
who failed first and why before what hung. A live job with no hang is then asked why it is
slow (``diagnosis.slow``): each rank's newest steps and phases, its step-time history, its
host, and the flight recorder's arrival order. ``analyse`` and ``with_slow`` turn the
answers into a ``DiagnoseResult`` without I/O: a new check is one more query in a batch and
one more call there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generator, Iterable, Mapping

from ..config import load_settings
from ..diagnosis import slow as slow_core
from ..diagnosis import verdict as core
from ..diagnosis.values import as_float, as_int, as_text
from ..rank_lists import by_text, groups_text
from .calls import Batch, Call, query
from .results import one_line_reason, positive_number, whole_number

if TYPE_CHECKING:
    import pandas as pd

    from .results import QueryResult

GROUPS_SQL = ("SELECT _rank, group_id, group_name, group_desc, backend, last_enqueued, last_started, last_completed "
              "FROM process_groups")
# each group's ranks once: its list is as long as the group (100 KB of text at 16,384 ranks), on
# every member's row; min() is merged at the ranks and brokers, so one row per group reaches the client
MEMBERS_SQL = "SELECT group_id, group_name, min(ranks) AS members FROM process_groups GROUP BY group_id, group_name"
STACKS_SQL = "SELECT * FROM stacks WHERE is_main ORDER BY _rank, depth"  # '*': frame_type where it exists
_ENTRY_COLUMNS = ("_rank, source, ts, op, group_id, group_name, group_desc, collective_seq_id, p2p_seq_id, op_id, "
                  "is_p2p, state, input_sizes, input_dtypes")
# entries of a group before its oldest unfinished one are kept for context, not more
CONTEXT_ENTRIES = 2
MIN_WAIT_SEC = core.MIN_WAIT_SEC
WINDOW_STEPS = slow_core.WINDOW_STEPS


# an ended job: how far each rank got (the optimizer's steps, else the step it logged)
REASONS_SQL = "SELECT * FROM reason"
STEPS_SQL = "SELECT _rank, max(step) AS step FROM steps GROUP BY _rank"
LOGGED_STEPS_SQL = "SELECT _rank, max(step) AS step FROM metrics WHERE step IS NOT NULL GROUP BY _rank"


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


def rows(answer: "QueryResult | None") -> list[dict[str, Any]]:
    """A query's rows as Arrow gives them (None: a query that had no answer)."""
    table = None if answer is None else answer.table
    return [] if table is None else table.to_pylist()


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


def with_members(groups: list[dict[str, Any]], members: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The process groups' rows with each group's ranks (``MEMBERS_SQL``'s ``members``) as ``ranks``
    on the first row of that group, where the verdict reads them."""
    listed: dict[str, Any] = {}
    for row in members:
        key = core.group_key(row)
        if key is not None and row.get("members") is not None:
            listed.setdefault(key, row["members"])
    for row in groups:
        key = core.group_key(row)
        if key in listed:
            row["ranks"] = listed.pop(key)
    return groups


def merged_coverage(answers: Iterable["QueryResult"]) -> dict[str, Any]:
    """Which ranks every query reached: targeted (any), answered (all), failed (any)."""
    return merge_coverages(a.coverage for a in answers)


def merge_coverages(coverages: Iterable[Mapping[str, Any] | None]) -> dict[str, Any]:
    """``merged_coverage`` of the coverages themselves (one of them may be merged already)."""
    targeted: set[int] = set()
    answered: set[int] | None = None
    failed: dict[Any, str] = {}
    for c in coverages:
        c = c or {}
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
            why = {int(r): one_line_reason(w) for r, w in (coverage.get("failed") or {}).items() if str(r).isdigit()}
            missing = sorted((set(coverage.get("targeted") or ()) - set(coverage.get("answered") or ())) | set(why))
            # 512 ranks of 64 nodes for two reasons: two clauses
            said = by_text(((r, why.get(r, "")) for r in missing), shapes=True)
            extra = ("not every rank answered: " + groups_text(
                said, lambda rs, w: f"{core.ranks_text(rs)} missing" + (f" ({w})" if w else ""), noun="reasons")
                     if missing else "not every rank answered",)
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


@dataclass(frozen=True)
class EndedJob:
    """What an ended job's dumps say besides their tables: how many ranks it had, which left no
    dump (and why), and when its membership was last seen."""

    world_size: int
    missing: Mapping[int, str] = field(default_factory=dict)
    seen_at: float | None = None


@dataclass(frozen=True)
class Diagnosis:
    """One ``diagnose()`` call: its options, the time it was asked (``now``), and, for an
    ended job, what its dumps say (``ended``)."""

    timeout: float
    min_wait: float
    native: bool
    now: float
    ended: EndedJob | None = None
    window: int = WINDOW_STEPS  # the newest steps of each rank the slow verdict weighs
    # how long a slower level of the step time lasts before it is a slowdown (PROBING_SLOWDOWN_MIN_SEC)
    slowdown_min_sec: float = field(default_factory=lambda: load_settings().slowdown_min_sec)

    def __post_init__(self) -> None:  # a caller's bad option is one line, before anything is asked
        positive_number("timeout", self.timeout)
        positive_number("min_wait", self.min_wait, zero=True)
        whole_number("window", self.window)

    def _query(self, sql: str, params: Mapping[str, Any] | None = None, **kw: Any) -> Call:
        # a table no dump holds (a fatal signal's rank alone, a rank with no torch) answers nothing
        return query(sql, params, timeout=self.timeout, optional=self.ended is not None, **kw)

    def run(self) -> Generator[Batch, dict[str, Any], "DiagnoseResult"]:
        first = {"nodes": Call("nodes_raw", (min(self.timeout, 5.0),)), "groups": self._query(GROUPS_SQL),
                 "members": self._query(MEMBERS_SQL), "stacks": self._query(STACKS_SQL, native=self.native)}
        if self.ended is not None:
            first.update(reasons=self._query(REASONS_SQL), steps=self._query(STEPS_SQL))
        answers = yield first
        then: dict[str, Call] = {}
        asked = entries_query(rows(answers["groups"]))
        if asked is not None:
            then["entries"] = self._query(*asked)
        if self.ended is not None and not rows(answers["steps"]):
            then["logged_steps"] = self._query(LOGGED_STEPS_SQL)
        if then:
            answers = {**answers, **(yield then)}
        result = analyse(answers, self.now, self.min_wait, self.ended)
        if self.ended is not None or not result.healthy:
            return result
        slow = yield from self.slow_evidence()
        return with_slow(result, slow)

    def slow_evidence(self) -> Generator[Batch, dict[str, Any], dict[str, Any]]:
        """The rows the slow verdict reads. A query that fails leaves its evidence out, never the verdict."""
        ask = {"steps": query(SLOW_STEPS_SQL, {"n": int(self.window)}, per_rank=True, timeout=self.timeout,
                              optional=True),
               "history": query(SLOW_HISTORY_SQL, {"bin": HISTORY_BIN_SEC, "since": self.now - HISTORY_SEC},
                                per_rank=True, timeout=self.timeout, optional=True),
               "host": query(SLOW_HOST_SQL, per_rank=True, timeout=self.timeout, optional=True)}
        answers = yield ask
        steps = rows(answers.get("steps"))
        starts = [v for v in (as_float(r.get("start")) for r in steps) if v is not None]
        if starts:
            answers = {**answers, **(yield {"arrivals": query(SLOW_ARRIVALS_SQL, {"since": min(starts)},
                                                              timeout=self.timeout, optional=True)})}
        host = answers.get("host")
        # every rank read its clock within the host query: its length bounds what an offset can be
        spread = float(((host.coverage or {}).get("elapsed_ms") or 0.0) / 1000.0) if host is not None else 0.0
        host_rows = rows(host)
        return {"steps": steps, "history": rows(answers.get("history")), "host": host_rows,
                "collectives": rows(answers.get("arrivals")), "offsets_ms": clock_offsets_ms(host_rows, spread),
                "answers": [a for a in answers.values() if a is not None], "window": self.window,
                "min_after_sec": self.slowdown_min_sec}


# the query answers whose coverage is the verdict's, in the order they are merged
_COVERED = ("reasons", "steps", "logged_steps", "groups", "members", "entries", "stacks")


def analyse(answers: Mapping[str, Any], now: float, min_wait: float = core.MIN_WAIT_SEC,
            ended: EndedJob | None = None) -> "DiagnoseResult":
    """The verdict from ``Diagnosis.run``'s answers (``nodes``: the membership as sent; the
    rest: ``QueryResult``s, None where a query had no answer). Pure."""
    nodes = answers.get("nodes") or {}
    members, departures = list(nodes.get("members") or ()), list(nodes.get("departures") or ())
    groups = with_members(rows(answers.get("groups")), rows(answers.get("members")))
    entries, stacks = rows(answers.get("entries")), rows(answers.get("stacks"))
    coverage = merged_coverage(a for name in _COVERED if (a := answers.get(name)) is not None)
    if ended is None:
        verdict = core.diagnose(members, groups, entries, stacks, now, departures=departures, min_wait=min_wait)
        return DiagnoseResult(verdict, coverage)
    from ..diagnosis import failure

    reasons = rows(answers.get("reasons"))
    steps = rows(answers.get("steps")) or rows(answers.get("logged_steps"))
    # the hang verdict is taken at the moment the last rank ended (min_wait counts back from then)
    at = failure.ended_at(reasons) or ended.seen_at or now
    hang = core.diagnose(members, groups, entries, stacks, at, departures=departures, min_wait=min_wait)
    found = failure.analyse(reasons, steps=steps, process_groups=groups, collectives=entries, stacks=stacks,
                            world_size=ended.world_size, missing=ended.missing)
    coverage["failed"] = {**{str(r): why for r, why in ended.missing.items()}, **coverage["failed"]}
    return DiagnoseResult(failure.with_hang(found, hang), coverage)


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


def with_slow(result: DiagnoseResult, slow: Mapping[str, Any]) -> DiagnoseResult:
    """A job with no hang: the slow verdict's findings, its sentence after the hang checks' one. Pure."""
    verdict = result.verdict
    report = slow_core.analyse(slow.get("steps") or [], slow.get("collectives") or [], slow.get("history") or [],
                               slow.get("host") or [], slow.get("offsets_ms") or {},
                               window=slow.get("window") or slow_core.WINDOW_STEPS,
                               min_after_sec=slow.get("min_after_sec") or slow_core.MIN_AFTER_SEC)
    summary = report.summary if report.findings else f"{verdict.summary} {report.summary}"
    coverage = merge_coverages([result.coverage, *(a.coverage for a in slow.get("answers") or ())])
    return DiagnoseResult(core.Verdict(summary, report.findings, verdict.checked + report.checked), coverage)

