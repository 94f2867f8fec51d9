"""torch's flight recorder as rows of ``collectives`` (source 'flight_recorder') and ``process_groups``.

torch records every collective its process groups enqueue, DDP's C++ gradient all-reduce
included, in one ring of ``TORCH_FR_BUFFER_SIZE`` entries per process (2000 by default, 0
turns it off). ``torch._C._distributed_c10d._dump_fr_trace_json`` returns it as JSON (gloo and
the other non-NCCL backends); ``_dump_nccl_trace_json``, in builds with NCCL, returns NCCL's.

A dump's ``pg_config`` is keyed by group name, which gloo leaves empty (one key '' without
ranks): groups are known by their entries instead, ``pg_id`` (which keys ``pg_status``) and
``process_group`` [name, desc]. A group's ranks come from ``pg_config`` where it names the
group with its ranks (NCCL), else from torch.distributed's own table of groups.

``rows`` is pure: dumps and groups in, rows out. ``Reader`` is the I/O around it: it looks up
the torch this process already loaded (it never imports torch), is for the probe's query
worker, never a training thread, and reads the entries again only once a group's status
moved and its last read is older than ``FRESH_SEC`` (or, while a collective was pending at
the last read, once that read is older than ``PENDING_RECHECK_SEC``). ``availability`` says,
cheaply, why there is nothing to read (torch not loaded, no recorder in this build, the
recorder off).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Sequence

from ...dtypes import dtype_bytes
from ...progress import loaded_torch_module, torch_initialized
from ..convert import SCHEMAS

# (dump name, function of torch._C._distributed_c10d that returns it as JSON)
DUMPS = (("fr", "_dump_fr_trace_json"), ("nccl", "_dump_nccl_trace_json"))
# the size of torch's ring: the first of these that is set (torch's own order)
BUFFER_SIZE_ENV = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
SOURCE = "flight_recorder"
# a read this recent is given again, moved or not: one diagnose reads the recorder's tables
# four times within about a second, and a full ring costs ~90 ms of the GIL to read
FRESH_SEC = 1.0
# a collective pending at the last read may since have retired with no group's status moving
# (gloo's count can stay behind, see ``rows``): such a read is redone after this long. A hung
# job's reads then cost a full ring every this many seconds it is asked, not at every query
PENDING_RECHECK_SEC = 10.0

_COLLECTIVE_COLUMNS = tuple(col for col, _ in SCHEMAS["collectives"])
_GROUP_COLUMNS = tuple(col for col, _ in SCHEMAS["process_groups"])


class Recorded(NamedTuple):
    """What one read found: rows in the column order of ``convert.SCHEMAS``, and a one-line
    note when there was nothing to read or reading failed (None otherwise)."""

    collectives: list[tuple]
    process_groups: list[tuple]
    note: str | None


# --- the pure part ------------------------------------------------------------------------


def _int(value: Any) -> int | None:
    """An int from an int or its decimal text (pg_status's values are strings)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            return None
    return None


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _json_text(value: Any) -> str | None:
    """Sizes and dtypes as JSON text (one text column compares across ranks in SQL)."""
    if not isinstance(value, list):
        return None
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return None


def _memo_json_text() -> Callable[[Any], str | None]:
    """``_json_text`` for one read: a ring's entries repeat a few shapes and dtypes, and
    ``repr`` of a list costs a tenth of ``json.dumps``."""
    texts: dict[str, str | None] = {}

    def text(value: Any) -> str | None:
        if not isinstance(value, list):
            return None
        key = repr(value)
        if key not in texts:
            texts[key] = _json_text(value)
        return texts[key]

    return text


def tensor_bytes(sizes: Any, dtypes: Any) -> int | None:
    """Bytes of the tensors given by the recorder's sizes and dtypes; None unless every
    tensor's shape and dtype is known."""
    if not isinstance(sizes, list) or not isinstance(dtypes, list) or len(sizes) != len(dtypes):
        return None
    total = 0
    for shape, dtype in zip(sizes, dtypes):
        width = dtype_bytes(dtype) if isinstance(dtype, str) else None
        if width is None or not isinstance(shape, list):
            return None
        numel = 1
        for dim in shape:
            dim = _int(dim)
            if dim is None or dim < 0:
                return None
            numel *= dim
        total += numel * width
    return total


def _group_of(entry: Mapping) -> tuple[str | None, str | None]:
    pg = entry.get("process_group")
    if isinstance(pg, (list, tuple)) and len(pg) >= 2:
        return _text(pg[0]), _text(pg[1])
    return None, None


def _backend_and_op(profiling_name: Any) -> tuple[str | None, str | None]:
    """'gloo:all_reduce' -> ('gloo', 'all_reduce'); a name without a backend is all op."""
    name = _text(profiling_name)
    if not name:
        return None, None
    backend, sep, op = name.partition(":")
    return (backend or None, op or None) if sep else (None, name)


def _entry_row(entry: Mapping, json_text: Callable[[Any], str | None] = _json_text) -> dict[str, Any]:
    name, desc = _group_of(entry)
    _backend, op = _backend_and_op(entry.get("profiling_name"))
    created = _int(entry.get("time_created_ns"))
    duration = entry.get("duration_ms")
    is_p2p = entry.get("is_p2p")
    return {
        "ts": created / 1e9 if created is not None else None,
        "op": op,
        "bytes": tensor_bytes(entry.get("input_sizes"), entry.get("input_dtypes")),
        "duration_ms": None if isinstance(duration, bool) or not isinstance(duration, (int, float)) else float(duration),
        "async_op": None,
        "source": SOURCE,
        "group_id": _int(entry.get("pg_id")),
        "group_name": name,
        "group_desc": desc,
        "collective_seq_id": _int(entry.get("collective_seq_id")),
        "p2p_seq_id": _int(entry.get("p2p_seq_id")),
        "op_id": _int(entry.get("op_id")),
        "is_p2p": is_p2p if isinstance(is_p2p, bool) else None,
        "state": _text(entry.get("state")),
        "input_sizes": json_text(entry.get("input_sizes")),
        "input_dtypes": json_text(entry.get("input_dtypes")),
        "output_sizes": json_text(entry.get("output_sizes")),
        "output_dtypes": json_text(entry.get("output_dtypes")),
        "timeout_ms": _int(entry.get("timeout_ms")),
    }


def _ranks_text(ranks: Any) -> str | None:
    """pg_config's "[0, 1]" or a list of ints as JSON text; None when no rank is known."""
    if isinstance(ranks, str):
        try:
            ranks = json.loads(ranks)
        except ValueError:
            return None
    if not isinstance(ranks, list) or not ranks or not all(_int(r) is not None for r in ranks):
        return None
    return json.dumps([_int(r) for r in ranks])


def _mapping(value: Any) -> Mapping:
    return value if isinstance(value, Mapping) else {}


def _entries(value: Any) -> Iterable[Mapping]:
    return (e for e in value if isinstance(e, Mapping)) if isinstance(value, list) else ()


def rows(dumps: Mapping[str, Any], groups: Sequence[Mapping[str, Any]],
         per_group: int) -> tuple[list[tuple], list[tuple]]:
    """(collectives rows, process_groups rows) of parsed dumps (``{"fr": ..., "nccl": ...}``)
    and torch.distributed's groups (``world_groups()``).

    ``collectives``: the newest ``per_group`` entries of each group, each recorded collective
    once (an entry in two dumps is one row), oldest first. ``process_groups``: one row per
    group the recorder knows (by its entries or its ``pg_status``), then the groups of
    torch.distributed it has nothing of; sequence numbers as torch keeps them (-1: none
    yet, and gloo never counts ``started``), except a gloo group's ``last_completed``, which
    is at least its newest retired entry's ``op_id``: gloo's two worker threads each write
    the count as they finish, so under load the one finishing last may write an older number
    and the count stays behind a collective the rank is past (seen here: 8 where op 9 had
    retired, until the group's next collective). Keys that are missing or of another type
    become NULLs, never errors."""
    by_name = {g.get("name"): g for g in groups if isinstance(g, Mapping) and isinstance(g.get("name"), str)}
    seen: set[tuple] = set()
    kept: dict[tuple, list[tuple[tuple, dict]]] = {}  # group key -> [(order, row)]
    group_rows: dict[tuple, dict[str, Any]] = {}  # group key -> process_groups row
    retired: dict[tuple, int] = {}  # gloo group key -> the newest op_id its entries say retired
    json_text = _memo_json_text()
    for kind, dump in dumps.items():
        dump = _mapping(dump)
        status = _mapping(dump.get("pg_status"))
        # pg_config is read by the names its values carry, and only where they list ranks
        config_ranks = {v.get("name"): _ranks_text(v.get("ranks")) for v in _mapping(dump.get("pg_config")).values()
                        if isinstance(v, Mapping) and v.get("name")}
        ids_seen: set[int] = set()
        for entry in _entries(dump.get("entries")):
            row = _entry_row(entry, json_text)
            backend, _op = _backend_and_op(entry.get("profiling_name"))
            identity = (row["group_id"], row["group_name"], _text(entry.get("profiling_name")),
                        row["collective_seq_id"], row["p2p_seq_id"], row["op_id"], _int(entry.get("time_created_ns")))
            if row["group_id"] is not None:
                ids_seen.add(row["group_id"])
            if identity in seen:
                continue
            seen.add(identity)
            key = (row["group_id"], row["group_name"], backend or (kind if kind != "fr" else None))
            if key not in group_rows:
                group_rows[key] = {
                    "group_id": row["group_id"], "group_name": row["group_name"], "group_desc": row["group_desc"],
                    "ranks": config_ranks.get(row["group_name"]), "backend": key[2],
                    **_status(status.get(str(row["group_id"]))),
                }
            kept.setdefault(key, []).append(((_int(entry.get("record_id")) or 0, row["ts"] or 0.0), row))
            if key[2] == "gloo" and entry.get("retired") is True and row["op_id"] is not None:
                retired[key] = max(row["op_id"], retired.get(key, row["op_id"]))
        for pg_id, st in status.items():  # groups whose entries the ring no longer holds
            gid = _int(pg_id)
            if gid is None or gid in ids_seen:
                continue
            key = (gid, None, kind if kind != "fr" else None)
            group_rows.setdefault(key, {"group_id": gid, "group_name": None, "group_desc": None, "ranks": None,
                                        "backend": key[2], **_status(st)})
    for key, op_id in retired.items():
        done = group_rows[key]["last_completed"]
        group_rows[key]["last_completed"] = op_id if done is None else max(done, op_id)
    for name, world in by_name.items():
        # a live group's name may also be a destroyed one's (a process group made again): the
        # live one is the last made, the highest id
        same = [g for g in group_rows.values() if g["group_name"] == name]
        if not same:
            same = [group_rows.setdefault((None, name, None), {"group_id": None, "group_name": name,
                                                                "group_desc": _text(world.get("desc"))})]
        live = max(same, key=lambda g: -1 if g["group_id"] is None else g["group_id"])
        live["ranks"] = live.get("ranks") or _ranks_text(world.get("ranks"))
        live["backend"] = live.get("backend") or _text(world.get("backend"))
    newest: list[tuple[tuple, dict]] = []
    if per_group > 0:
        for items in kept.values():
            items.sort(key=lambda item: item[0])
            newest.extend(items[-per_group:])
    newest.sort(key=lambda item: (item[1]["ts"] is None, item[1]["ts"] or 0.0, item[0][0]))
    collectives = [tuple(row.get(col) for col in _COLLECTIVE_COLUMNS) for _order, row in newest]
    process_groups = [tuple(g.get(col) for col in _GROUP_COLUMNS) for g in group_rows.values()]
    return collectives, process_groups


def _status(status: Any) -> dict[str, int | None]:
    st = _mapping(status)
    return {"last_enqueued": _int(st.get("last_enqueued_collective")),
            "last_started": _int(st.get("last_started_collective")),
            "last_completed": _int(st.get("last_completed_collective"))}


def recorder_off(environ: Mapping[str, str]) -> str | None:
    """'TORCH_FR_BUFFER_SIZE=0' when the environment turns the recorder off (the first of
    BUFFER_SIZE_ENV that is set decides, as in torch), else None."""
    for name in BUFFER_SIZE_ENV:
        if name in environ:
            size = _int(environ[name])
            return f"{name}={environ[name].strip()}" if size is not None and size <= 0 else None
    return None


# --- the I/O: this process's torch ----------------------------------------------------------


def _absent() -> str | None:
    if not torch_initialized():
        return "no flight recorder: torch is not loaded in this process"
    c10d = loaded_torch_module("torch._C._distributed_c10d")
    if c10d is None:
        return "no flight recorder: this torch has no torch.distributed"
    if not any(hasattr(c10d, fn) for _kind, fn in DUMPS):
        version = getattr(sys.modules.get("torch"), "__version__", "?")
        return f"no flight recorder: torch {version} has no {DUMPS[0][1]}"
    return None


def _off_note(off: str) -> str:
    return f"torch's flight recorder is off ({off})"


def availability(environ: Mapping[str, str] | None = None) -> str | None:
    """Why this process has no flight recorder to read, in one line, without reading it;
    None when it has one."""
    absent = _absent()
    if absent is not None:
        return absent
    off = recorder_off(os.environ if environ is None else environ)
    return None if off is None else _off_note(off)


def world_groups() -> list[dict[str, Any]]:
    """torch.distributed's live groups: name, desc, ranks (global, in group-rank order),
    backend. Empty when torch.distributed is not loaded or its tables cannot be read."""
    c10d = loaded_torch_module("torch.distributed.distributed_c10d")
    world = getattr(c10d, "_world", None)
    try:
        names = dict(world.pg_names)
        ranks_of = dict(world.pg_group_ranks)
        backends = dict(world.pg_map)
    except Exception:  # not loaded, or another torch's internals
        return []
    out = []
    for pg, name in names.items():
        ranks = ranks_of.get(pg)
        ordered = [g for g, _r in sorted(ranks.items(), key=lambda kv: kv[1])] if isinstance(ranks, dict) else []
        backend = backends.get(pg)
        backend = backend[0] if isinstance(backend, tuple) and backend else None
        desc = getattr(pg, "group_desc", None)
        out.append({"name": str(name), "desc": desc if isinstance(desc, str) else None, "ranks": ordered,
                    "backend": None if backend is None else str(backend)})
    return out


def _failure(name: str, exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{name} failed: {type(exc).__name__}" + (f": {text[0][:200]}" if text else "")


def dumps(include_collectives: bool = True) -> tuple[dict[str, Any], list[str]]:
    """The parsed dumps of this process's recorders (every entry, not only the active ones;
    without ``include_collectives`` only their groups' config and status), and a line per
    dump that failed."""
    c10d = loaded_torch_module("torch._C._distributed_c10d")
    found: dict[str, Any] = {}
    failed: list[str] = []
    for kind, name in DUMPS:
        fn = getattr(c10d, name, None)
        if fn is None:
            continue
        try:
            found[kind] = json.loads(fn(include_collectives, False))
        except Exception as exc:
            failed.append(_failure(name, exc))
    return found, failed


class Reader:
    """This process's flight recorder, read when a query asks (see ``rows``).

    Reading the entries costs the GIL: torch writes its dump at ~14 us per entry and turning
    it into rows costs ~30 us more (a full ring of 2000: ~90 ms of every training thread on
    this 2-core machine). So the rows of the last read are given again while they are under
    ``FRESH_SEC`` old (the queries of one diagnose), and after that while no group's status
    moved (a stuck job's does not; asking the status alone costs ~0.01 ms)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._kept: _Kept | None = None

    def read(self, per_group: int, environ: Mapping[str, str] | None = None) -> Recorded:
        """Nothing to read, or a recorder that is off, gives empty rows and a note saying why;
        a failing dump, a note and the other's rows."""
        absent = _absent()
        if absent is not None:
            return Recorded([], [], absent)
        off = recorder_off(os.environ if environ is None else environ)
        asked, now = (world_groups(), per_group, off), self._clock()
        kept = self._kept if self._kept is not None and self._kept.asked == asked else None
        if kept is not None and now - kept.at < FRESH_SEC:
            return kept.recorded
        status, failed = dumps(include_collectives=False)
        statuses = {kind: _mapping(d).get("pg_status") for kind, d in status.items()}
        if (kept is not None and kept.statuses == statuses and not failed
                and not (kept.pending and now - kept.at >= PENDING_RECHECK_SEC)):
            return kept.recorded
        found, failed = dumps()
        collectives, process_groups = rows(found, asked[0], per_group)
        if off is not None and not collectives:  # torch read the variable when it made the ring
            recorded = Recorded([], [], _off_note(off))
        else:
            recorded = Recorded(collectives, process_groups, "; ".join(failed) or None)
        self._kept = None if failed else _Kept(asked, statuses, now, recorded, _pending(recorded.process_groups))
        return recorded


class _Kept(NamedTuple):
    """A ``Reader``'s last read: what it was asked (torch's groups, the bound, the variable that
    turns the recorder off), the groups' status then, when, and the rows."""

    asked: tuple
    statuses: dict
    at: float
    recorded: Recorded
    pending: bool  # a group had a collective enqueued and not completed


def _pending(process_groups: Iterable[tuple]) -> bool:
    enqueued, completed = _GROUP_COLUMNS.index("last_enqueued"), _GROUP_COLUMNS.index("last_completed")
    return any(g[enqueued] is not None and g[completed] is not None and g[enqueued] > g[completed]
               for g in process_groups)


def read(per_group: int, environ: Mapping[str, str] | None = None) -> Recorded:
    """This process's flight recorder now, with nothing kept (``Reader`` keeps rows)."""
    return Reader().read(per_group, environ)
