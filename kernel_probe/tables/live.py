"""Tables computed at query time, not recorded: stacks, process, env."""

from __future__ import annotations

import os
import socket
import sys
from types import FrameType
import threading

from ..progress import torch_initialized
from ..redaction import redact_argv, redact_env


def stack_rows() -> list[tuple]:
    """(thread_id, thread_name, is_main, depth, frame_type, function, file, line) for every
    Python frame of every thread (frame_type 'python'), depth 0 = innermost; the main
    thread first, then by thread id. Native frames: ``tables.readers.native_stacks``."""
    frames = sys._current_frames()
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    rows: list[tuple] = []
    for tid in sorted(frames, key=lambda t: (t != main, t)):
        frame = frames[tid]
        name, is_main, depth = names.get(tid), tid == main, 0
        # another thread's frame chain can hold a non-frame here on CPython 3.11 (a frame
        # being torn down while we read it): stop at anything that is not a frame
        while isinstance(frame, FrameType):
            code = frame.f_code
            rows.append((tid, name, is_main, depth, "python", code.co_name, code.co_filename, frame.f_lineno))
            frame = frame.f_back
            depth += 1
    del frames, frame
    return rows


def process_row(host: str | None = None) -> tuple:
    """(pid, host, python, torch, argv, start_time, threads); torch is NULL until the
    application loaded it; threads counts OS threads (native ones included); argv with its
    secrets redacted (``redaction``)."""
    import platform  # here: a probe that is never queried does not load them
    import shlex

    torch_version = getattr(sys.modules.get("torch"), "__version__", None) if torch_initialized() else None
    argv = redact_argv(getattr(sys, "argv", None) or [])
    try:
        argv_text = shlex.join(str(a) for a in argv)
    except Exception:
        argv_text = " ".join(map(str, argv))
    start, threads = _start_and_threads()
    return (os.getpid(), host or socket.gethostname(), platform.python_version(),
            None if torch_version is None else str(torch_version), argv_text, start, threads)


def _start_and_threads() -> tuple[float, int]:
    """This process's start time (epoch seconds) and OS thread count: from /proc on Linux,
    since psutil would stay loaded in every rank once queried (~1.3 MB), else psutil."""
    from ..procfs import create_time

    try:
        return float(create_time(os.getpid())), len(os.listdir("/proc/self/task"))
    except OSError:
        import psutil

        proc = psutil.Process()
        with proc.oneshot():
            return float(proc.create_time()), int(proc.num_threads())


def env_rows() -> list[tuple[str, str]]:
    """(name, value) of this process's environment, sorted; secrets redacted (``redaction``:
    by name, and credentials in values).

    (This displays the environment; configuration is still read only by config.py.)"""
    return [(k, redact_env(k, v)) for k, v in sorted(os.environ.copy().items())]
