"""``<base_url>/probing/mcp``: the MCP server (``kernel_probe.frontend.mcp_server``, the same
declaration ``kernel-probe mcp`` serves over stdio) over Streamable HTTP, for every job this
Jupyter server knows.

The SDK's Streamable HTTP transport is an ASGI app; the Jupyter server is tornado. Rather than
a second web server on another port, ``McpHandler`` is a jupyter_server ``APIHandler``
(authenticated and authorized as the REST routes: no token, no answer; XSRF as for them) that
hands each request to the SDK's session manager as one ASGI call and writes back what it
sends. The manager runs stateless with JSON answers (each POST is a whole exchange, nothing
is kept between requests), in a task started on the first request, so a server nobody asks
over MCP never imports the SDK.
"""

from __future__ import annotations

import asyncio
import dataclasses
import tempfile
from pathlib import Path
from typing import Any, Awaitable, Callable, TypeVar

import tornado.web
from jupyter_server.auth.decorator import authorized
from jupyter_server.utils import url_path_join

import kernel_probe
from kernel_probe.frontend import json_safe, mcp_server

from .clients import OPEN_TIMEOUT_SEC, ClusterClients
from .handlers import STATE_KEY, ProbingHandler

T = TypeVar("T")
BRIDGE_KEY = "probing_magics_mcp"  # where the bridge lives in the tornado settings


class ServerJobs:
    """The jobs of this Jupyter server as the MCP tools see them (``JobSource``): the clients the
    REST routes keep; the default job is the newest running one (else the newest known)."""

    def __init__(self, clients: ClusterClients) -> None:
        self.clients = clients
        self._traces: Path | None = None
        self._dumps: Path | None = None

    @property
    def trace_dir(self) -> Path:
        if self._traces is None:
            self._traces = Path(tempfile.mkdtemp(prefix="probing-mcp-traces-"))
        return self._traces

    @property
    def dump_dir(self) -> Path:
        if self._dumps is None:
            self._dumps = Path(tempfile.mkdtemp(prefix="probing-mcp-dumps-"))
        return self._dumps

    async def list(self) -> list[dict[str, Any]]:
        return [json_safe(job.to_dict()) for job in await self.clients.jobs()]

    async def _job_id(self, job: str | None) -> str:
        if job:
            return job
        jobs = await self.clients.jobs()
        running = [j for j in jobs if j.alive is not False]
        if not (running or jobs):
            raise kernel_probe.UnknownJob("no job is known to this server: start one on this machine, or add one "
                                          "(POST probing/api/jobs)")
        return (running or jobs)[0].id

    async def call(self, job: str | None, fn: Callable[[Any], Awaitable[T]], timeout: float) -> T:
        return await self.clients.call(await self._job_id(job), fn, timeout)

    async def call_blocking(self, job: str | None, fn: Callable[[Any], T], timeout: float) -> T:
        job_id = await self._job_id(job)
        if (await self.clients.job(job_id)).source == "dump":  # UnknownJob for an id not known here
            raise kernel_probe.JobEndedError(f"job {job_id} is an ended job's dumps already")
        registry = self.clients.registry

        def run() -> T:
            with registry.connect(job_id, timeout=min(timeout, 10.0), warm=False) as client:
                return fn(client)

        return await asyncio.to_thread(run)

    async def add_dump(self, target: str) -> str | None:
        # listed with the server's jobs, the panel's too (read on the server's pool for dumps)
        return (await self.clients.add(target, None, OPEN_TIMEOUT_SEC)).id


@dataclasses.dataclass
class McpBridge:
    """The MCP server of one Jupyter server and the task running its session manager."""

    jobs: ServerJobs
    manager: Any = None
    task: asyncio.Task | None = None
    ready: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    stop: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)

    async def started(self) -> Any:
        if self.task is None:
            app = mcp_server(self.jobs)
            app.streamable_http_app(stateless_http=True, json_response=True)  # makes app.session_manager
            self.manager = app.session_manager
            self.task = asyncio.create_task(self._serve(), name="probing-mcp")
        await self.ready.wait()
        return self.manager

    async def _serve(self) -> None:
        async with self.manager.run():
            self.ready.set()
            await self.stop.wait()

    def close(self) -> None:
        self.stop.set()


class McpHandler(ProbingHandler):
    """One MCP request (POST a JSON-RPC message; GET and DELETE as the transport answers them),
    after jupyter_server's authentication and authorization."""

    _closed: asyncio.Event | None = None

    @property
    def bridge(self) -> McpBridge:
        return self.settings[BRIDGE_KEY]

    def on_connection_close(self) -> None:
        if self._closed is not None:
            self._closed.set()

    @tornado.web.authenticated
    @authorized
    async def post(self) -> None:
        await self._asgi()

    @tornado.web.authenticated
    @authorized
    async def get(self) -> None:
        await self._asgi()

    @tornado.web.authenticated
    @authorized
    async def delete(self) -> None:
        await self._asgi()

    async def _asgi(self) -> None:
        manager = await self.bridge.started()
        self._closed = asyncio.Event()
        request, closed, body_sent = self.request, self._closed, False
        host, _, port = (request.host or "localhost").partition(":")
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": request.method,
            "scheme": request.protocol, "path": request.path, "raw_path": request.path.encode(),
            "query_string": request.query.encode(), "root_path": "",
            "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in request.headers.get_all()],
            "client": (request.remote_ip, 0), "server": (host, int(port) if port.isdigit() else 80),
        }

        async def receive() -> dict:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": request.body or b"", "more_body": False}
            await closed.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            if message["type"] == "http.response.start":
                self.set_status(message["status"])
                self.clear_header("Content-Type")
                for k, v in message.get("headers") or []:
                    self.add_header(k.decode("latin-1"), v.decode("latin-1"))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    self.write(message["body"])
                if message.get("more_body"):
                    await self.flush()

        try:
            await manager.handle_request(scope, receive, send)
        finally:
            closed.set()
        if not self._finished:
            self.finish()


def setup_mcp_route(web_app: tornado.web.Application) -> None:
    """Register ``<base_url>/probing/mcp`` over the server's job clients (``handlers.setup_handlers`` first)."""
    if BRIDGE_KEY not in web_app.settings:
        web_app.settings[BRIDGE_KEY] = McpBridge(ServerJobs(web_app.settings[STATE_KEY]))
    path = url_path_join(web_app.settings.get("base_url", "/"), "probing", "mcp")
    web_app.add_handlers(".*$", [(path, McpHandler)])
