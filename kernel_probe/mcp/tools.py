"""The tools an agent calls, as plain async functions over a ``JobSource``: the MCP server
declares each once (``server``) and the playbook runner calls the same ones. Nothing here
imports the MCP SDK.

Every answer is an ``Answer``: text an agent reads (tables as Markdown or CSV within a byte
cap that says what was cut) and the same rows as structured data. Failures are answers too,
one line each (``error``), never a traceback: a bad argument names the argument.

Safe by default: SQL goes to the job's read-only sandbox (the ranks refuse what writes or
reads files); no tool runs code in a rank; rows, bytes, time and calls in flight are capped;
a profile capture runs one at a time and its trace goes where the server keeps traces.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from .jobs import BadArgument, JobSource
from ..client.payloads import json_safe, table_rows
from .render import records, table_text

log = logging.getLogger("kernel_probe.mcp")

MAX_ROWS = 1000  # rows a sql answer may carry
DEFAULT_ROWS = 100
MAX_TEXT_BYTES = 32_000  # the text of one answer
MAX_TIMEOUT_SEC = 60.0  # a query's deadline, at most
MAX_PROFILE_STEPS = 20
MAX_PROFILE_SEC = 300.0
MAX_CALLS = 4  # tool calls in flight per server; more wait up to CALL_WAIT_SEC, then are refused
CALL_WAIT_SEC = 10.0
MAX_SQL_CHARS = 20_000
STACK_GROUPS = 20  # groups of identical stacks shown
ANSWER_GRACE_SEC = 5.0  # beyond a query's own deadline before the tool gives up on it


@dataclass
class Answer:
    """What a tool says: ``text`` for the agent to read, ``data`` the same as JSON values."""

    text: str
    data: dict[str, Any] = field(default_factory=dict)
    error: bool = False


def _check_timeout(timeout: float, name: str = "timeout", top: float = MAX_TIMEOUT_SEC) -> float:
    if not 0 < timeout <= top:
        raise BadArgument(name, f"must be in (0, {top:g}] seconds, not {timeout:g}")
    return float(timeout)


def _check_ranks(ranks: str | None) -> list[int] | None:
    from ..rank_lists import parse_ranks

    if ranks in (None, ""):
        return None
    try:
        return parse_ranks(ranks)
    except ValueError as exc:
        raise BadArgument("ranks", f"{exc} (expected a list like 0-3,8)") from None


def coverage_text(coverage: dict[str, Any]) -> str:
    """Who answered, whether the answer is partial and why: one line."""
    from ..client import describe_failures

    answered, targeted = coverage.get("answered") or [], coverage.get("targeted") or []
    text = f"coverage: {len(answered)}/{len(targeted)} ranks answered"
    if coverage.get("elapsed_ms") is not None:
        text += f" · {coverage['elapsed_ms']:.0f} ms"
    if coverage.get("partial"):
        text += f" · PARTIAL: {describe_failures(coverage)}"
    return text


def _coverage_data(coverage: dict[str, Any]) -> dict[str, Any]:
    keep = ("targeted", "answered", "partial", "failed", "elapsed_ms", "plan", "pruned")
    return json_safe({k: coverage[k] for k in keep if k in coverage})


def error_text(exc: BaseException) -> str:
    """One line for a failure an agent can act on."""
    from ..client import QueryFailed

    text = (str(exc).splitlines() or [type(exc).__name__])[0]
    if isinstance(exc, QueryFailed) and exc.line is not None:
        text += f" (line {exc.line}, column {exc.col})"
    return text


class Toolbox:
    """The tools of one server over ``jobs``; calls beyond ``MAX_CALLS`` in flight wait, then are refused."""

    def __init__(self, jobs: JobSource) -> None:
        self.jobs = jobs
        self._calls = asyncio.Semaphore(MAX_CALLS)
        self._capture = asyncio.Lock()  # one profile capture at a time
        self._traces = itertools.count(1)

    async def run(self, name: str, **args: Any) -> Answer:
        """Call tool ``name``; every expected failure comes back as an error ``Answer``."""
        from ..client import ProbeError
        from ..jobs import UnknownJob

        fn: Callable[..., Awaitable[Answer]] | None = getattr(self, "tool_" + name, None)
        if fn is None:
            return Answer(f"no tool named {name!r}", {"error": {"message": f"no tool named {name!r}"}}, error=True)
        try:
            await asyncio.wait_for(self._calls.acquire(), CALL_WAIT_SEC)
        except asyncio.TimeoutError:
            return _failed(f"busy: {MAX_CALLS} tool calls are already running on this server; try again shortly")
        try:
            return await fn(**args)
        except UnknownJob as exc:  # a job id no longer (or never) known here
            return _bad(BadArgument("job", f"{exc} (see the jobs tool)"))
        except BadArgument as exc:
            return _bad(exc)
        except (ProbeError, ValueError, OSError, asyncio.TimeoutError) as exc:
            return _failed(error_text(exc) if str(exc) else f"{type(exc).__name__}: no answer in time")
        except Exception as exc:  # a bug of ours: one line for the agent, the traceback in the server's log
            log.exception("tool %s failed", name)
            return _failed(f"internal error in tool {name}: {type(exc).__name__}: {error_text(exc)}")
        finally:
            self._calls.release()

    # -- the tools -------------------------------------------------------------------------

    async def tool_jobs(self) -> Answer:
        jobs = [json_safe(j) for j in await self.jobs.list()]
        columns = ["id", "run_id", "world_size", "alive", "source", "host", "target"]
        text, _ = table_text(columns, [[j.get(c) for c in columns] for j in jobs], max_bytes=MAX_TEXT_BYTES)
        head = f"{len(jobs)} job(s) known; pass `job` (an id below) to the other tools, or leave it out for the first."
        return Answer(head + "\n\n" + text if jobs else "no job is known here", {"jobs": jobs})

    async def tool_nodes(self, job: str | None = None) -> Answer:
        from ..membership.view import membership_view

        async def nodes(client: Any) -> tuple[dict, dict, float]:
            return await client.nodes_raw(5.0), dict(client.info_), getattr(client, "seen_at", None) or time.time()

        raw, info, now = await self.jobs.call(job, nodes, 5.0)
        view = membership_view(raw.get("members") or [], now, raw.get("departures") or [])
        columns = ["rank", "node", "host", "pid", "role", "state", "state_for", "reason", "age", "step", "step_time_ms",
                   "compute_ms", "comm_wait_ms", "slow"]
        members = [{c: json_safe(m.get(c)) for c in columns} for m in view.members]
        departures = json_safe(raw.get("departures") or [])
        counts = ", ".join(f"{n} {s}" for s, n in sorted(view.counts.items())) or "no members"
        lines = [f"run {info.get('run_id')} · world size {info.get('world_size')} · {counts}"]
        text, _ = table_text(columns, [[m[c] for c in columns] for m in members], max_bytes=MAX_TEXT_BYTES // 2)
        lines += ["", text]
        lines += [s.text for s in view.suspects]
        if departures:
            dcols = ["rank", "host", "pid", "why", "when"]
            dtext, _ = table_text(dcols, [[d.get(c) for c in dcols] for d in departures], max_bytes=MAX_TEXT_BYTES // 4)
            lines += ["", "departures (ranks that died or left):", dtext]
        return Answer("\n".join(lines), {"run_id": info.get("run_id"), "world_size": info.get("world_size"),
                                         "counts": dict(view.counts), "members": members, "departures": departures,
                                         "suspects": [s.text for s in view.suspects]})

    async def tool_sql(self, query: str, job: str | None = None, ranks: str | None = None, limit: int = DEFAULT_ROWS,
                       per_rank: bool = False, timeout: float = 10.0, format: str = "markdown") -> Answer:
        if not query or not query.strip():
            raise BadArgument("query", "is empty: give one SELECT statement")
        if len(query) > MAX_SQL_CHARS:
            raise BadArgument("query", f"is {len(query)} characters; at most {MAX_SQL_CHARS}")
        if not 1 <= limit <= MAX_ROWS:
            raise BadArgument("limit", f"must be 1..{MAX_ROWS}, not {limit}")
        if format not in ("markdown", "csv"):
            raise BadArgument("format", f"must be 'markdown' or 'csv', not {format!r}")
        timeout, rank_list = _check_timeout(timeout), _check_ranks(ranks)

        async def run(client: Any) -> Any:
            return await client.query(query, timeout=timeout, per_rank=per_rank, ranks=rank_list)

        result = await self.jobs.call(job, run, timeout + ANSWER_GRACE_SEC)
        total = result.table.num_rows
        columns, rows, _ = table_rows(result.table, limit)
        text, shown = table_text(columns, rows, fmt=format, max_bytes=MAX_TEXT_BYTES, total_rows=total)
        footer = coverage_text(result.coverage)
        return Answer(f"{text}\n\n{footer}", {
            "columns": columns, "rows": records(columns, rows[:shown]), "row_count": total,
            "rows_shown": shown, "truncated": shown < total, "coverage": _coverage_data(result.coverage),
            "footer": footer})

    async def tool_stacks(self, job: str | None = None, ranks: str | None = None, native: bool = False,
                          all_threads: bool = False, timeout: float = 10.0) -> Answer:
        from ..summaries import NATIVE_NOTES_SQL, format_stacks, group_stacks, native_notes, stacks_sql

        timeout, rank_list = _check_timeout(timeout), _check_ranks(ranks)

        async def run(client: Any) -> tuple[Any, list[str]]:
            result = await client.query(stacks_sql(all_threads), timeout=timeout, ranks=rank_list, native=native)
            notes: list[str] = []
            if native:
                found = await client.query(NATIVE_NOTES_SQL, timeout=timeout, ranks=rank_list)
                notes = native_notes(found.table.to_pylist())
            return result, notes

        result, notes = await self.jobs.call(job, run, 2 * timeout + ANSWER_GRACE_SEC)
        groups = group_stacks(result.table.to_pylist())
        shown = groups[:STACK_GROUPS]
        text = format_stacks(shown, notes, all=True)  # its own cap (STACK_GROUPS), said below
        if len(text.encode()) > MAX_TEXT_BYTES:
            text = text.encode()[:MAX_TEXT_BYTES].decode(errors="ignore") + "\n(cut at the size cap)"
        if len(groups) > len(shown):
            text += f"\n({len(groups) - len(shown)} more groups of identical stacks not shown; ask fewer ranks)"
        footer = coverage_text(result.coverage)
        return Answer(f"{text}\n\n{footer}", {"groups": json_safe([g.to_dict() for g in shown]),
                                             "group_count": len(groups), "notes": notes,
                                             "coverage": _coverage_data(result.coverage), "footer": footer})

    async def tool_diagnose(self, job: str | None = None, native: bool = False, min_wait: float | None = None,
                            timeout: float = 10.0) -> Answer:
        from ..diagnosis.verdict import MIN_WAIT_SEC

        timeout = _check_timeout(timeout)
        wait = MIN_WAIT_SEC if min_wait is None else min_wait
        if not 0 <= wait <= 3600:
            raise BadArgument("min_wait", f"must be 0..3600 seconds, not {wait:g}")

        async def run(client: Any) -> Any:
            return await client.diagnose(timeout=timeout, min_wait=wait, native=native)

        result = await self.jobs.call(job, run, 2 * (timeout + ANSWER_GRACE_SEC))
        data = json_safe(result.to_dict())
        findings = data.get("findings") or []
        columns = ["kind", "ranks", "group", "seq", "detail", "evidence"]
        lines = [("HEALTHY: " if result.healthy else "FINDINGS: ") + result.summary]
        if findings:
            text, _ = table_text(columns, [[f.get(c) for c in columns] for f in findings], max_bytes=MAX_TEXT_BYTES // 2)
            lines += ["", text]
        lines += ["", "checked: " + "; ".join(result.checked), coverage_text(result.coverage)]
        return Answer("\n".join(lines), {**data, "healthy": result.healthy})

    async def tool_profile(self, job: str | None = None, ranks: str | None = None, steps: int = 2,
                           timeout: float = 60.0, top: int = 10) -> Answer:
        from ..client.profiles import format_profile

        if not 1 <= steps <= MAX_PROFILE_STEPS:
            raise BadArgument("steps", f"must be 1..{MAX_PROFILE_STEPS}, not {steps}")
        if not 1 <= top <= 50:
            raise BadArgument("top", f"must be 1..50, not {top}")
        timeout, rank_list = _check_timeout(timeout, top=MAX_PROFILE_SEC), _check_ranks(ranks)
        if self._capture.locked():
            return _failed("a profile capture is already running on this server: one at a time; wait for it")
        async with self._capture:
            trace = self.jobs.trace_dir / f"probing-profile-{int(time.time())}-{next(self._traces)}.json"

            async def run(client: Any) -> Any:
                return await client.profile(ranks=rank_list, steps=steps, out=str(trace), timeout=timeout)

            result = await self.jobs.call(job, run, timeout + 30.0)
        ops = result.comparison.head(top) if result.comparison is not None else None
        data = {"capture_id": result.capture_id, "ranks": result.ranks, "steps": result.steps,
                "failed": {str(r): why for r, why in sorted(result.failed.items())},
                "slowest_rank": result.slowest_rank, "median_rank": result.median_rank,
                "trace": str(trace) if result.trace_path else None, "summary": result.summary(),
                "comparison": None if ops is None else {"columns": [str(c) for c in ops.columns],
                                                        "rows": json_safe(ops.to_dict(orient="records"))}}
        return Answer(format_profile(result, top=top), json_safe(data))

    async def tool_dump(self, job: str | None = None, timeout: float = 10.0) -> Answer:
        from ..postmortem.snapshot import snapshot
        from ..summaries import reason_lines

        timeout = _check_timeout(timeout)
        root = self.jobs.dump_dir

        def run(client: Any) -> tuple[Any, list[int], dict[int, str], Any]:
            run_dir, ranks, failed = snapshot(client, root, timeout=timeout)
            return run_dir, ranks, failed, client.info_.get("world_size")

        run_dir, ranks, failed, world = await self.jobs.call_blocking(job, run, 4 * timeout)
        target = f"dump://{run_dir}"
        dump_job = await self.jobs.add_dump(target)
        lines = [f"wrote the dumps of {len(ranks)} of {world} ranks to {run_dir}",
                 f"ask them here as job {dump_job!r} (the other tools' job argument)" if dump_job else
                 f"read them later with the target {target} (kernel-probe mcp -t {target})"]
        lines += reason_lines(failed, prefix="no dump: ")  # one line per reason, its ranks as spans
        return Answer("\n".join(lines), json_safe({"run_dir": str(run_dir), "target": target, "job": dump_job,
                                                   "ranks": ranks, "failed": {str(r): w for r, w in failed.items()}}))

    async def catalog(self, job: str | None = None) -> dict[str, dict]:
        """Every table of the job with its columns, types and meanings."""
        from ..membership.record import MEMBER_RECORD

        from .catalog import CATALOG_SQL, catalog_rows

        async def run(client: Any) -> Any:
            return await client.query(CATALOG_SQL, timeout=10.0)

        result = await self.jobs.call(job, run, 15.0)
        node_columns = [(c.name, getattr(c.type, "__name__", str(c.type))) for c in MEMBER_RECORD if c.column]
        return catalog_rows(result.table.to_pylist(), node_columns)


def _bad(exc: BadArgument) -> Answer:
    return Answer(str(exc), {"error": {"argument": exc.argument, "message": str(exc)}}, error=True)


def _failed(message: str) -> Answer:
    return Answer(message, {"error": {"message": message}}, error=True)
