"""Hold each test to its marker: what it may start.

* no marker: no process at all (``make test-fast`` runs these);
* ``processes``: any process of one rank or none (a CLI, a kernel, a Jupyter server, ...);
* ``cluster``: a multi-rank job too (torchrun, mpirun, srun, ``LocalJob``).

Every way Python starts a process ends in one of a few calls: ``_posixsubprocess.fork_exec``
(subprocess, asyncio, multiprocessing's spawn and forkserver; subprocess holds it as ``_fork_exec``), ``os.posix_spawn[p]``
(subprocess's fast path), ``os.fork``/``os.forkpty`` (multiprocessing's fork, pty) and
``os.system``/``os.exec*``. While a test runs, this module wraps them: a start the test's
marker does not allow raises :class:`UnmarkedProcessError` and is remembered, so the test
fails even when the code under test swallows the exception.
"""

from __future__ import annotations

import os
import subprocess
from typing import Any, Callable

import _posixsubprocess

NONE, PROCESSES, CLUSTER = 0, 1, 2
_NAMES = {NONE: "no marker", PROCESSES: "@pytest.mark.processes", CLUSTER: "@pytest.mark.cluster"}

# argv words that start a job of several ranks
_JOB_LAUNCHERS = ("torch.distributed.run", "torchrun", "mpirun", "mpiexec", "srun", "sbatch", "salloc")


class UnmarkedProcessError(RuntimeError):
    """A test started a process its marker does not allow."""


_allowed: int | None = None  # None: outside a test, anything goes
_violations: list[str] = []
_originals: dict[str, Callable[..., Any]] = {}


def _words(args: Any) -> list[str]:
    out = []
    for a in args or ():
        if isinstance(a, bytes):
            a = a.decode(errors="replace")
        out.append(os.path.basename(str(a)))
    return out


def _check(what: str, argv: Any = None) -> None:
    allowed = _allowed
    if allowed is None or allowed == CLUSTER:
        return
    words = _words(argv)
    needs = CLUSTER if any(w in _JOB_LAUNCHERS for w in words) else PROCESSES
    if needs <= allowed:
        return
    shown = " ".join(str(a) for a in (argv or [])[:6]) if argv else what
    msg = f"this test starts a process ({what}: {shown}) but is marked with {_NAMES[allowed]}; mark it {_NAMES[needs]}"
    _violations.append(msg)
    raise UnmarkedProcessError(msg)


def _wrap(owner: Any, name: str, argv_of: Callable[..., Any]) -> None:
    original = getattr(owner, name, None)
    if original is None:
        return
    _originals[f"{owner.__name__}.{name}"] = original

    def guarded(*args: Any, **kwargs: Any) -> Any:
        _check(name, argv_of(*args, **kwargs))
        return original(*args, **kwargs)

    guarded.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(owner, name, guarded)


def install() -> None:
    """Wrap the process-starting calls once per pytest run (they check the current allowance)."""
    if _originals:
        return
    _wrap(_posixsubprocess, "fork_exec", lambda args, *a, **k: args)
    _wrap(subprocess, "_fork_exec", lambda args, *a, **k: args)  # subprocess keeps its own reference
    for name in ("posix_spawn", "posix_spawnp"):
        _wrap(os, name, lambda path, argv, *a, **k: argv)
    for name in ("fork", "forkpty"):
        _wrap(os, name, lambda *a, **k: None)
    _wrap(os, "system", lambda command, *a, **k: str(command).split())
    for name in ("execv", "execve", "execvp", "execvpe", "execl", "execle", "execlp", "execlpe"):
        _wrap(os, name, lambda file, *a, **k: [file])


def allow(level: int | None) -> None:
    """Set what the running test may start (None: no test runs, anything goes)."""
    global _allowed
    _allowed = level


def take_violations() -> list[str]:
    out = list(_violations)
    _violations.clear()
    return out


def level_of(markers: set[str]) -> int:
    if "cluster" in markers:
        return CLUSTER
    if "processes" in markers:
        return PROCESSES
    return NONE


def job_allowed(world_size: int) -> None:
    """LocalJob calls this: a job of several ranks needs the cluster marker (plain mode starts no launcher)."""
    if world_size > 1:
        _check("LocalJob", ["torchrun"])
    else:
        _check("LocalJob", ["python"])
