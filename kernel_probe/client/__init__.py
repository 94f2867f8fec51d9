"""Talk to a running job from another process: the notebook kernel, the Jupyter server,
the CLI. ``connect(target)`` resolves where the root is and which key signs our
messages (``targets``) and checks it with a handshake; ``Client`` (blocking) and
``AsyncClient`` (asyncio) keep any number of requests in flight on one connection,
matched to their answers by a sans-IO core (``requests``), and turn every failure
into a one-line ``ProbeError`` (never a traceback from zmq or torch). Whether the job
runs, ended or was launched again is one state machine (``lifecycle``) that every front
end feeds; whether a root process runs is one rule (``alive.root_alive``). A job that ended
answers through its dumps (``dump://DIR``, ``dumps.DumpClient``) the same calls: every kind
satisfies ``JobClient`` (``AsyncJobClient`` for asyncio code), so front ends never ask which.
"""

from __future__ import annotations

import os

from .aio import AsyncClient, connect_async
from .blocking import Client
from .errors import AuthError, BadArgument, ConnectError, JobEndedError, NoAnswerError, ProbeError, QueryFailed
from .profiles import ProfileBusy, ProfileFailed, ProfileResult
from .protocol import AsyncJobClient, InThreads, JobClient
from .results import (ANSWER_GRACE, DEPARTURE_COLUMNS, NODE_COLUMNS, QueryResult, describe_failures,
                      members_frame)
from .targets import Target, resolve

__all__ = [
    "connect", "connect_async", "resolve", "Target", "Client", "AsyncClient", "QueryResult",
    "ProbeError", "ConnectError", "JobEndedError", "NoAnswerError", "AuthError", "QueryFailed", "BadArgument",
    "NODE_COLUMNS", "DEPARTURE_COLUMNS", "ANSWER_GRACE", "members_frame", "describe_failures",
    "ProfileBusy", "ProfileFailed", "ProfileResult", "JobClient", "AsyncJobClient", "InThreads",
]


def connect(target: str | os.PathLike | None = None, token: str | None = None, timeout: float = 5.0,
            warm: bool = True) -> JobClient:
    """A client of the job at ``target`` (``tcp://host:port``, a connection file,
    ``store://host:port[/run_id]``, or None for the newest job here), checked with a handshake.
    ``warm``: return once the ranks' query engines are loaded (at most ``WARM_WAIT_MAX``
    seconds on a cold job, a few ms on a warm one), so the first query is fast.
    ``dump://DIR``: an ended job's dumps, answered in this process (a ``DumpClient``)."""
    from .dumps import open_dumps
    from .targets import is_dump

    if is_dump(target):
        return open_dumps(target)  # type: ignore[arg-type]
    return Client.open(resolve(target, token), timeout, warm=warm)
