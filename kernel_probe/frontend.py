"""What the front ends share beyond the client: one import for the magics, the widget, the
Jupyter server extension and its REST schema, so none of them reaches into this package's
modules (a test checks that ``probing_magics`` imports only ``kernel_probe``,
``kernel_probe.client`` and this module).

- stacks as people read them: ``stacks_sql``, ``group_stacks``, ``format_stacks``,
  ``native_notes``; rank lists: ``parse_ranks``, ``ranks_label``;
- the membership view (``membership_view``, ``VIEW_FIELDS``) and the member record's declared
  columns (``MEMBER_RECORD``, ``DEPARTURE_TABLE``, ``Column``, ``columns_of``);
- a job's life as a client sees it (``JobLifecycle`` and its events and states);
- the verdict's default wait (``MIN_WAIT_SEC``), its answer type (``DiagnoseResult``), a
  profile's text (``format_profile``), ``is_dump`` and ``snapshot`` (a live job's dumps);
- answers as strict JSON (``json_safe``, ``table_rows``);
- the MCP server over a front end's jobs (``mcp_server``; it imports the MCP SDK when called).

Everything here is light to import: no pandas, pyarrow or DuckDB until a function needs them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .client.diagnose import DiagnoseResult
from .client.lifecycle import GONE, RELAUNCHED, Asked, Ended, JobLifecycle, Seen, Tick
from .client.profiles import format_profile
from .client.targets import is_dump
from .diagnosis.verdict import MIN_WAIT_SEC
from .jobs import Job
from .mcp.render import json_safe, table_rows
from .membership.record import DEPARTURE_TABLE, MEMBER_RECORD, Column, columns_of
from .membership.view import VIEW_FIELDS, membership_view
from .summaries import NATIVE_NOTES_SQL, StackGroup, format_stacks, group_stacks, native_notes, stacks_sql
from .rank_lists import parse_ranks, ranks_label

__all__ = ["DiagnoseResult", "GONE", "RELAUNCHED", "Asked", "Ended", "JobLifecycle", "Seen", "Tick",
           "format_profile", "is_dump", "MIN_WAIT_SEC", "Job", "DEPARTURE_TABLE", "MEMBER_RECORD", "Column",
           "columns_of", "VIEW_FIELDS", "membership_view", "NATIVE_NOTES_SQL", "StackGroup", "format_stacks",
           "group_stacks", "native_notes", "stacks_sql", "parse_ranks", "ranks_label", "snapshot", "mcp_server",
           "json_safe", "table_rows"]


def snapshot(client: Any, root: Path, *, timeout: float = 10.0) -> tuple[Path, list[int], dict[str, str]]:
    """Write the dumps of the live job ``client`` talks to under ``root`` (as ``kernel-probe
    dump``): the run's directory, the ranks dumped, the ranks that did not answer and why."""
    from .postmortem.snapshot import snapshot as _snapshot

    return _snapshot(client, root, timeout=timeout)


def mcp_server(jobs: Any) -> Any:
    """The MCP server (``mcp.server.MCPServer``: tools, catalog, playbooks) over ``jobs``, a
    ``kernel_probe.mcp.jobs.JobSource``: ``list()``, ``call(job, fn, timeout)``,
    ``call_blocking(job, fn, timeout)``, ``trace_dir`` and ``dump_dir``."""
    from .mcp.server import build_server

    return build_server(jobs)
