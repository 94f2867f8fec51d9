"""The routes under ``<base_url>/probing/api/`` (docs/panel.md's route table).

The handlers only translate HTTP: they read the request, call the job's client
(``kernel_probe.client.AsyncJobClient``, whatever kind of job) and answer the ``to_dict()``
of a typed payload (``kernel_probe.frontend``: ``NodesAnswer``, ``QueryAnswer``, ...), whose
schema ``schema.py`` derives from the same record.

Every handler is a jupyter_server ``APIHandler``: authenticated (token, cookie + XSRF)
and authorized (resource ``probing``; GET is "read", the rest "write"). Answers are
JSON; errors are JSON ``{"message", "code"}`` (plus ``line``/``col`` for SQL) with
a real status: 400 bad input or SQL, 403 refused, 404 unknown job, 409 a job of this
machine cannot be removed or a profile capture already runs, 502 unreachable or ended, 503 busy, 504 timed out.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from typing import Any, Awaitable, Callable

import tornado.web
from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join

import kernel_probe
from kernel_probe.client import ANSWER_GRACE, AsyncJobClient, ProfileBusy
from kernel_probe.frontend import (MIN_WAIT_SEC, JobsAnswer, NodesAnswer, ProfileError, ProfileProgress,
                                   ProfileResultAnswer, ProfileStateAnswer, QueryAnswer, StacksAnswer, VerdictAnswer,
                                   VersionAnswer, cancel_captures_async, is_address, json_safe, parse_ranks, RankRanges,
                                   rank_ranges, stacks_sql)

from .. import __version__
from .captures import FAILED, Capture
from .clients import ClusterClients, TimedOut

API_VERSION = 2  # bump when a route's shape changes; the panel checks it at start
AUTH_RESOURCE = "probing"
JOB_ID = r"(?P<job_id>[A-Za-z0-9._-]+)"
MAX_TIMEOUT = 300.0
DEFAULT_ROW_LIMIT = 10_000
STATE_KEY = "probing_magics"  # where the ClusterClients live in the tornado settings


class ApiError(Exception):
    """An error answer: HTTP status, a machine-readable code, a one-line message."""

    def __init__(self, status: int, code: str, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status, self.code, self.extra = status, code, extra


# QueryFailed codes that mean "the job could not answer in time / now", not "your query is wrong"
_QUERY_STATUS = {"timeout": 504, "busy": 503, "partial": 502}


def api_error(exc: BaseException) -> ApiError:
    """The HTTP answer an exception from the cluster or the registry means."""
    message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ProfileBusy):
        return ApiError(409, "busy", message)
    if isinstance(exc, kernel_probe.UnknownJob):
        return ApiError(404, "unknown_job", message)
    if isinstance(exc, kernel_probe.QueryFailed):
        status = _QUERY_STATUS.get(exc.code, 400)
        return ApiError(status, exc.code, message, line=exc.line, col=exc.col, coverage=json_safe(exc.coverage))
    if isinstance(exc, kernel_probe.BadArgument):  # (the routes check their own; a client's check as a backstop)
        return ApiError(400, "bad_request", message)
    if isinstance(exc, kernel_probe.AuthError):
        return ApiError(403, "job_refused", message)
    if isinstance(exc, TimedOut):
        return ApiError(504, "timeout", message)
    if isinstance(exc, kernel_probe.JobEndedError):
        return ApiError(502, "job_ended", message)
    if isinstance(exc, kernel_probe.ConnectError):
        return ApiError(502, "unreachable", message)
    if isinstance(exc, kernel_probe.ProbeError):
        return ApiError(502, "probe_error", message)
    if isinstance(exc, ValueError):
        return ApiError(400, "bad_request", message)
    raise exc


def json_errors(method: Callable[..., Awaitable[None]]) -> Callable[..., Awaitable[None]]:
    """Answer expected failures as JSON with their status; anything else stays a 500."""

    @functools.wraps(method)
    async def wrapper(self: "ProbingHandler", *args: Any, **kw: Any) -> None:
        try:
            await method(self, *args, **kw)
        except Exception as exc:
            try:
                err = api_error(exc)
            except Exception:
                raise exc from None
            self.set_status(err.status)
            self.log.info("probing: %s %s -> %d %s", self.request.method, self.request.path, err.status, err)
            self.reply({"message": str(err), "code": err.code,
                        **{k: v for k, v in err.extra.items() if v is not None}})

    return wrapper


class ProbingHandler(APIHandler):
    auth_resource = AUTH_RESOURCE

    @property
    def clients(self) -> ClusterClients:
        return self.settings[STATE_KEY]

    def reply(self, body: Any) -> None:
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(body, allow_nan=False))

    def job_dict(self, job: kernel_probe.Job) -> dict:
        """A job as the routes show it: with the relaunches the server saw (a panel that first
        meets the job while it is ended counts from there, so it can say it restarted)."""
        return {**json_safe(job.to_dict()), "restarts": self.clients.restarts(job.id)[0]}

    def body(self) -> dict:
        try:
            data = json.loads(self.request.body or b"{}")
        except ValueError:
            raise ApiError(400, "bad_request", "the request body is not JSON") from None
        if not isinstance(data, dict):
            raise ApiError(400, "bad_request", "the request body must be a JSON object")
        return data


def _timeout(value: Any, default: float) -> float:
    if value is None or value == "":
        return default
    try:
        t = float(value)
    except (TypeError, ValueError):
        raise ApiError(400, "bad_request", f"bad timeout {value!r}: expected seconds") from None
    if not 0 < t <= MAX_TIMEOUT:
        raise ApiError(400, "bad_request", f"timeout must be in (0, {MAX_TIMEOUT:g}] seconds")
    return t


def _ranks(value: Any) -> RankRanges | None:
    """'0-3,8', [0, 1] or None -> ranges (None: every rank), never expanded here on the event
    loop: the client checks them against the job's world size first."""
    if value is not None and not isinstance(value, (str, list)):
        raise ApiError(400, "bad_request", "ranks must be a list of ranks or a string like 0-3,8")
    try:
        return rank_ranges(value)
    except ValueError as exc:
        raise ApiError(400, "bad_request", str(exc)) from None


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise ApiError(400, "bad_request", f"{name} must be true or false")
    return value


class VersionHandler(ProbingHandler):
    @tornado.web.authenticated
    @authorized
    @json_errors
    async def get(self) -> None:
        self.reply(VersionAnswer(API_VERSION, __version__, kernel_probe.PROTOCOL_VERSION).to_dict())


class JobsHandler(ProbingHandler):
    @tornado.web.authenticated
    @authorized
    @json_errors
    async def get(self) -> None:
        jobs = await self.clients.jobs()
        self.reply(JobsAnswer([self.job_dict(j) for j in jobs], time.time()).to_dict())

    @tornado.web.authenticated
    @authorized
    @json_errors
    async def post(self) -> None:
        body = self.body()
        target, token = body.get("target"), body.get("token")
        if not isinstance(target, str) or not is_address(target):
            raise ApiError(400, "bad_request", "target must be an address: tcp://host:port or "
                                               "store://host:port[/run_id], or an ended job's dumps: dump://DIR")
        if token is not None and not isinstance(token, str):
            raise ApiError(400, "bad_request", "token must be a string")
        job = await self.clients.add(target.strip(), token or None, _timeout(body.get("timeout"), 5.0))
        self.set_status(201)
        self.reply(self.job_dict(job))


class JobHandler(ProbingHandler):
    @tornado.web.authenticated
    @authorized
    @json_errors
    async def get(self, job_id: str) -> None:
        self.reply(self.job_dict(await self.clients.job(job_id)))

    @tornado.web.authenticated
    @authorized
    @json_errors
    async def delete(self, job_id: str) -> None:
        job = await self.clients.job(job_id)
        if job.source == "local":
            raise ApiError(409, "local_job", f"job {job_id} runs on this machine: it cannot be removed, only stopped")
        await self.clients.remove(job_id)
        self.set_status(204)
        self.finish()


class NodesHandler(ProbingHandler):
    @tornado.web.authenticated
    @authorized
    @json_errors
    async def get(self, job_id: str) -> None:
        timeout = _timeout(self.get_query_argument("timeout", None), 5.0)

        async def nodes(client: AsyncJobClient) -> tuple[dict, dict, float | None]:
            # an ended job's dumps: ages as of its last view (seen_at), not now
            return await client.nodes_raw(timeout), dict(client.info_), client.seen_at

        raw, info, seen_at = await self.clients.call(job_id, nodes, timeout)
        restarts, notice = self.clients.restarts(job_id)  # relaunches the server saw (same job id)
        self.reply(NodesAnswer.of(job_id, raw, info, seen_at or time.time(), restarts, notice).to_dict())


class QueryHandler(ProbingHandler):
    @tornado.web.authenticated
    @authorized
    @json_errors
    async def post(self, job_id: str) -> None:
        body = self.body()
        sql = body.get("sql")
        if not isinstance(sql, str) or not sql.strip():
            raise ApiError(400, "bad_request", "sql must be a non-empty string")
        timeout = _timeout(body.get("timeout"), 10.0)
        ranks, per_rank, strict = _ranks(body.get("ranks")), _flag(body, "per_rank"), _flag(body, "strict")
        profile = _flag(body, "profile")  # every hop's part of coverage["profile"]
        limit = body.get("limit", DEFAULT_ROW_LIMIT)
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
            raise ApiError(400, "bad_request", "limit must be a non-negative integer")

        async def query(client: AsyncJobClient) -> Any:
            return await client.query(sql, timeout=timeout, strict=strict, per_rank=per_rank, ranks=ranks,
                                      profile=profile)

        result = await self.clients.call(job_id, query, timeout + ANSWER_GRACE)
        self.reply(QueryAnswer.of(result, limit).to_dict())


class StacksHandler(ProbingHandler):
    @tornado.web.authenticated
    @authorized
    @json_errors
    async def get(self, job_id: str) -> None:
        ranks = _ranks(self.get_query_argument("ranks", None))
        timeout = _timeout(self.get_query_argument("timeout", None), 10.0)

        async def stacks(client: AsyncJobClient) -> Any:
            return await client.query(stacks_sql(), timeout=timeout, ranks=ranks)

        result = await self.clients.call(job_id, stacks, timeout + ANSWER_GRACE)
        self.reply(StacksAnswer.of(result).to_dict())


class DiagnoseHandler(ProbingHandler):
    @tornado.web.authenticated
    @authorized
    @json_errors
    async def get(self, job_id: str) -> None:
        timeout = _timeout(self.get_query_argument("timeout", None), 10.0)
        min_wait = self.get_query_argument("min_wait", None)
        try:
            min_wait_sec = MIN_WAIT_SEC if min_wait in (None, "") else float(min_wait)
        except ValueError:
            raise ApiError(400, "bad_request", f"bad min_wait {min_wait!r}: expected seconds") from None
        if not 0 <= min_wait_sec <= MAX_TIMEOUT * 12:
            raise ApiError(400, "bad_request", "min_wait must be seconds, not negative")

        native = self.get_query_argument("native", "") in ("1", "true")

        async def diagnose(client: AsyncJobClient) -> Any:
            return await client.diagnose(timeout=timeout, min_wait=min_wait_sec, native=native)

        # two rounds: membership, groups and stacks at once, then the groups' recorder entries
        result = await self.clients.call(job_id, diagnose, 2 * (timeout + ANSWER_GRACE))
        self.reply(VerdictAnswer.of(result, time.time()).to_dict())


ARM_WAIT_SEC = 15.0  # a capture's start waits this long for its ranks' first answer (a refusal comes then)
TRACE_CHUNK = 1 << 20


def capture_dict(capture: Capture | None, job_id: str) -> dict:
    """A capture as GET jobs/<id>/profile answers it (``ProfileStateAnswer``); state "none"
    before the first one."""
    if capture is None:
        return ProfileStateAnswer.none(job_id, time.time()).to_dict()
    error = None
    if capture.error is not None:
        try:
            err = api_error(capture.error)
            error = ProfileError(err.status, err.code, str(err))
        except Exception:  # not a failure the routes know: said as it is, in one line
            text = str(capture.error).splitlines()[0] if str(capture.error) else ""
            error = ProfileError(500, "internal", f"{type(capture.error).__name__}: {text}")
    progress = None if capture.progress is None else ProfileProgress(**capture.progress)
    result = None if capture.result is None else ProfileResultAnswer.of(capture.result, capture.top,
                                                                          capture.trace_file())
    return ProfileStateAnswer(capture.state, capture.job_id, capture.ranks, capture.steps, capture.started,
                              capture.ended, progress, result, error, time.time()).to_dict()


class ProfileHandler(ProbingHandler):
    """A profile capture of a job, run by the server: ``POST`` starts it (``{"ranks", "steps",
    "timeout", "top"}``; 409 while one runs in the job), ``GET`` follows it (its state, progress,
    then its answer: who was profiled, who failed why, the slowest rank's top ops next to the
    median's, the merged trace to download from ``profile/trace``), ``DELETE`` cancels it."""

    @tornado.web.authenticated
    @authorized
    @json_errors
    async def get(self, job_id: str) -> None:
        await self.clients.job(job_id)  # 404 for a job the server does not know
        self.reply(capture_dict(self.clients.captures.current(job_id), job_id))

    @tornado.web.authenticated
    @authorized
    @json_errors
    async def post(self, job_id: str) -> None:
        body = self.body()
        ranks = _ranks(body.get("ranks"))
        timeout = _timeout(body.get("timeout"), 60.0)
        steps, top = body.get("steps", 2), body.get("top", 10)
        for name, value in (("steps", steps), ("top", top)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ApiError(400, "bad_request", f"{name} must be a whole number >= 1")
        job = await self.clients.job(job_id)
        if ranks is not None:  # checked against the job's size, then expanded
            try:
                ranks = parse_ranks(ranks, job.world_size or None)
            except ValueError as exc:
                raise ApiError(400, "bad_ranks", str(exc)) from None
        clients, captures = self.clients, self.clients.captures

        async def run(capture: Capture) -> Any:
            def progress(p: dict) -> None:
                capture.progress = dict(p)
                capture.armed.set()

            async def profile(client: AsyncJobClient) -> Any:
                return await client.profile(ranks=ranks, steps=steps, out=str(capture.trace_path), timeout=timeout,
                                            on_progress=progress)

            # each poll and read is its own query: room for them past the capture's own deadline
            return await clients.call(job_id, profile, timeout + 30.0)

        capture = captures.start(job_id, ranks, steps, top, run, job.run_id)  # ProfileBusy: 409
        try:  # a refusal (another capture, unknown ranks, an ended job) comes before the first poll
            await asyncio.wait_for(asyncio.shield(capture.armed.wait()), ARM_WAIT_SEC)
        except asyncio.TimeoutError:
            pass
        if capture.state == FAILED and capture.error is not None:
            captures.withdraw(capture)  # refused: what the job showed before stays
            raise capture.error
        self.set_status(202 if capture.running else 200)
        self.reply(capture_dict(capture, job_id))

    @tornado.web.authenticated
    @authorized
    @json_errors
    async def delete(self, job_id: str) -> None:
        await self.clients.job(job_id)
        capture = self.clients.captures.cancel(job_id)
        if capture is None:  # none of the server's: one another client started, cancelled on its ranks
            cancelled = await self.clients.call(job_id, cancel_captures_async, 15.0)
            if not cancelled:
                raise ApiError(409, "not_running", f"no capture is running in job {job_id}")
            self.reply(capture_dict(self.clients.captures.current(job_id), job_id))
            return
        if capture.task is not None:  # its ranks are told to stop: a moment
            await asyncio.wait({capture.task}, timeout=10.0)
        self.reply(capture_dict(capture, job_id))


class ProfileTraceHandler(ProbingHandler):
    """GET jobs/<id>/profile/trace[?capture=ID]: the merged Chrome/Perfetto trace of the job's
    last capture, as a download. The file is the one the server wrote for that capture (never
    a path a caller names); 404 when there is none, or ``capture`` names an older one."""

    @tornado.web.authenticated
    @authorized
    @json_errors
    async def get(self, job_id: str) -> None:
        await self.clients.job(job_id)
        capture = self.clients.captures.current(job_id)
        path = capture.trace_file() if capture is not None else None
        wanted = self.get_query_argument("capture", None)
        if path is None or (wanted and wanted != capture.result.capture_id):
            raise ApiError(404, "no_trace", f"no trace of {'capture ' + wanted if wanted else 'a capture'} in job "
                                            f"{job_id}: a newer capture replaced it, or none wrote one")
        name = f"probing-profile-{capture.result.capture_id}.json"
        self.set_header("Content-Type", "application/json")
        self.set_header("Content-Disposition", f'attachment; filename="{name}"')
        loop = asyncio.get_running_loop()
        with path.open("rb") as fh:
            while chunk := await loop.run_in_executor(None, fh.read, TRACE_CHUNK):
                self.write(chunk)
                await self.flush()
        self.finish()

def setup_handlers(web_app: tornado.web.Application) -> ClusterClients:
    """Register the routes under the server's base_url; returns the server's job clients."""
    clients = web_app.settings.get(STATE_KEY)
    if clients is None:
        clients = web_app.settings[STATE_KEY] = ClusterClients()
    base = url_path_join(web_app.settings.get("base_url", "/"), "probing", "api")
    web_app.add_handlers(".*$", [
        (url_path_join(base, "version"), VersionHandler),
        (url_path_join(base, "jobs"), JobsHandler),
        (url_path_join(base, "jobs", JOB_ID), JobHandler),
        (url_path_join(base, "jobs", JOB_ID, "nodes"), NodesHandler),
        (url_path_join(base, "jobs", JOB_ID, "query"), QueryHandler),
        (url_path_join(base, "jobs", JOB_ID, "stacks"), StacksHandler),
        (url_path_join(base, "jobs", JOB_ID, "diagnose"), DiagnoseHandler),
        (url_path_join(base, "jobs", JOB_ID, "profile"), ProfileHandler),
        (url_path_join(base, "jobs", JOB_ID, "profile", "trace"), ProfileTraceHandler),
    ])
    return clients
