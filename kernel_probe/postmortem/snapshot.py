"""A live job's dumps, taken through the tree (``kernel-probe dump [-t TARGET] DIR``).

The same files a rank writes when it dies (``dump``), reason kind ``snapshot``, written by
the client: every table of the catalog is read with one per-rank query (each rank's rows as
they are, tags appended; the tags are taken off again per rank), the membership is the
root's. A table a rank lacks is absent from its dump; a table whose columns differ between
ranks is written with the union of the columns (NULL where a rank lacked one).
"""

from __future__ import annotations

import errno
import time
from pathlib import Path
from typing import Any

from ..sql.execute import TAG_TYPES
from ..tags import Tags
from .dump import reason_row, run_dir_name, write_dump

NOT_DUMPED = frozenset({"nodes"})  # the root's own view: in the manifest already


class _Tables:
    def __init__(self, tables: dict) -> None:
        self._tables = tables

    def names(self) -> list[str]:
        return sorted(self._tables)

    def arrow(self, name: str) -> Any:
        return self._tables[name]


def _quoted(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def snapshot(client: Any, root: Path, *, timeout: float = 10.0,
             max_bytes: int = 64 << 20) -> tuple[Path, list[int], dict[str, str]]:
    """Write the dumps of the job ``client`` is connected to under ``root``; returns the run's
    directory, the ranks dumped, and the ranks that did not answer a query (and why). A ``root``
    that cannot hold directories is a NotADirectoryError before the job is asked anything."""
    import pyarrow.compute as pc

    root = Path(root)
    blocked = next((p for p in (root, *root.parents) if p.exists()), None)
    if blocked is not None and not blocked.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, f"{blocked} is a file, not a directory")

    raw = client.nodes_raw(timeout)
    members = {int(m["rank"]): m for m in raw["members"]}
    catalog = client.query("SELECT DISTINCT table_name FROM tables", timeout=timeout)
    failed: dict[str, str] = dict(catalog.coverage.get("failed") or {})
    by_rank: dict[int, dict[str, Any]] = {}
    for name in sorted(set(catalog.table.column(0).to_pylist()) - NOT_DUMPED):
        result = client.query(f"SELECT * FROM {_quoted(name)}", per_rank=True, timeout=timeout)
        failed.update(result.coverage.get("failed") or {})
        table = result.table
        ranks = table.column("_rank")
        rows = table.drop_columns([c for c in TAG_TYPES if c in table.column_names])
        for rank in pc.unique(ranks).to_pylist():
            by_rank.setdefault(int(rank), {})[name] = rows.filter(pc.equal(ranks, rank))
    when = time.time()
    run_id = str(client.info_.get("run_id") or "local")
    world = int(client.info_.get("world_size") or len(members))
    for rank, tables in sorted(by_rank.items()):
        m = members.get(rank, {})
        tags = Tags.from_member(m, rank).to_dict()
        identity = {"rank": rank, "world_size": world, "local_rank": m.get("local_rank"), "node": m.get("node"),
                    "host": m.get("host"), "run_id": run_id, "pid": m.get("pid")}
        write_dump(root, run_id=run_id, tags=tags, identity=identity, reasons=[reason_row(rank, when, "snapshot")],
                   tables=_Tables(tables), nodes=raw, deadline=float("inf"), max_bytes=max_bytes)
    first = members.get(min(by_rank), {}) if by_rank else {}
    return Path(root) / run_dir_name(run_id, first.get("host"), first.get("pid")), sorted(by_rank), failed
