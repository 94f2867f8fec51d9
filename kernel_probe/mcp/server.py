"""The MCP server, declared once: the tools, the catalog resource and the playbook prompts
over a ``JobSource``. ``kernel-probe mcp`` runs it over stdio for one target; the Jupyter
server extension serves the same declaration over Streamable HTTP for every job it knows.

This module imports the MCP SDK (``mcp`` 2.x); nothing a rank or ``import kernel_probe``
loads imports this module.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from mcp.server import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import CallToolResult, TextContent, ToolAnnotations
from pydantic import Field, ValidationError

from .. import __version__
from .catalog import catalog_markdown
from .jobs import JobSource
from .playbooks import Playbook, playbooks
from .tools import (DEFAULT_ROWS, MAX_PROFILE_SEC, MAX_PROFILE_STEPS, MAX_ROWS, MAX_TIMEOUT_SEC, Answer, Toolbox,
                    error_text)

INSTRUCTIONS = (
    "Ask a distributed PyTorch job (live, or an ended job's dumps) what it is doing. Start with `jobs`, then "
    "`diagnose` for a stuck or dead job, `nodes` for who is alive and stepping, `stacks` for where each rank "
    "stands, and `sql` for anything else (read the probing://catalog resource first: every table, its "
    "columns and what they mean). The prompts are playbooks: the steps for 'why is it stuck', 'why is it "
    "slow', 'why did it die', 'is it healthy' and 'find the straggler'. Everything is read-only.")

READ_ONLY = ToolAnnotations(read_only_hint=True, destructive_hint=False, idempotent_hint=True, open_world_hint=False)
WRITES_FILES = ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=False,
                               open_world_hint=False)

Job = Annotated[str | None, Field(description="the job's id from the `jobs` tool; leave out for the default job "
                                              "(the only one over stdio, the newest one in Jupyter)")]
Ranks = Annotated[str | None, Field(description="only these ranks, e.g. '0-3,8'; leave out for every rank")]
Timeout = Annotated[float, Field(gt=0, le=MAX_TIMEOUT_SEC, description="seconds the job has to answer")]


def _result(answer: Answer) -> CallToolResult:
    return CallToolResult(content=[TextContent(type="text", text=answer.text)], structured_content=answer.data,
                          is_error=answer.error)


class ProbingServer(MCPServer):
    """``MCPServer`` whose argument errors are one line naming the argument (not pydantic's report)."""

    async def call_tool(self, name: str, arguments: dict[str, Any], context: Any = None) -> Any:
        try:
            return await super().call_tool(name, arguments, context)
        except ToolError as exc:
            cause = exc.__cause__
            while cause is not None and not isinstance(cause, ValidationError):
                cause = cause.__cause__
            if cause is None:
                raise
            err = cause.errors()[0]
            argument = ".".join(str(p) for p in err["loc"]) or "arguments"
            message = f"argument '{argument}': {err['msg']}"
            return CallToolResult(content=[TextContent(type="text", text=message)],
                                  structured_content={"error": {"argument": argument, "message": message}},
                                  is_error=True)


def build_server(jobs: JobSource, *, name: str = "probing") -> MCPServer:
    """The MCP server over ``jobs`` (tools, resources, prompts), ready for any transport."""
    # WARNING: the SDK configures logging at construction (a root handler when none is set); keep it quiet
    app = ProbingServer(name=name, title="probing-magics", version=__version__, instructions=INSTRUCTIONS,
                        log_level="WARNING")
    box = Toolbox(jobs)

    @app.tool(name="jobs", annotations=READ_ONLY)
    async def jobs_known() -> CallToolResult:
        """The jobs this server can ask: id, run id, world size, whether it runs (a dump:// job has ended).
        Pass an id as `job` to the other tools."""
        return _result(await box.run("jobs"))

    @app.tool(annotations=READ_ONLY)
    async def nodes(job: Job = None) -> CallToolResult:
        """The job's membership as a table, one row per rank: host, state (alive, stalled, dead and why),
        last-seen age, step, step time and whether it is slow against the median; then ranks that died or
        left (departures). Use it first to see who is alive and who stopped stepping."""
        return _result(await box.run("nodes", job=job))

    @app.tool(annotations=READ_ONLY)
    async def sql(query: Annotated[str, Field(description="one read-only SELECT (DuckDB SQL) over the job's "
                                                          "tables; see the probing://catalog resource")],
                  job: Job = None, ranks: Ranks = None,
                  limit: Annotated[int, Field(ge=1, le=MAX_ROWS, description="rows returned at most")] = DEFAULT_ROWS,
                  per_rank: Annotated[bool, Field(description="run the statement as-is on every rank and "
                                                              "concatenate (no cross-rank aggregation)")] = False,
                  timeout: Timeout = 10.0,
                  format: Annotated[Literal["markdown", "csv"], Field(description="the text table's format")]
                  = "markdown") -> CallToolResult:
        """Run one read-only SQL SELECT over every rank of the job at once (federated: aggregates combine
        across ranks; every row has `_rank`). Answers a table (Markdown or CSV, capped in rows and bytes, saying
        what was cut) and a coverage line: which ranks answered, and if the answer is PARTIAL, who did not
        and why. Writes, COPY, ATTACH and file reads are refused."""
        return _result(await box.run("sql", query=query, job=job, ranks=ranks, limit=limit, per_rank=per_rank,
                                     timeout=timeout, format=format))

    @app.tool(annotations=READ_ONLY)
    async def stacks(job: Job = None, ranks: Ranks = None,
                     native: Annotated[bool, Field(description="also C/C++ frames (a gloo/NCCL wait, a C "
                                                               "extension), read with py-spy: a few seconds more")]
                     = False,
                     all_threads: Annotated[bool, Field(description="every thread, not only the main one")] = False,
                     timeout: Timeout = 10.0) -> CallToolResult:
        """Where every rank stands now: main-thread Python stacks, innermost frame first, identical stacks
        grouped ('ranks 0-2 (3)' vs 'rank 3'). The odd group out is usually the one to look at."""
        return _result(await box.run("stacks", job=job, ranks=ranks, native=native, all_threads=all_threads,
                                     timeout=timeout))

    @app.tool(annotations=READ_ONLY)
    async def diagnose(job: Job = None,
                       native: Annotated[bool, Field(description="read native stacks too: names a rank stuck "
                                                                 "in C and what the waiting ranks wait in")] = False,
                       min_wait: Annotated[float | None, Field(ge=0, le=3600, description=(
                           "seconds a collective must be pending before a rank missing from it counts "
                           "(default 5)"))] = None,
                       timeout: Timeout = 10.0) -> CallToolResult:
        """Why the job is stuck, slow or dead: one sentence (the verdict), then its findings as rows (kind,
        ranks, group, seq, detail, evidence): dead or stalled ranks, ranks that never entered a collective the
        others wait in, mismatched collectives, where the odd ranks stand; with no hang, the straggler the others
        wait for (its cause, their loss) and since when the job is slower. On a dump:// job: who failed first."""
        return _result(await box.run("diagnose", job=job, native=native, min_wait=min_wait, timeout=timeout))

    @app.tool(annotations=WRITES_FILES)
    async def profile(job: Job = None, ranks: Ranks = None,
                      steps: Annotated[int, Field(ge=1, le=MAX_PROFILE_STEPS,
                                                  description="training steps to profile")] = 2,
                      timeout: Annotated[float, Field(gt=0, le=MAX_PROFILE_SEC, description=(
                          "seconds the ranks have to finish their steps"))] = 60.0,
                      top: Annotated[int, Field(ge=1, le=50, description="ops shown")] = 10) -> CallToolResult:
        """torch.profiler on the chosen ranks for a few steps of a running job: the slowest rank's top ops next
        to the median rank's, and who failed why. One capture at a time; the merged trace is written where
        this server keeps traces (its path is in the answer)."""
        return _result(await box.run("profile", job=job, ranks=ranks, steps=steps, timeout=timeout, top=top))

    @app.tool(annotations=WRITES_FILES)
    async def dump(job: Job = None, timeout: Timeout = 10.0) -> CallToolResult:
        """Snapshot a live job: every rank's tables written as dumps where this server keeps them, to read
        later (or after the job ends) with the dump:// target the answer gives."""
        return _result(await box.run("dump", job=job, timeout=timeout))

    @app.resource("probing://catalog", name="catalog", title="Tables of the default job",
                  description="Every table of the job, its columns and types, and what each means: read before "
                              "writing SQL.", mime_type="text/markdown")
    async def catalog() -> str:
        return await _catalog(box, None)

    @app.resource("probing://jobs/{job}/catalog", name="job-catalog", title="Tables of one job",
                  description="The catalog of the job with this id (see the jobs tool).", mime_type="text/markdown")
    async def job_catalog(job: str) -> str:
        return await _catalog(box, job)

    @app.resource("probing://playbooks", name="playbooks", title="Playbooks",
                  description="The playbooks as JSON: each question's steps (tool, arguments, what to look for).",
                  mime_type="application/json")
    def playbook_list() -> str:
        return json.dumps({name: {"title": b.title, "description": b.description, "goal": b.goal,
                                  "steps": [s.__dict__ for s in b.steps]} for name, b in playbooks().items()})

    for book in playbooks().values():
        _add_prompt(app, book)
    return app


async def _catalog(box: Toolbox, job: str | None) -> str:
    from mcp.server.mcpserver.exceptions import ResourceError

    from ..client import ProbeError

    try:
        return catalog_markdown(await box.catalog(job))
    except (ProbeError, ValueError) as exc:
        raise ResourceError(error_text(exc)) from None


def _add_prompt(app: MCPServer, book: Playbook) -> None:
    def render(job: Annotated[str | None, Field(description="the job's id (see the jobs tool); leave out for "
                                                            "the default job")] = None) -> str:
        return book.prompt(job)

    app.prompt(name=book.name, title=book.title, description=book.description)(render)
