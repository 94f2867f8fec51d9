"""A job that has ended, read from its ranks' dumps (``connect("dump://DIR")``).

``DIR`` is a run's directory (``<PROBING_DUMP_DIR>/<run>``, holding ``rank<k>/``), the
dump directory itself (its newest run is opened), or a directory holding one such directory
per host (every host's part of the newest run is opened); ``dump://DIR1,DIR2`` reads
several directories as one job (each host's dumps, copied apart); ``dump://`` alone: the
newest run under this machine's ``PROBING_DUMP_DIR``. A ``DumpClient`` answers what a
``Client`` answers of a live job, in this process:

- ``query``: the same planner and executor as the live tree (``kernel_probe.sql``), every
  dump as one rank (``run_rank`` over its tables with its tags), merged and finished here,
  with ``nodes`` the membership as last seen; the same coverage keys, where ``failed``
  names every rank that left no dump (killed with SIGKILL: nothing could run), a dump
  that could not be read (one line each) and a dump of a newer format (refused);
- ``nodes`` / ``nodes_raw`` / ``departures``: the fullest membership view among the dumps
  (the root's, if it left one);
- a rank that died of a fatal signal leaves faulthandler's ``rank<k>.fatal.txt``: its
  ``reason`` has a row of kind 'fatal' (the traceback); it answers nothing else unless it
  had dumped before (a thread's exception).

Every file is read through ``dump_files``, which treats the directory as untrusted input
(regular files inside it only, capped reads, a schema for the manifest): a file it refuses
is one line among the problems, and the other ranks still load.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..diagnosis.verdict import MIN_WAIT_SEC
from ..postmortem.dump import FORMAT, MANIFEST
from ..rank_lists import parse_ranks
from ..tags import Tags
from . import calls, dump_files, results
from .diagnose import DiagnoseResult, Diagnosis, EndedJob
from .errors import ConnectError, JobEndedError, QueryFailed
from .lifecycle import Launch
from .targets import DUMP_SCHEME, dump_spec
from .dump_files import FATAL as _FATAL
from .dump_files import RANK_DIR as _RANK_DIR

if TYPE_CHECKING:
    import pandas as pd
    import pyarrow as pa



@dataclass
class RankDump:
    """One rank's dump: its tags, its manifest and its tables (read when a query asks)."""

    rank: int
    tags: dict
    manifest: dict
    paths: dict[str, Path] = field(default_factory=dict)
    made: dict[str, Any] = field(default_factory=dict)  # tables not read from a file
    fatal: tuple[str, float] | None = None  # faulthandler's traceback and when, when the rank died of a fatal
    # signal after its dump
    path: Path | None = None  # its directory

    def table(self, name: str) -> pa.Table:
        if name in self.made:
            return self.made[name]
        import pyarrow as pa

        table = dump_files.read_table(self.paths[name], self.paths[name].parent.parent)
        if name == "reason" and self.fatal is not None:  # the end came after the dump
            table = pa.concat_tables([table, _fatal_reason(self.rank, *self.fatal)], promote_options="permissive")
        return table

    def names(self) -> list[str]:
        return sorted({*self.paths, *self.made})


class _Tables(Mapping):
    """A dump's tables by name, read on first use (a query reads only what it scans)."""

    def __init__(self, dump: RankDump) -> None:
        self.dump = dump
        self._read: dict[str, Any] = {}

    def __getitem__(self, name: str) -> pa.Table:
        if name not in self._read:
            if name not in self.dump.paths and name not in self.dump.made:
                raise KeyError(name)
            self._read[name] = self.dump.table(name)
        return self._read[name]

    def __iter__(self):
        return iter(self.dump.names())

    def __len__(self) -> int:
        return len(self.dump.names())


def find_run_dirs(spec: str, default_root: Path) -> list[Path]:
    """The run directories ``dump://spec`` names; ``ConnectError`` when there is none.

    ``spec``: directories separated by commas (nothing: ``default_root``). Each is a run's
    directory (``rank<k>/`` in it), a directory of runs (``PROBING_DUMP_DIR``, or a shared
    one every host writes to), or a directory of such directories (one per host, as gathered
    with rsync). Runs named in ``spec`` are read together; otherwise every directory of the
    newest run's name is (a run's hosts each hold some of its ranks)."""
    bases = [Path(part).expanduser() for part in spec.split(",") if part] if spec else [Path(default_root)]
    named: list[Path] = []
    found: list[Path] = []
    for base in bases:
        if not base.is_dir():
            raise ConnectError(f"no dumps at {base}: not a directory")
        if _is_run_dir(base):
            named.append(base)
            continue
        runs = [d for d in _subdirs(base) if _is_run_dir(d)]
        runs += [d for sub in _subdirs(base) if not _is_run_dir(sub) for d in _subdirs(sub) if _is_run_dir(d)]
        if not runs:
            raise ConnectError(f"no dumps in {base}: expected rank<k>/ directories (a run's dumps), a directory "
                               f"of runs (PROBING_DUMP_DIR) or one directory of runs per host")
        found += runs
    if named:
        names = {d.name for d in named}
        return named + [d for d in found if d.name in names]
    newest = max(found, key=lambda d: d.stat().st_mtime).name
    return [d for d in found if d.name == newest]


def _subdirs(d: Path) -> list[Path]:
    """``d``'s directories (symlinks to directories left out: a dump is read where it is)."""
    try:
        return [Path(e.path) for e in dump_files.entries(d) if dump_files.is_real_dir(e) and not e.name.startswith(".")]
    except OSError:
        return []


def _is_run_dir(d: Path) -> bool:
    try:
        return any(_RANK_DIR.match(e.name) or _FATAL.match(e.name) for e in dump_files.entries(d))
    except OSError:
        return False


def load_rank(path: Path) -> RankDump:
    """One ``rank<k>/`` directory; ``ValueError`` (one line) when it is not a dump we can read."""
    m = _RANK_DIR.match(path.name)
    rank = dump_files.rank_of(m) if m else None
    try:
        manifest = dump_files.read_manifest(path / MANIFEST, path.parent, rank)
    except FileNotFoundError:
        raise ValueError(f"{path.name}: no {MANIFEST} (not a probing dump, or a dump cut short)") from None
    except OSError as exc:
        raise ValueError(f"{path.name}: unreadable {MANIFEST}: {exc.strerror or type(exc).__name__}") from None
    if manifest["format"] > FORMAT:
        raise ValueError(f"{path.name}: dump format {manifest['format']} is newer than this reader's ({FORMAT}): "
                         f"read it with a newer probing-magics")
    tags = manifest["tags"]
    paths = {e.name[:-len(".parquet")]: Path(e.path) for e in dump_files.entries(path)
             if e.name.endswith(".parquet") and not e.name.startswith(".")}
    return RankDump(tags["_rank"], tags, manifest, paths, path=path)


def open_dumps(target: str, settings: Any = None) -> DumpClient:
    """The ``DumpClient`` of ``dump://DIR`` (``dump://``: the newest run under PROBING_DUMP_DIR)."""
    from ..config import load_settings

    spec = dump_spec(target)
    if spec is None:
        raise ConnectError(f"{target!r} is not an ended job's dumps: expected dump://DIR")
    return DumpClient.open(spec, (settings or load_settings()).dump_dir)


def _fatal_reason(rank: int, text: str, when: float) -> pa.Table:
    import pyarrow as pa

    return pa.table({"rank": pa.array([rank], pa.int64()),
                     "when": pa.array([int(when * 1e6)], pa.int64()).cast(pa.timestamp("us", tz="UTC")),
                     "kind": ["fatal"], "exception_type": pa.array([None], pa.string()),
                     "message": [text.strip().splitlines()[0] if text.strip() else "fatal signal"],
                     "traceback": [text], "signal": pa.array([None], pa.string())})


class DumpClient:
    """The dumps of one run, answering as a ``Client`` of that job would (see the module)."""

    def __init__(self, run_dir: Path | Iterable[Path]) -> None:
        self.run_dirs = [Path(run_dir)] if isinstance(run_dir, (str, Path)) else [Path(d) for d in run_dir]
        self.run_dir = self.run_dirs[0]
        self.endpoint = DUMP_SCHEME + ",".join(str(d) for d in self.run_dirs)
        self.store = None
        self.dumps: dict[int, RankDump] = {}
        self.problems: dict[str, str] = {}  # a rank (or file) -> why it could not be read
        self.seen_at: float | None = None  # when the membership view nodes_raw() gives was written
        self._engine: Any = None
        self._catalog_cache: dict[str, list[str]] | None = None
        self._load()
        if self.seen_at is None:  # no membership view in any dump: the job was last seen when it dumped
            self.seen_at = max((m.get("written_at") or 0.0 for m in self._manifests()), default=0.0) or \
                self.run_dir.stat().st_mtime
        self.info_ = self.info()

    @classmethod
    def open(cls, spec: str, default_root: Path) -> DumpClient:
        return cls(find_run_dirs(spec, default_root))

    def _load(self) -> None:
        fatal: dict[int, tuple[Path, tuple[str, float]]] = {}
        where = len(self.run_dirs) > 1
        for run_dir in self.run_dirs:
            try:
                found = dump_files.entries(run_dir)
            except OSError as exc:
                self.problems[str(run_dir)] = f"{run_dir}: {exc.strerror or type(exc).__name__}"
                continue
            for e in found:
                p = Path(e.path)
                name = str(p) if where else p.name
                if p.name.startswith("."):
                    continue  # a dump still being written (or abandoned half way)
                m, f = _RANK_DIR.match(p.name), _FATAL.match(p.name)
                rank = dump_files.rank_of(m or f) if (m or f) else None
                if f and rank is not None:
                    try:
                        text, when = dump_files.read_fatal(p, run_dir)
                    except (OSError, ValueError) as exc:
                        self.problems.setdefault(f"rank {rank}", str(exc) if isinstance(exc, ValueError)
                                                 else f"{name}: {exc.strerror or type(exc).__name__}")
                        continue
                    if text:
                        fatal[rank] = (p, (text, when))
                    continue
                if rank is None or not dump_files.is_real_dir(e):
                    self.problems[name] = f"{name}: not a probing dump"
                    continue
                try:
                    d = load_rank(p)
                except (ValueError, KeyError, TypeError) as exc:
                    self.problems.setdefault(f"rank {rank}", str(exc))
                    continue
                self._keep(d)
        for rank, why in dump_files.check_world_sizes({r: d.manifest for r, d in self.dumps.items()}).items():
            self.problems[f"rank {rank} world_size"] = why
        members = {int(r["rank"]): r for r in self.nodes_raw()["members"] if isinstance(r.get("rank"), int)}
        for rank, (path, (text, when)) in fatal.items():
            if rank in self.dumps:
                self.dumps[rank].fatal = (text, when)
                continue
            seen = members.get(rank, {})
            tags = Tags.from_member(seen, rank).to_dict()
            self.dumps[rank] = RankDump(rank, tags, {"fatal": str(path)}, made={"reason": _fatal_reason(rank, text, when)})

    def _keep(self, d: RankDump) -> None:
        """A rank's dump; when two directories hold one (copies, or two runs that share a name),
        the one written last, and a note."""
        old = self.dumps.get(d.rank)
        self.problems.pop(f"rank {d.rank}", None)
        if old is not None:
            newer, other = (d, old) if (d.manifest.get("written_at") or 0) >= (old.manifest.get("written_at") or 0) \
                else (old, d)
            self.problems[f"rank {d.rank} twice"] = (f"rank {d.rank}: dumps in {other.path} and {newer.path}; "
                                                     f"read the newer, {newer.path}")
            d = newer
        self.dumps[d.rank] = d

    # --- what the job was ----------------------------------------------------------------------
    def _manifests(self) -> list[dict]:
        return [d.manifest for d in self.dumps.values() if "format" in d.manifest]

    @property
    def world_size(self) -> int:
        sizes = [int((m.get("identity") or {}).get("world_size") or 0) for m in self._manifests()]
        return max([*sizes, (max(self.dumps) + 1) if self.dumps else 0])

    @property
    def run_id(self) -> str | None:
        ids = [m.get("run_id") for m in self._manifests() if m.get("run_id")]
        return ids[0] if ids else None

    def missing(self) -> dict[int, str]:
        """Ranks of the job that left no dump we can read, and why."""
        out: dict[int, str] = {}
        for rank in range(self.world_size):
            if rank in self.dumps:
                continue
            out[rank] = self.problems.get(f"rank {rank}") or \
                "left no dump (killed by SIGKILL, or ended before it could write one)"
        return out

    def info(self, timeout: float = 5.0) -> dict:
        return {"run_id": self.run_id, "world_size": self.world_size, "dumps": ",".join(map(str, self.run_dirs)),
                "ranks_dumped": sorted(r for r, d in self.dumps.items() if "format" in d.manifest),
                "ranks_fatal": sorted(r for r, d in self.dumps.items() if "fatal" in d.manifest),
                "ranks_missing": sorted(self.missing()), "problems": list(self.problems.values()),
                "state": "ended"}

    def nodes_raw(self, timeout: float = 5.0) -> dict:
        """The fullest membership view among the dumps: the root's (rank 0) when it left one,
        else the one that lists the most ranks (the newest of those)."""
        views = [(m.get("tags", {}).get("_rank") == 0, len((m.get("nodes") or {}).get("members") or ()),
                  m.get("written_at") or 0, m["nodes"]) for m in self._manifests() if m.get("nodes")]
        if not views:
            return {"members": [], "departures": [], "epoch": 0}
        best = max(views, key=lambda v: v[:3])[3]
        self.seen_at = max(v[2] for v in views)
        return {"members": list(best.get("members") or []), "departures": list(best.get("departures") or []),
                "epoch": best.get("epoch", 0)}

    def nodes(self, timeout: float = 5.0) -> pd.DataFrame:
        return results.members_frame(self.nodes_raw()["members"])

    def departures(self, timeout: float = 5.0) -> pd.DataFrame:
        return results.departures_frame(self.nodes_raw()["departures"])

    # --- queries --------------------------------------------------------------------------------------
    def _engine_(self) -> Any:
        if self._engine is None:
            from ..sql.engine import Engine

            self._engine = Engine(threads=2, memory_limit="1GB")
        return self._engine

    def _catalog(self) -> dict[str, list[str]]:
        """Every table's columns over all dumps (the union), read from the files' footers once."""
        if self._catalog_cache is not None:
            return self._catalog_cache
        catalog: dict[str, list[str]] = {}
        for d in self.dumps.values():
            for name in d.names():
                cols = catalog.setdefault(name, [])
                try:
                    names = d.made[name].column_names if name in d.made else \
                        dump_files.read_columns(d.paths[name], d.paths[name].parent.parent)
                except Exception:  # refused or unreadable: the query that reads it says why
                    continue
                cols.extend(c for c in names if c not in cols)
        self._catalog_cache = catalog
        return catalog

    def query(self, sql: str, timeout: float = 10.0, strict: bool = False, per_rank: bool = False,
              ranks: int | str | Iterable[int] | None = None, params: Mapping[str, Any] | None = None, *,
              local: bool = False, explain: bool = False, native: bool = False, profile: bool = False,
              on_progress: Callable[[dict], None] | None = None) -> results.QueryResult:
        """One read-only SELECT over the dumps, as the live job would have answered it. ``native``
        and ``profile``: accepted as a live job's query takes them, but a dump holds the stacks as
        written (their Python frames): native frames can only be taken from a process that still
        runs; and no hop answers, so there is no profile."""
        from ..sql import execute
        from ..sql.engine import QueryError
        from ..sql.planner import plan as make_plan

        if local:
            raise QueryFailed("a dump:// job has no probe to ask alone: query without local", code="refused")
        results.check_timeout(timeout)
        params = results.query_params(params)  # the values a live job's ranks take, as they take them
        started = time.monotonic()
        deadline = time.time() + timeout  # the engine's deadlines are wall-clock times
        try:
            listed = parse_ranks(ranks, self.world_size or None)
        except ValueError as exc:
            raise QueryFailed(str(exc), code="bad_ranks") from None
        wanted = None if listed is None else set(listed)
        dumps = [d for r, d in sorted(self.dumps.items()) if wanted is None or r in wanted]
        failed: dict[str, str] = {str(r): why for r, why in self.missing().items() if wanted is None or r in wanted}
        coverage: dict[str, Any] = {"targeted": [], "answered": [], "pruned": [], "failed": failed,
                                    "partial": False, "notes": list(self.problems.values()),
                                    "dumps": ",".join(map(str, self.run_dirs))}
        if native:
            coverage["notes"].append("native frames come only from running ranks: these are the stacks the "
                                     "dumps hold")
        try:
            p = make_plan(sql, per_rank=per_rank, catalog=self._catalog())
            coverage.update(plan=p.mode, explain=p.explain())
            if explain:
                return results.QueryResult(None, coverage, explain=p.explain())
            engine = self._engine_()
            targeted, pruned = execute.select_ranks(p, engine, [d.tags for d in dumps], params=params,
                                                    deadline=deadline)
            by_rank = {d.rank: d for d in dumps}
            parts, notes = [], coverage["notes"]
            for rank in targeted:
                d = by_rank[rank]
                try:
                    parts.append(execute.run_rank(p, engine, _Tables(d), d.tags, params=params, deadline=deadline,
                                                  notes=notes))
                    coverage["answered"].append(rank)
                except QueryError:
                    raise
                except Exception as exc:  # a corrupt table file: this rank fails, the others answer
                    failed[str(rank)] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                if on_progress is not None:
                    on_progress({"answered": len(coverage["answered"]), "targeted": len(targeted)})
            merged = execute.merge(p, engine, parts, deadline=deadline, at_root=True)
            from ..shell.sql_tasks import nodes_arrow

            table = execute.finish(p, engine, merged, {"nodes": nodes_arrow(self.nodes_raw()["members"])},
                                   params=params, deadline=deadline)
        except QueryError as exc:
            raise QueryFailed(results.error_line({"message": exc.message, "line": exc.line, "col": exc.col}),
                              code=exc.code, line=exc.line, col=exc.col, coverage=coverage) from None
        coverage["targeted"] = sorted({*targeted, *(int(r) for r in failed if r.isdigit())})
        coverage["pruned"] = pruned
        coverage["partial"] = bool(failed)
        coverage["elapsed_ms"] = round((time.monotonic() - started) * 1000, 3)
        if strict and failed:
            raise QueryFailed(f"partial answer refused (strict): {results.describe_failures(coverage)}",
                              code="partial", coverage=coverage)
        return results.QueryResult(table, coverage, explain=coverage.get("explain", ""))

    def diagnose(self, timeout: float = 10.0, min_wait: float = MIN_WAIT_SEC, native: bool = False,
                 window: int = 0) -> DiagnoseResult:
        """Who failed first and why (``diagnosis.failure``: each dump's reason, last step and the
        collective it was in), then the hang verdict a live job gets, taken at the moment the
        last rank ended (``min_wait`` counts back from then): the live job's flow
        (``diagnose.Diagnosis``) over the dumps. ``native``: as a live job's call takes it; the
        dumps hold the stacks they were written with; ``window``: as a live job's call takes it (an
        ended job is asked why it died, not why it was slow)."""
        ended = EndedJob(self.world_size, self.missing(), self.seen_at)
        return calls.drive(Diagnosis(timeout, min_wait, native, time.time(), ended).run(), self)

    def warm(self, timeout: float = 0.0) -> int:
        return len(self.dumps)

    def profile(self, *args: Any, **kw: Any) -> Any:
        """Refused: a profile needs a running job (``JobEndedError``)."""
        raise JobEndedError(f"job {self.run_id or self.endpoint} has ended (read from its dumps): "
                            "a profile needs a running job")

    # --- what a live client also offers --------------------------------------------------------------
    @property
    def launch(self) -> Launch:
        """The one launch the dumps are of (no process to follow)."""
        return Launch(self.run_id, self.endpoint, None)

    def take_notice(self) -> str | None:
        return None

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None

    def __enter__(self) -> DumpClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<DumpClient {','.join(map(str, self.run_dirs))}: {len(self.dumps)} ranks, {len(self.missing())} missing>"
