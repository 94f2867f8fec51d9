"""Profile captures the server runs for its callers: started by one request, followed by
the next ones (a capture lasts as long as its ranks take to step N times, longer than a
request should wait).

One capture per job at a time (the job itself refuses a second one; the server refuses it
before asking). Each job keeps its last capture: its state (running, done, failed,
cancelled), progress, answer or error, and the merged trace it wrote. Trace files live in
one directory the server made for them (``probing-traces-*`` under the temp dir), named by
the server (job id and a counter), one per job: a new capture of a job removes the previous
one's, and closing the server removes them all. No caller ever names a path.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

RUNNING, DONE, FAILED, CANCELLED = "running", "done", "failed", "cancelled"


@dataclass
class Capture:
    """One capture of one job, as the server follows it."""

    job_id: str
    seq: int
    ranks: list[int] | None  # as asked (None: every rank)
    steps: int
    top: int
    trace_path: Path
    started: float = field(default_factory=time.time)
    state: str = RUNNING
    ended: float | None = None
    progress: dict | None = None  # {"finished", "ranks", "running"} from the capture's last poll
    result: Any = None  # the ProfileResult once done
    error: BaseException | None = None  # why it failed
    task: asyncio.Task | None = field(default=None, repr=False)
    armed: asyncio.Event = field(default_factory=asyncio.Event, repr=False)  # the ranks answered a first poll

    @property
    def running(self) -> bool:
        return self.state == RUNNING

    def trace_file(self) -> Path | None:
        """The merged trace, when this capture wrote one (and it is still there)."""
        if self.result is None or not getattr(self.result, "trace_path", None):
            return None
        return self.trace_path if self.trace_path.is_file() else None

    def finish(self, state: str, result: Any = None, error: BaseException | None = None) -> None:
        self.state, self.result, self.error, self.ended = state, result, error, time.time()
        self.armed.set()


class ProfileCaptures:
    """The captures of every job this server runs, and the directory of their traces."""

    def __init__(self) -> None:
        self._captures: dict[str, Capture] = {}
        self._seq = 0
        self._dir: Path | None = None

    def _trace_dir(self) -> Path:
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="probing-traces-"))
        return self._dir

    def current(self, job_id: str) -> Capture | None:
        """The running capture of ``job_id``, else its last one."""
        return self._captures.get(job_id)

    def start(self, job_id: str, ranks: list[int] | None, steps: int, top: int,
              run: Callable[[Capture], Awaitable[Any]]) -> Capture:
        """Start ``run(capture)`` (it writes the trace to ``capture.trace_path`` and returns the
        result). The caller checked that no capture of the job runs."""
        previous = self._captures.get(job_id)
        if previous is not None:
            previous.trace_path.unlink(missing_ok=True)
        self._seq += 1
        capture = Capture(job_id, self._seq, ranks, steps, top,
                          self._trace_dir() / f"{job_id}-{self._seq}.trace.json")
        self._captures[job_id] = capture
        capture.task = asyncio.ensure_future(self._follow(capture, run))
        return capture

    @staticmethod
    async def _follow(capture: Capture, run: Callable[[Capture], Awaitable[Any]]) -> None:
        try:
            result = await run(capture)
        except asyncio.CancelledError:
            capture.finish(CANCELLED)
        except Exception as exc:
            capture.finish(FAILED, error=exc)
        else:
            capture.finish(DONE, result=result)

    def cancel(self, job_id: str) -> Capture | None:
        """Cancel the running capture of ``job_id`` (its ranks stop profiling); None if none runs."""
        capture = self._captures.get(job_id)
        if capture is None or not capture.running or capture.task is None:
            return None
        capture.task.cancel()
        return capture

    def forget(self, job_id: str) -> None:
        capture = self._captures.pop(job_id, None)
        if capture is not None:
            if capture.task is not None and not capture.task.done():
                capture.task.cancel()
            capture.trace_path.unlink(missing_ok=True)

    def close(self) -> None:
        for job_id in list(self._captures):
            self.forget(job_id)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
