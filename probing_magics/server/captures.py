"""Profile captures the server runs for its callers: started by one request, followed by
the next ones (a capture lasts as long as its ranks take to step N times, longer than a
request should wait).

One capture per job at a time: ``ProfileCaptures.start`` refuses a second one while the
job's runs (and the job itself refuses one it did not start here). Each job keeps its last
capture: its state (``kernel_probe``'s capture states; "armed" shows as running), progress,
answer or error, and the merged trace it wrote. The run renews the capture's lease on the
ranks while it waits, so a server that stops leaves no capture running for long. Trace files live in
one directory the server made for them (``probing-traces-*`` under the temp dir), named by
the server (job id and a counter), one per job: a capture that ends with a trace removes
the job's previous one, and the directory goes when the server exits. No caller ever names
a path.
"""

from __future__ import annotations

import asyncio
import atexit
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

from kernel_probe.client import ProfileBusy
from kernel_probe.frontend import CaptureState, ranks_label

RUNNING, DONE, FAILED, CANCELLED = (CaptureState.RUNNING.value, CaptureState.DONE.value, CaptureState.FAILED.value,
                                    CaptureState.CANCELLED.value)


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
        self._previous: dict[str, Capture | None] = {}  # while a capture starts: the job's last one before it
        self._traces: dict[str, Path] = {}  # the one trace file each job keeps
        self._seq = 0
        self._dir: Path | None = None

    def _trace_dir(self) -> Path:
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="probing-traces-"))
            # a module extension gets no stop hook from jupyter_server: removed when the server exits
            atexit.register(shutil.rmtree, self._dir, ignore_errors=True)
        return self._dir

    def current(self, job_id: str) -> Capture | None:
        """The running capture of ``job_id``, else its last one."""
        return self._captures.get(job_id)

    def start(self, job_id: str, ranks: list[int] | None, steps: int, top: int,
              run: Callable[[Capture], Awaitable[Any]], job_name: str | None = None) -> Capture:
        """Start ``run(capture)`` (it writes the trace to ``capture.trace_path`` and returns the
        result). ``ProfileBusy`` while a capture of the job runs: one per job."""
        running = self._captures.get(job_id)
        if running is not None and running.running:
            on = "every rank" if running.ranks is None else ranks_label(running.ranks)
            raise ProfileBusy(f"a capture is already running in job {job_name or job_id} ({running.steps} step(s) "
                              f"on {on}, started {time.time() - running.started:.0f} s ago): one capture per job "
                              "at a time; wait for it to finish or cancel it")
        self._seq += 1
        capture = Capture(job_id, self._seq, ranks, steps, top,
                          self._trace_dir() / f"{job_id}-{self._seq}.trace.json")
        self._previous[job_id] = self._captures.get(job_id)
        self._captures[job_id] = capture
        capture.task = asyncio.ensure_future(self._follow(capture, run))
        return capture

    def withdraw(self, capture: Capture) -> None:
        """``capture`` was refused at its start: the job's last capture is the one before it again."""
        if self._captures.get(capture.job_id) is capture:
            previous = self._previous.pop(capture.job_id, None)
            if previous is None:
                del self._captures[capture.job_id]
            else:
                self._captures[capture.job_id] = previous

    def _ended(self, capture: Capture) -> None:
        """One trace per job: the one of the capture that ended last with one."""
        if capture.trace_file() is None:
            return
        old = self._traces.get(capture.job_id)
        if old is not None and old != capture.trace_path:
            old.unlink(missing_ok=True)
        self._traces[capture.job_id] = capture.trace_path

    async def _follow(self, capture: Capture, run: Callable[[Capture], Awaitable[Any]]) -> None:
        try:
            result = await run(capture)
        except asyncio.CancelledError:
            capture.finish(CANCELLED)
        except Exception as exc:
            capture.finish(FAILED, error=exc)
        else:
            capture.finish(DONE, result=result)
            self._ended(capture)
        if capture.state != FAILED and self._captures.get(capture.job_id) is capture:
            self._previous.pop(capture.job_id, None)  # only a refused start goes back to it

    def cancel(self, job_id: str) -> Capture | None:
        """Cancel the running capture of ``job_id`` (its ranks stop profiling); None if none runs."""
        capture = self._captures.get(job_id)
        if capture is None or not capture.running or capture.task is None:
            return None
        capture.task.cancel()
        return capture

    def forget(self, job_id: str) -> None:
        capture = self._captures.pop(job_id, None)
        self._previous.pop(job_id, None)
        if capture is not None and capture.task is not None and not capture.task.done():
            capture.task.cancel()
        trace = self._traces.pop(job_id, None)
        if trace is not None:
            trace.unlink(missing_ok=True)

    def close(self) -> None:
        for job_id in list(self._captures):
            self.forget(job_id)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
