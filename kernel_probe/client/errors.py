"""Every error a client raises: one line meant for a person, never a traceback from zmq."""

from __future__ import annotations


class ProbeError(Exception):
    """Base of every error a client raises; its message is one line meant for a person."""


class ConnectError(ProbeError):
    """No job there: nothing found, nothing answering."""


class JobEndedError(ConnectError):
    """The job's root process is gone."""


class NoAnswerError(ConnectError):
    """Nothing answered within the timeout (the root may be busy, frozen or cut off)."""


class BadArgument(ProbeError, ValueError):
    """A call's argument a client cannot use (a timeout that is not a number of seconds): said
    before anything is sent; a ``ValueError`` too."""


class BadTarget(ConnectError, BadArgument):
    """A target that is no address at all (``tcp://host`` without a port): a ``ConnectError``
    as every target that leads nowhere, and a ``BadArgument`` (a REST caller's 400, not a 502)."""


class AuthError(ProbeError):
    """The probe refused our credentials."""


class QueryFailed(ProbeError):
    """The query was refused or failed; ``code``, ``line``/``col`` where known, and coverage."""

    def __init__(self, message: str, *, code: str = "error", line: int | None = None, col: int | None = None,
                 coverage: dict | None = None) -> None:
        super().__init__(message)
        self.code, self.line, self.col, self.coverage = code, line, col, coverage or {}


class Refused(ProbeError):
    """The probe answered with an unsigned refusal (our key is wrong). Internal: callers
    turn it into an ``AuthError`` or, for ``tcp://`` with a token, learn the run id from it."""

    def __init__(self, reason: str, run_id: str) -> None:
        super().__init__(reason)
        self.reason, self.run_id = reason, run_id


class RequestFailed(ProbeError):
    """The probe answered a request with an ``error`` message."""
