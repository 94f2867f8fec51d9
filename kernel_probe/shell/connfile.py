"""Connection files: how clients on the same machine find running jobs.

Like Jupyter's kernel files, the root probe writes one small JSON file per job into a
runtime directory (the directory itself is chosen by the caller). The file holds the
root's endpoint, run id, world size, the root's pid (with its create time, so a reused
pid is not mistaken for the job) and the hex signing key a client needs. It never holds
the auth token itself. Files are created 0600 inside a 0700 directory and written
atomically, so a reader never sees half a file.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..private_paths import open_private, private_dir
from . import pidwatch

__all__ = [
    "ConnectionInfo",
    "filename",
    "is_alive",
    "list_files",
    "newest_alive",
    "prune",
    "read",
    "remove",
    "write",
]

_PREFIX = "probe-"
_SUFFIX = ".json"
_PATTERN = f"{_PREFIX}*{_SUFFIX}"  # temp files start with "." and never match
_MAX_BYTES = 1 << 20  # a connection file is a few hundred bytes; refuse anything huge
_CREATE_TIME_SLACK = 1.0  # seconds; create_time is derived from boot time + jiffies

# Field name -> accepted JSON types (bool is rejected separately for numbers).
_FIELDS: dict[str, tuple[type, ...]] = {
    "endpoint": (str,),
    "run_id": (str,),
    "world_size": (int,),
    "pid": (int,),
    "pid_create_time": (int, float),
    "host": (str,),
    "incarnation": (str,),
    "key": (str,),
    "started": (int, float),
    "protocol": (int,),
}


@dataclass(frozen=True)
class ConnectionInfo:
    """What a client needs to reach one job's root probe."""

    endpoint: str
    run_id: str
    world_size: int
    pid: int
    pid_create_time: float
    host: str
    incarnation: str
    key: str  # hex of the signing key a client needs (never the token itself)
    started: float
    protocol: int
    store: str = ""  # the store:// address a user elsewhere can copy (empty: none known)
    # the root's start in clock ticks since boot (Linux): exact, and no wall-clock step (NTP, a
    # paused or forked VM) moves it, where pid_create_time, boot time plus ticks, can move
    pid_start_ticks: int | None = None
    curve: str = ""  # hex of what the job's CURVE keys derive from (placement.curve_material); "": no CURVE
    path: Path | None = None  # where it was read from / written to; not serialised

    def to_dict(self) -> dict:
        """JSON-ready dict of every field except ``path``."""
        d = dataclasses.asdict(self)
        d.pop("path")
        return d

    @classmethod
    def from_dict(cls, d: Any, path: Path | None = None) -> ConnectionInfo:
        """Validate and build; ``ValueError`` naming the first bad field. Unknown keys are
        ignored so newer writers stay readable."""
        if not isinstance(d, dict):
            raise ValueError(f"expected a JSON object, got {type(d).__name__}")
        values: dict[str, Any] = {}
        for name, types in _FIELDS.items():
            if name not in d:
                raise ValueError(f"missing field {name!r}")
            v = d[name]
            if isinstance(v, bool) or not isinstance(v, types):
                raise ValueError(f"field {name!r} has the wrong type ({type(v).__name__})")
            values[name] = float(v) if float in types else v
        if not values["endpoint"]:
            raise ValueError("field 'endpoint' is empty")
        if values["pid"] <= 0:
            raise ValueError("field 'pid' must be positive")
        if values["world_size"] < 0:
            raise ValueError("field 'world_size' must not be negative")
        try:
            bytes.fromhex(values["key"])
        except ValueError:
            raise ValueError("field 'key' is not hex") from None
        store = d.get("store", "")  # optional: files of older writers lack it
        ticks = d.get("pid_start_ticks")
        ticks = ticks if isinstance(ticks, int) and not isinstance(ticks, bool) and ticks >= 0 else None
        return cls(**values, store=store if isinstance(store, str) else "", pid_start_ticks=ticks,
                   curve=_hex(d.get("curve")), path=path)


def _hex(value: Any) -> str:
    """An optional hex field: as written, or "" when absent or not hex."""
    try:
        return value if isinstance(value, str) and bytes.fromhex(value) else ""
    except ValueError:
        return ""


def _safe(run_id: str) -> str:
    # Run ids look like "host:port/r0"; keep file names portable and bounded.
    return re.sub(r"[^A-Za-z0-9._-]+", "_", run_id).strip("._")[:80] or "job"


def filename(info: ConnectionInfo) -> str:
    """The file name ``write`` uses for ``info``: ``probe-<safe run id>-<pid>.json``."""
    return f"{_PREFIX}{_safe(info.run_id)}-{info.pid}{_SUFFIX}"


def write(directory: Path, info: ConnectionInfo) -> Path:
    """Atomically write ``info`` into ``directory`` (created 0700); return the path (0600)."""
    # 0700 however it was made (a dump may have made it first, or an older version 0755)
    directory = private_dir(directory, tighten=True)
    final = directory / filename(info)
    data = json.dumps(info.to_dict(), indent=1, sort_keys=True).encode() + b"\n"
    # Unique hidden temp name in the same directory (os.replace must not cross
    # filesystems); O_EXCL + 0600 so the secret is never readable by others, not even
    # for the instant before a chmod.
    tmp = directory / f".{final.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = open_private(tmp)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return final


def remove(path: Path) -> None:
    """Delete a connection file; a missing file is fine."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def read(path: Path) -> ConnectionInfo:
    """Read one connection file; ``ValueError`` with the path and reason if unusable."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"{path}: cannot read connection file: {exc.strerror or exc}") from None
    if len(raw) > _MAX_BYTES:
        raise ValueError(f"{path}: not a connection file (larger than {_MAX_BYTES} bytes)")
    try:
        d = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise ValueError(f"{path}: not a connection file (not JSON)") from None
    try:
        return ConnectionInfo.from_dict(d, path=path)
    except ValueError as exc:
        raise ValueError(f"{path}: not a connection file ({exc})") from None


def list_files(directory: Path) -> list[ConnectionInfo]:
    """Every readable connection file in ``directory``, newest (``started``) first."""
    directory = Path(directory)
    try:
        paths = list(directory.glob(_PATTERN))
    except OSError:
        return []
    infos: list[ConnectionInfo] = []
    for p in paths:
        try:
            infos.append(read(p))
        except ValueError:
            continue  # someone else's garbage must not hide the good files
    infos.sort(key=lambda i: i.started, reverse=True)
    return infos


def is_alive(info: ConnectionInfo) -> bool:
    """Does the root process of ``info`` still run?

    Alive means: the pid exists, is not a zombie, and was created when the file says
    (within 1 s) -- a reused pid is not the job. A file from another host cannot be
    checked from here and counts as alive.
    """
    if info.host and info.host != socket.gethostname():
        return True
    if info.pid_start_ticks is not None and pidwatch.USE_PROC:
        st = pidwatch.proc_stat(info.pid)
        return st is not None and st[0] not in (b"Z", b"X") and st[1] == info.pid_start_ticks
    import psutil  # here, not at the top: a rank imports this module to write its file

    try:
        proc = psutil.Process(info.pid)
        with proc.oneshot():
            if proc.status() == psutil.STATUS_ZOMBIE:
                return False
            created = proc.create_time()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.AccessDenied:
        return True  # it exists; we just may not look closer
    return abs(created - info.pid_create_time) <= _CREATE_TIME_SLACK


def newest_alive(directory: Path) -> ConnectionInfo | None:
    """The most recently started job whose root still runs, or None."""
    for info in list_files(directory):
        if is_alive(info):
            return info
    return None


def prune(directory: Path) -> list[Path]:
    """Remove the files of roots that are gone; return the removed paths.

    Unreadable files are left alone: they may not be ours.
    """
    removed: list[Path] = []
    for info in list_files(directory):
        if info.path is not None and not is_alive(info):
            remove(info.path)
            removed.append(info.path)
    return removed
