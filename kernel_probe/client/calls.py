"""Flows written once, run on every kind of client.

A flow (``diagnose.Diagnosis.run``, ``profiles.ProfileRun.run``) is a generator that yields
client calls and receives their answers: a batch (``{name: Call}``, answered ``{name:
answer}``) or one ``Call`` (answered by its value); it never touches a socket, a thread or
the clock (``Call("sleep", (seconds,))`` is the driver's own wait). ``drive`` runs it on a
blocking client (the calls of a batch one after the other: a live ``Client``, a
``DumpClient``), ``drive_async`` on an ``AsyncClient`` (the calls of a batch at once). A
call's exception is thrown back into the flow, except that an ``optional`` call failing
with a ``ProbeError`` answers None (an ended job's dumps may lack a table: that query then
has no answer, the others still do).
"""

from __future__ import annotations

import time
from typing import Any, Generator, Mapping, NamedTuple, Union

from .errors import ProbeError

Batch = Mapping[str, "Call"]
Flow = Generator[Union[Batch, "Call"], Any, Any]


class Call(NamedTuple):
    """One client method to call: ``client.<method>(*args, **kwargs)``."""

    method: str
    args: tuple = ()
    kwargs: dict = {}
    optional: bool = False  # a ProbeError answers None instead of ending the flow


def query(sql: str, params: Mapping[str, Any] | None = None, *, optional: bool = False, **kwargs: Any) -> Call:
    """A ``query`` call (``params`` bind as ``$name``)."""
    if params is not None:
        kwargs["params"] = params
    return Call("query", (sql,), kwargs, optional)


def _resume(flow: Flow, answers: Any, error: BaseException | None) -> tuple[Batch | Call | None, Any]:
    """The flow's next batch (given the last one's answers, or its error), or (None, what it returned)."""
    try:
        return (flow.throw(error) if error is not None else flow.send(answers)), None  # type: ignore[arg-type]
    except StopIteration as stop:
        return None, stop.value


def drive(flow: Flow, client: Any) -> Any:
    """Run ``flow`` on a blocking client; what it returns."""
    answers: Any = None
    error: BaseException | None = None
    while True:
        asked, returned = _resume(flow, answers, error)
        if asked is None:
            return returned
        try:
            answers = (_call(client, asked) if isinstance(asked, Call)
                       else {name: _call(client, call) for name, call in asked.items()})
            error = None
        except BaseException as exc:  # noqa: B036 - an interrupt too: the flow may clean up
            answers, error = None, exc


def _call(client: Any, call: Call) -> Any:
    if call.method == "sleep":
        return time.sleep(*call.args)
    try:
        return getattr(client, call.method)(*call.args, **call.kwargs)
    except ProbeError:
        if call.optional:
            return None
        raise


async def drive_async(flow: Flow, client: Any) -> Any:
    """``drive`` for an asyncio client: each batch's calls are awaited together."""
    import asyncio

    async def one(call: Call) -> Any:
        if call.method == "sleep":
            return await asyncio.sleep(*call.args)
        try:
            return await getattr(client, call.method)(*call.args, **call.kwargs)
        except ProbeError:
            if call.optional:
                return None
            raise

    answers: Any = None
    error: BaseException | None = None
    while True:
        asked, returned = _resume(flow, answers, error)
        if asked is None:
            return returned
        try:
            if isinstance(asked, Call):
                answers = await one(asked)
            else:
                answers = dict(zip(asked, await asyncio.gather(*(one(call) for call in asked.values()))))
            error = None
        except BaseException as exc:  # noqa: B036 - a cancellation too: the flow may clean up
            answers, error = None, exc
