"""The agent surface: an MCP server over a job (``server``), its tools as plain async functions
(``tools``), where it finds its jobs (``jobs``), the tables' meanings (``catalog``) and the
playbooks (``playbooks``, data in ``kernel_probe/playbooks``).

Importing this package imports nothing of the MCP SDK: only ``server`` (and ``main``'s
``serve_stdio``) does, so the CLI's playbook runner and a rank never load it.
"""

from __future__ import annotations

import json
import sys
from typing import Any

__all__ = ["serve_stdio", "client_config", "run_playbook"]


def serve_stdio(target: str | None, token: str | None = None) -> None:
    """Speak MCP on stdin/stdout for ``target`` until the client closes the pipe."""
    from .jobs import OneTarget
    from .server import build_server

    jobs = OneTarget(target, token)
    try:
        build_server(jobs).run("stdio")
    finally:
        jobs.close()


def client_config(target: str | None, token_env: str | None = None) -> dict[str, Any]:
    """What an MCP client's configuration needs: the stdio command for ``target`` (the token
    stays in the environment, named, never written), and the Jupyter server's HTTP endpoint."""
    import os

    args = ["mcp"] + (["-t", target] if target else [])
    server: dict[str, Any] = {"command": sys.executable, "args": ["-m", "kernel_probe.cli", *args]}
    env = {}
    if os.environ.get("PROBING_RUNTIME_DIR"):  # a client gives its server a bare environment: say where jobs are
        env["PROBING_RUNTIME_DIR"] = os.environ["PROBING_RUNTIME_DIR"]
    if token_env:
        env[token_env] = f"${{{token_env}}}"  # the client's own variable: the token is never written here
    if env:
        server["env"] = env
    return {
        "mcpServers": {"probing": server},
        "http": {
            "urls": _jupyter_urls() or ["http://<jupyter-host>:<port><base_url>probing/mcp"],
            "headers": {"Authorization": "token ${JUPYTER_TOKEN}"},
            "note": "the Jupyter server extension serves the same tools for every job that server knows, "
                    "behind the server's own authentication: pass its token in the Authorization header",
        },
    }


def _jupyter_urls() -> list[str]:
    """The MCP endpoints of the Jupyter servers running here (without their tokens)."""
    try:
        from jupyter_server.serverapp import list_running_servers
    except ImportError:
        return []
    try:
        return [s["url"].rstrip("/") + "/probing/mcp" for s in list_running_servers() if s.get("url")]
    except Exception:  # a stale or unreadable server file: no URL to offer
        return []


def format_config(target: str | None, token_env: str | None = None) -> str:
    return json.dumps(client_config(target, token_env), indent=2)


def run_playbook(name: str, target: str | None, token: str | None = None, job: str | None = None,
                 with_profile: bool = False, out: Any = None) -> int:
    """Run playbook ``name`` against ``target`` and print each step and its answer (0: every step
    answered, 1: a step failed)."""
    import asyncio

    from .jobs import OneTarget
    from .playbooks import RUNS_BY_DEFAULT, playbook, run
    from .tools import Toolbox

    out = out or sys.stdout
    book = playbook(name)
    jobs = OneTarget(target, token)
    tools = RUNS_BY_DEFAULT + (("profile",) if with_profile else ())

    async def go() -> int:
        failed = 0
        print(f"# {book.title}\n{book.description}\n", file=out, flush=True)
        async for i, step, answer in run(book, Toolbox(jobs), job, tools):
            print(f"## {i}. {step.say}", file=out)
            print(f"$ {step.tool} {json.dumps(step.args) if step.args else ''}".rstrip(), file=out)
            if answer is None:
                print(f"(skipped: run with --with-{step.tool} to include it)", file=out)
            else:
                failed += answer.error and not step.optional
                note = f" (this step may not apply: {step.optional})" if answer.error and step.optional else ""
                print(("error: " if answer.error else "") + answer.text + note, file=out)
            print(f"look for: {step.look_for}\n", file=out, flush=True)
        print(f"then answer: {book.goal}", file=out)
        return 1 if failed else 0

    try:
        return asyncio.run(go())
    finally:
        jobs.close()
