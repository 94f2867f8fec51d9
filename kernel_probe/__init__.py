"""kernel_probe: a ZeroMQ probe inside every rank of a distributed PyTorch job.

Public API (docs/python-and-cli.md shows each call in use)::

    kernel_probe.start()                  # idempotent; PROBING=1 does it at interpreter start
    kernel_probe.set_role("trainer")      # or a dict / keyword args -> "k=v,..."
    c = kernel_probe.connect(target=None, token=None)
    c.nodes()                             # pandas DataFrame, one row per rank
    c = await kernel_probe.connect_async(target)   # the same, for asyncio code (the Jupyter server)
    kernel_probe.job_registry().jobs()    # jobs on this machine and jobs added by address

Importing this package is cheap: no torch, pandas, DuckDB or pyarrow until asked for.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    from .client import AsyncClient, Client
    from .config import Identity
    from .jobs import JobRegistry
    from .shell.probe_thread import ProbeThread

__all__ = ["start", "stop", "set_role", "log", "table", "connect", "connect_async", "find_token", "job_registry",
           "probe",
           "ProbeError", "ConnectError", "AuthError", "JobEndedError", "NoAnswerError", "QueryFailed", "QueryResult",
           "BadArgument",
           "Client", "AsyncClient", "Job", "JobRegistry", "UnknownJob", "PROTOCOL_VERSION"]
__version__ = "0.1.0"

_lock = threading.RLock()  # guards _probe
_probe: "ProbeThread | None" = None
_role: str | None = None


def start(wait: float = 0.0, identity: "Identity | None" = None) -> "ProbeThread":
    """Start this process's probe (once). Returns at once; ``wait`` seconds to wait until bound.
    ``identity``: who this rank is (default: from torchrun's environment, or a job of one)."""
    global _probe
    with _lock:
        if _probe is None or not _probe.is_alive():
            from .config import claim_probe, load_identity, load_settings
            from .shell.probe_thread import ProbeThread

            settings = load_settings()
            _probe = ProbeThread(settings, identity or load_identity(settings=settings))
            claim_probe()  # children inherit it: a subprocess never starts a second probe
            _probe.start()
            if settings.dump:  # what this rank knew, written if it ends abnormally
                from .postmortem import install

                install(settings, _probe.identity, probe)
            if _role is not None:
                _probe.submit(("role", _role))
        probe_ = _probe
    if wait:
        probe_.ready.wait(wait)
    return probe_


def stop() -> None:
    """Stop the probe: goodbye to the parent, connection file removed, sockets closed."""
    global _probe
    with _lock:
        probe_, _probe = _probe, None
    if probe_ is not None:
        probe_.stop()
    dumps = sys.modules.get(__name__ + ".postmortem")
    if dumps is not None:
        dumps.uninstall()


def probe() -> "ProbeThread | None":
    """This process's running probe, if any."""
    return _probe


ROLE_MAX_CHARS = 256  # a role rides every heartbeat of the rank: a longer one is cut (and ends in "…")


def _normalise_role(role: str | Mapping[str, Any] | None, kw: Mapping[str, Any]) -> str:
    items: dict[str, Any] = {}
    if isinstance(role, Mapping):
        items.update(role)
    elif role is not None:
        if kw:
            raise TypeError("set_role takes a string or keyword arguments, not both")
        return str(role)
    items.update(kw)
    return ",".join(f"{k}={v}" for k, v in sorted(items.items()))


def set_role(role: str | Mapping[str, Any] | None = None, /, **kw: Any) -> str:
    """Name what this rank does; the root sees it within a second. Returns the stored string (at
    most ``ROLE_MAX_CHARS``: it rides every heartbeat)."""
    global _role
    value = _normalise_role(role, kw)
    if len(value) > ROLE_MAX_CHARS:
        value = value[:ROLE_MAX_CHARS - 1] + "…"
    _role = value
    if _probe is not None:
        _probe.submit(("role", value))
    return value


def local_tables():
    """This process's telemetry tables (one per process; exist before and after the probe)."""
    from .tables import local_tables as _local_tables

    return _local_tables()


def log(**values: Any) -> None:
    """A row in this rank's ``metrics`` (e.g. ``log(step=12, loss=0.31)``): an O(1) append."""
    local_tables().log(**values)


def table(name: str, data: Any) -> None:
    """A user table on this rank: a DataFrame, a list of dicts, an Arrow table, or a callable
    returning one of those (called at query time)."""
    local_tables().table(name, data)


def connect(target: str | os.PathLike | None = None, token: str | None = None, timeout: float = 5.0,
            warm: bool = True) -> "Client":
    """A client of a running job: ``tcp://host:port``, a connection file, ``store://host:port[/run_id]``,
    or None for the newest job on this machine; ``dump://DIR``: an ended job's dumps. ``warm``:
    return once every rank can answer a query at once (up to 3 s on a job never queried; ``False`` for membership only)."""
    from .client import connect as _connect

    return _connect(target, token=token, timeout=timeout, warm=warm)


async def connect_async(target: str | os.PathLike | None = None, token: str | None = None,
                        timeout: float = 5.0, warm: bool = False) -> "AsyncClient":
    """``connect()`` for asyncio code: an ``AsyncClient`` whose methods are awaited. ``warm``
    as for ``connect()``, off by default (for servers that mostly watch membership)."""
    from .client import connect_async as _connect_async

    return await _connect_async(target, token=token, timeout=timeout, warm=warm)


def find_token(token: str | None = None, token_env: str | None = None) -> str | None:
    """The token a client signs with: ``token``, else the environment variable named
    ``token_env`` (``ValueError`` if it is not set), else ``PROBING_AUTH_TOKEN``; None if
    none is given (a job on this machine or a ``store://`` target may not need one)."""
    from .client.targets import find_token as _find_token

    return _find_token(token, token_env)


def job_registry() -> "JobRegistry":
    """This process's registry of jobs: running on this machine, or added by address."""
    from .jobs import job_registry as _job_registry

    return _job_registry()


_LAZY = {"ProbeError": "client", "ConnectError": "client", "AuthError": "client", "JobEndedError": "client",
         "NoAnswerError": "client", "BadArgument": "client",
         "QueryFailed": "client", "QueryResult": "client", "Client": "client", "AsyncClient": "client",
         "Job": "jobs", "JobRegistry": "jobs", "UnknownJob": "jobs"}


def __getattr__(name: str) -> Any:  # the client side is imported on demand: a rank never needs it
    if name == "PROTOCOL_VERSION":  # what this package speaks (front ends show it; clients check it)
        from .wire import PROTOCOL_VERSION

        return PROTOCOL_VERSION
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(name)


def _at_exit() -> None:
    try:
        stop()
    except Exception:
        pass


def _after_fork_in_child() -> None:
    # A forked child (a DataLoader worker) has no probe thread: forget the parent's.
    global _probe
    _probe = None


atexit.register(_at_exit)
os.register_at_fork(after_in_child=_after_fork_in_child)
