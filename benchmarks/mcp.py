"""What the MCP layer costs: a tool call against the same call through ``kernel_probe``'s own
``Client`` (the difference is the protocol's cost: JSON-RPC framing, the SDK, the text and
structured rendering), and the MCP server's memory while idle.

A 2 x 2 plain job of idle ranks. Interleaved rounds, p50 and p90 of each, in ms:

- ``Client.query`` / ``Client.nodes_raw`` in this process (warm client, the baseline);
- the same through ``kernel-probe mcp`` over stdio (the SDK's ``Client``, a child process);
- the same through the server in this process (the SDK's in-memory transport: no pipe, no
  second process; the server's own rendering and dispatch);
- the same over Streamable HTTP at ``/probing/mcp`` of a real Jupyter server (its token in
  the header), the REST route ``POST probing/api/jobs/<id>/query`` beside it.

Memory: the resident set (VmRSS, VmHWM) of the ``kernel-probe mcp`` process after start-up,
after listing the tools, and idle after the calls; and the Jupyter server's before its first
MCP request and idle after the calls (what serving MCP adds to it).

    .venv/bin/python benchmarks/mcp.py [--rounds 30]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
# this file's own name is the SDK's: its directory must not shadow the `mcp` package
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(ROOT))

import anyio  # noqa: E402

import kernel_probe  # noqa: E402
from tests.support.harness import LocalJob  # noqa: E402

WORKER = str(ROOT / "tests" / "workers" / "worker.py")
SQL = "SELECT _rank, count(*) AS frames FROM stacks WHERE is_main GROUP BY _rank ORDER BY _rank"


def _rss(pid: int) -> dict[str, float]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) / 1024  # MiB
    return out


def _server_pid() -> int:
    import psutil

    for child in psutil.Process().children(recursive=True):
        if "kernel_probe.cli" in " ".join(child.cmdline()):
            return child.pid
    raise SystemExit("the kernel-probe mcp process was not found")


TOKEN = "bench-token"


def _jupyter(runtime: str) -> tuple[subprocess.Popen, str]:
    import httpx2

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    home = tempfile.mkdtemp(prefix="kp-mcp-bench-jupyter-")
    env = {**os.environ, "PROBING_RUNTIME_DIR": runtime, "PYTHONPATH": str(ROOT),
           "JUPYTER_RUNTIME_DIR": f"{home}/runtime", "JUPYTER_CONFIG_DIR": f"{home}/config"}
    proc = subprocess.Popen([sys.executable, "-m", "jupyter_server", "--allow-root", "--no-browser", f"--port={port}",
                             "--ServerApp.ip=127.0.0.1", f"--IdentityProvider.token={TOKEN}",
                             "--ServerApp.jpserver_extensions={'probing_magics': True}", f"--notebook-dir={home}"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            if httpx2.get(f"{base}/probing/api/jobs", headers={"Authorization": f"token {TOKEN}"},
                          timeout=5).json()["jobs"]:
                return proc, base
        except Exception:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the Jupyter server did not come up")


def _p(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))]


async def measure(runtime: str, rounds: int, jupyter: subprocess.Popen,
                  base: str) -> tuple[dict[str, list[float]], dict[str, dict]]:
    import httpx2
    from mcp import Client, StdioServerParameters
    from mcp.client.streamable_http import streamable_http_client

    from kernel_probe.mcp.jobs import OneTarget
    from kernel_probe.mcp.server import build_server

    direct = kernel_probe.connect(timeout=5)
    params = StdioServerParameters(command=sys.executable, args=["-m", "kernel_probe.cli", "mcp"],
                                   env={"PROBING_RUNTIME_DIR": runtime, "PYTHONPATH": str(ROOT)})
    times: dict[str, list[float]] = {}
    memory: dict[str, dict] = {}
    inproc_jobs = OneTarget(None)
    memory["jupyter: before MCP"] = _rss(jupyter.pid)
    http = httpx2.AsyncClient(headers={"Authorization": f"token {TOKEN}"}, timeout=60)
    job_id = (await http.get(f"{base}/probing/api/jobs")).json()["jobs"][0]["id"]

    async def rest(path: str, body: dict | None = None) -> None:
        url = f"{base}/probing/api/jobs/{job_id}/{path}"
        answer = await (http.post(url, json=body) if body is not None else http.get(url))
        answer.raise_for_status()

    async with Client(params) as stdio, Client(build_server(inproc_jobs)) as inproc, \
            Client(streamable_http_client(f"{base}/probing/mcp", http_client=http)) as over_http:
        pid = _server_pid()
        memory["stdio: started"] = _rss(pid)
        await stdio.list_tools()
        memory["stdio: tools listed"] = _rss(pid)

        async def via(client, tool: str, args: dict) -> None:
            result = await client.call_tool(tool, args)
            if result.is_error:
                raise SystemExit(f"{tool}: {result.content[0].text}")

        cases = {
            "sql: Client.query": lambda: anyio.to_thread.run_sync(lambda: direct.query(SQL, timeout=10)),
            "sql: MCP stdio": lambda: via(stdio, "sql", {"query": SQL}),
            "sql: MCP in-process": lambda: via(inproc, "sql", {"query": SQL}),
            "sql: REST (Jupyter)": lambda: rest("query", {"sql": SQL}),
            "sql: MCP HTTP (Jupyter)": lambda: via(over_http, "sql", {"query": SQL}),
            "nodes: Client.nodes_raw": lambda: anyio.to_thread.run_sync(lambda: direct.nodes_raw(5)),
            "nodes: MCP stdio": lambda: via(stdio, "nodes", {}),
            "nodes: MCP in-process": lambda: via(inproc, "nodes", {}),
            "nodes: REST (Jupyter)": lambda: rest("nodes"),
            "nodes: MCP HTTP (Jupyter)": lambda: via(over_http, "nodes", {}),
        }
        for fn in cases.values():  # warm every path once (imports, connections, engines)
            await fn()
        for _ in range(rounds):
            for name, fn in cases.items():  # interleaved: drift on a shared machine hits every case alike
                t0 = time.perf_counter()
                await fn()
                times.setdefault(name, []).append((time.perf_counter() - t0) * 1000)
        await anyio.sleep(2.0)
        memory["stdio: idle after calls"] = _rss(pid)
        memory["jupyter: idle after calls"] = _rss(jupyter.pid)
    await http.aclose()
    direct.close()
    inproc_jobs.close()
    return times, memory


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()
    runtime = tempfile.mkdtemp(prefix="kp-mcp-bench-")
    os.environ["PROBING_RUNTIME_DIR"] = runtime
    job = LocalJob([WORKER], nodes=2, ranks_per_node=2, mode="plain", env={"PROBING": "1", "PROBING_RUNTIME_DIR": runtime})
    with job:
        job.wait_ready(60)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with kernel_probe.connect(timeout=2) as c:
                    if len(c.query(SQL, timeout=10).coverage["answered"]) == 4:
                        break
            except kernel_probe.ProbeError:
                pass
            time.sleep(0.2)
        jupyter, base = _jupyter(runtime)
        try:
            times, memory = anyio.run(measure, runtime, args.rounds, jupyter, base)
        finally:
            jupyter.terminate()
            jupyter.wait(15)
    print(f"tool call latency on a 2x2 job, {args.rounds} interleaved rounds, ms (p50 / p90):")
    for tool in ("sql", "nodes"):
        base = statistics.median(times[f"{tool}: {'Client.query' if tool == 'sql' else 'Client.nodes_raw'}"])
        for name, values in times.items():
            if name.startswith(tool + ":"):
                p50 = statistics.median(values)
                print(f"  {name:28} {p50:7.2f} / {_p(values, 0.9):7.2f}   "
                      f"(+{p50 - base:.2f} ms, x{p50 / base:.2f} the direct call)")
    print("resident memory of the kernel-probe mcp process (stdio) and of the Jupyter server, MiB (VmRSS, peak VmHWM):")
    for when, m in memory.items():
        print(f"  {when:26} {m['VmRSS']:6.1f}  (peak {m['VmHWM']:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
