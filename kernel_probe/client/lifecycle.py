"""Whether a job runs, ended, was launched again, or is gone: one state machine for every
front end (both clients, the ``%cluster_nodes`` widget, the CLI's ``--watch``, the Jupyter
server), so each says "the job ended" and "the job restarted" once, in the same words.

Sans-IO: observations in (what a front end saw, with the time from an injected clock),
the new state and the one-time notice out. What a front end observes:

- ``Seen(launch)``: the job answered from ``launch`` (its run id, root endpoint and
  pid), or a client found that live new launch and follows it;
- ``Ended(why)``: its root is known to be gone (``follow.root_gone``), or its
  connection file was removed;
- ``Asked()``: someone still asks for the job (seeing it answer counts too);
- ``Tick()``: time passed; an ended job nobody asked for in ``forget_after`` seconds is
  gone (a front end forgets it).

States: ``running`` (it answers), ``ended`` (its root is gone, waiting for a relaunch),
``relaunched`` (a new launch of the same job was met; ``running`` once it answers
again), ``gone`` (forgotten: final).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union

from ..config import split_run_id

RUNNING, ENDED, RELAUNCHED, GONE = "running", "ended", "relaunched", "gone"
STATES = (RUNNING, ENDED, RELAUNCHED, GONE)
WAITING = "waiting for it to be launched again"


def job_name(run_id: str | None) -> str:
    """The job a run id belongs to, the same across its launches: torchrun's run ids are
    ``<rdzv id>/r<restart>``, and a relaunch or an in-place restart only changes the suffix."""
    return split_run_id(run_id)[0]


@dataclass(frozen=True)
class Launch:
    """One launch of a job: what tells it from the next one."""

    run_id: str | None
    endpoint: str
    pid: int | None = None


@dataclass(frozen=True)
class Seen:
    launch: Launch
    followed: int = 1  # relaunches a client followed to get there (several between two looks count each)


@dataclass(frozen=True)
class Ended:
    why: str


@dataclass(frozen=True)
class Asked:
    pass


@dataclass(frozen=True)
class Tick:
    pass


Observation = Union[Seen, Ended, Asked, Tick]


@dataclass(frozen=True)
class Transition:
    state: str
    notice: str | None = None  # say this once


def restart_notice(launch: Launch, restarts: int) -> str:
    pid = f"root pid {launch.pid} " if launch.pid is not None else ""
    return (f"job {job_name(launch.run_id) or launch.run_id} restarted: following its new launch "
            f"({pid}at {launch.endpoint}; restart {restarts})")


def ended_notice(why: str) -> str:
    return f"{why}; {WAITING}"


class JobLifecycle:
    """The life of one job as one front end sees it."""

    def __init__(self, clock: Callable[[], float], forget_after: float = float("inf"),
                 launch: Launch | None = None) -> None:
        self._clock = clock
        self.forget_after = forget_after
        self.state = RUNNING
        self.launch = launch  # the launch last seen (None: not met yet)
        self.restarts = 0  # relaunches seen since this front end first met the job
        self.why: str | None = None  # why it ended, while ended
        self.notice: str | None = None  # the last relaunch's notice
        self._asked = clock()  # when someone last asked for it

    def observe(self, obs: Observation) -> Transition:
        now = self._clock()
        if self.state == GONE:
            return Transition(GONE)
        if isinstance(obs, Tick):
            if self.state == ENDED and now - self._asked >= self.forget_after:
                self.state = GONE
            return Transition(self.state)
        if isinstance(obs, Asked):
            self._asked = now
            return Transition(self.state)
        if isinstance(obs, Ended):
            if self.state == ENDED:
                return Transition(ENDED)
            self.state, self.why = ENDED, obs.why
            return Transition(ENDED, ended_notice(obs.why))
        self._asked = now  # Seen: it answered someone
        if self.launch is None or obs.launch == self.launch:
            self.launch = self.launch or obs.launch
            self.state, self.why = RUNNING, None
            return Transition(RUNNING)
        self.launch, self.why = obs.launch, None
        self.restarts += max(1, obs.followed)
        self.state = RELAUNCHED
        self.notice = restart_notice(obs.launch, self.restarts)
        return Transition(RELAUNCHED, self.notice)

    @property
    def ended(self) -> bool:
        return self.state in (ENDED, GONE)


__all__ = ["RUNNING", "ENDED", "RELAUNCHED", "GONE", "STATES", "WAITING", "Launch", "Seen", "Ended", "Asked", "Tick",
           "Observation", "Transition", "JobLifecycle", "job_name", "restart_notice", "ended_notice"]
