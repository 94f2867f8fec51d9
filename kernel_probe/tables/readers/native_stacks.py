"""Native (C/C++) frames of this rank's threads, taken with py-spy when a query asks.

A rank stuck in C/C++ (a gloo or NCCL wait, a C extension, the GIL) shows only its last
Python frame in ``stacks``. On request (a query sent with ``native=True``) the rank runs
``py-spy dump --native --json --pid <its own pid>`` as a child process, from the SQL worker
thread that reads the table (never the I/O thread, never a training thread), and waits at
most PROBING_NATIVE_STACKS_TIMEOUT_SEC for it. A process may not ptrace itself, but its
child may trace it: where Yama's ptrace_scope is 1 the child is first named the rank's
tracer (``prctl(PR_SET_PTRACER)``), before it starts tracing (it waits on its stdin until
then). py-spy pauses the rank while it reads the stacks: tens of milliseconds, a few seconds
where it first reads the symbols of a big library on the stack (libtorch).

py-spy's dump is one consistent snapshot of every Python thread with its native frames
interleaved in calling order; a thread it reports is taken from it (innermost first, frames
from a shared library marked ``native``), a thread it does not report keeps the Python
frames read in-process. Only the JSON form is read: it names threads by the same ids as
``threading`` and tells native frames from Python ones (the text form does neither); a
py-spy without ``--json`` (before 0.4) is reported as such.

Where the dump cannot be taken (no py-spy, ptrace refused by the OS or a container, a dump
past its time) ``NativeDump.note`` says why in one line and the Python frames still come.

The core (``parse_dump``, ``merge_rows``, ``refusal_note``) is pure; ``take_dump`` is the I/O.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

PYTHON, NATIVE = "python", "native"
PR_SET_PTRACER = 0x59616D61
YAMA_SCOPE = "/proc/sys/kernel/yama/ptrace_scope"
_one_at_a_time = threading.Lock()  # two tracers of one process: the second is refused


@dataclass(frozen=True)
class ThreadDump:
    """One thread as py-spy saw it: frames innermost first, each (function, file, line, native)."""

    thread_id: int
    name: str | None
    frames: tuple[tuple[str, str | None, int | None, bool], ...]


@dataclass(frozen=True)
class NativeDump:
    """A py-spy dump of this process: its threads, or ``note``, one line saying why not."""

    threads: tuple[ThreadDump, ...] = ()
    note: str | None = None


# --- the core -------------------------------------------------------------------------------
def parse_dump(text: str) -> tuple[ThreadDump, ...]:
    """py-spy's ``dump --json`` output -> its threads. ``ValueError`` when it is not that."""
    data = json.loads(text)
    if not isinstance(data, list):
        raise ValueError("py-spy's dump is not a list of threads")
    threads = []
    for t in data:
        frames = []
        for f in t.get("frames") or ():
            native = f.get("module") is not None  # Python frames have no shared object
            line = f.get("line")
            line = int(line) if isinstance(line, int) and line > 0 else None
            frames.append((str(f.get("name")), f.get("filename"), line, native))
        threads.append(ThreadDump(int(t["thread_id"]), t.get("thread_name"), tuple(frames)))
    return tuple(threads)


def merge_rows(python_rows: Sequence[tuple], threads: Sequence[ThreadDump], main: int | None) -> list[tuple]:
    """``stacks`` rows (thread_id, thread_name, is_main, depth, frame_type, function, file, line):
    each thread py-spy saw from its dump, native frames included; any other thread from
    ``python_rows`` (rows of ``live.stack_rows``, already with their frame_type). The main
    thread first, then by thread id; depth 0 innermost."""
    names = {row[0]: row[1] for row in python_rows}
    dumped = {t.thread_id: t for t in threads}
    out: list[tuple] = []
    for tid in sorted({*names, *dumped}, key=lambda t: (t != main, t)):
        t = dumped.get(tid)
        if t is None:
            out.extend(row for row in python_rows if row[0] == tid)
            continue
        name = names.get(tid) or t.name
        out.extend((tid, name, tid == main, depth, NATIVE if native else PYTHON, function, file, line)
                   for depth, (function, file, line, native) in enumerate(t.frames))
    return out


def refusal_note(returncode: int | None, stderr: str, scope: int | None) -> str:
    """One line: why py-spy gave no dump (its exit code and first error line; the ptrace rule)."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    first = next((ln for ln in lines if "error" in ln.lower() or "permission" in ln.lower()), lines[0] if lines else "")
    denied = any(w in stderr.lower() for w in ("permission denied", "operation not permitted", "eperm"))
    why = "ptrace refused by the OS" if denied else f"py-spy exited with {returncode}"
    if scope is not None and scope > 0:
        why += f" (kernel.yama.ptrace_scope={scope})"
    elif denied:
        why += " (a container without CAP_SYS_PTRACE, or a seccomp rule)"
    return f"native stacks unavailable: {why}" + (f": {first[:200]}" if first else "")


# --- the I/O -------------------------------------------------------------------------------
def find_pyspy(given: str | None = None) -> str | None:
    """The py-spy to run: ``given`` (a path or a name on PATH), else the one installed beside
    this interpreter (a virtualenv's bin, which torchrun's ranks may not have on PATH), else PATH."""
    if given:
        return shutil.which(given) or (given if os.path.isfile(given) and os.access(given, os.X_OK) else None)
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    if os.path.isfile(beside) and os.access(beside, os.X_OK):
        return beside
    return shutil.which("py-spy")


def yama_scope(path: str = YAMA_SCOPE) -> int | None:
    """Yama's ptrace_scope (None: no Yama here, any process may trace another of its user)."""
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _allow_tracer(pid: int) -> bool:
    """Let ``pid`` (our child) trace this process under Yama's scope 1."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PTRACER, pid, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def take_dump(timeout: float, pyspy: str | None = None, pid: int | None = None,
              run: Callable[..., Any] | None = None) -> NativeDump:
    """py-spy's dump of ``pid`` (this process), waited for at most ``timeout`` seconds. Never
    raises: a dump that cannot be had is a ``NativeDump`` with its ``note``. ``run``: for
    tests, a stand-in for starting the child (gets argv and ``timeout``; returns
    (returncode, stdout, stderr))."""
    binary = find_pyspy(pyspy)
    if binary is None:
        return NativeDump(note=f"native stacks unavailable: py-spy not found ({pyspy or 'py-spy'}; pip install py-spy)")
    pid = os.getpid() if pid is None else pid
    argv = [binary, "dump", "--native", "--json", "--pid", str(pid)]
    scope = yama_scope()
    if not _one_at_a_time.acquire(timeout=timeout):
        return NativeDump(note=f"native stacks unavailable: another dump took longer than {timeout:g} s")
    try:
        returncode, out, err = (run or _run_child)(argv, timeout=timeout, name_tracer=scope == 1 and pid == os.getpid())
    except subprocess.TimeoutExpired:
        return NativeDump(note=f"native stacks unavailable: py-spy took longer than {timeout:g} s "
                               "(PROBING_NATIVE_STACKS_TIMEOUT_SEC)")
    except OSError as exc:
        return NativeDump(note=f"native stacks unavailable: cannot run {binary}: {exc}")
    finally:
        _one_at_a_time.release()
    if returncode != 0:
        if "--json" in err and ("unexpected" in err or "unrecognized" in err or "Found argument" in err):
            return NativeDump(note=f"native stacks unavailable: {binary} has no --json (py-spy 0.4 or later needed)")
        return NativeDump(note=refusal_note(returncode, err, scope))
    try:
        return NativeDump(parse_dump(out))
    except (ValueError, KeyError, TypeError) as exc:
        return NativeDump(note=f"native stacks unavailable: py-spy's output was not understood: {exc}"[:300])


def _run_child(argv: list[str], *, timeout: float, name_tracer: bool) -> tuple[int, str, str]:
    """Run py-spy, its output into files: one ``wait`` bounds the whole run (no pipe to
    drain meanwhile, none held open by anything it leaves behind). ``name_tracer``: it waits on its stdin (a shell's ``read``, then ``exec``: the same pid)
    until this process has named it its tracer."""
    import tempfile

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        if name_tracer:
            child = subprocess.Popen(["/bin/sh", "-c", 'read _ && exec "$@"', "sh", *argv], stdin=subprocess.PIPE,
                                     stdout=out, stderr=err, text=True)
        else:
            child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err)
        try:
            if name_tracer:
                _allow_tracer(child.pid)
                child.stdin.write("go\n")  # type: ignore[union-attr]
                child.stdin.close()  # type: ignore[union-attr]
            returncode = child.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            raise
        out.seek(0)
        err.seek(0)
        return returncode, out.read(), err.read()
