"""Separate hosts on one machine: Linux network namespaces joined by veth pairs to a
bridge, for tests that must cross a real network boundary (issue 10, "Three hosts").

    with Hosts(3) as net:                  # needs root and iproute2
        net.addr(0)                        # "192.0.2.1": host 0's address
        net.run(1, ["python", "-c", ...])  # a command on host 1
        net.cut(2); net.restore(2)         # pull and plug host 2's cable
        net.cut_between(1, 0)              # drop traffic between hosts 1 and 0 only

Layout: one "switch" namespace holding a bridge; one namespace per host with ``eth0``
(192.0.2.<i+1>/24, the documentation range: addresses exist only inside namespaces we
create) and ``lo``. Each veth pair is created directly inside its two namespaces, so
nothing is added to the machine's own namespace. ``cut(i)`` downs the switch's port of
host i: host i keeps its address (its own processes still reach each other) but
reaches nobody else. ``cut_between(i, j)`` adds blackhole routes for each other's
address on both hosts: only traffic between those two stops. ``close()`` deletes every
namespace (and with them the veths); namespaces left by a crashed earlier run (their
creator's pid is gone) are deleted on the next start.

``python -m tests.support.netns watch TARGET ...`` is the client the tests run
inside a namespace: it prints one JSON line per ``nodes()`` poll and per query.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from typing import Any

__all__ = ["Hosts", "NetnsError", "SUBNET"]

SUBNET = "192.0.2"  # TEST-NET-1 (RFC 5737): never routed, safe inside our namespaces
_PREFIX = "kpn"


class NetnsError(RuntimeError):
    """A namespace step failed (one line: the command and what ``ip`` said)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        said = (proc.stderr or proc.stdout).strip().splitlines()
        raise NetnsError(f"'ip {' '.join(args)}' failed: {said[0] if said else f'exit {proc.returncode}'}")
    return proc


def _existing() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def clean_stale() -> list[str]:
    """Delete namespaces of earlier runs whose creating process is gone; return their names."""
    removed = []
    for name in _existing():
        parts = name.split("-")
        if len(parts) >= 3 and parts[0] == _PREFIX and parts[1].isdigit() and not _pid_alive(int(parts[1])):
            _ip("netns", "del", name, check=False)
            removed.append(name)
    return removed


class Hosts:
    """``n`` hosts in network namespaces on one bridge. A context manager; ``close()`` is idempotent."""

    def __init__(self, n: int = 3) -> None:
        if not 1 <= n <= 250:
            raise ValueError("between 1 and 250 hosts")
        self.n = n
        tag = f"{_PREFIX}-{os.getpid()}-{int(time.time() * 1000) % 100000}"
        self.switch = f"{tag}-sw"
        self.names = [f"{tag}-h{i}" for i in range(n)]
        self._blackholes: set[tuple[int, int]] = set()
        self._created: list[str] = []

    # ------------------------------------------------------------------ set up
    def start(self) -> "Hosts":
        if os.geteuid() != 0:
            raise NetnsError("creating network namespaces needs root (run the tests as root)")
        clean_stale()
        try:
            self._add(self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for i, name in enumerate(self.names):
                self._add(name)
                _ip("link", "add", "eth0", "netns", name, "type", "veth", "peer", "name", f"p{i}", "netns", self.switch)
                _ip("-n", name, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
                _ip("-n", name, "link", "set", "eth0", "up")
                _ip("-n", self.switch, "link", "set", f"p{i}", "master", "br0")
                _ip("-n", self.switch, "link", "set", f"p{i}", "up")
        except BaseException:
            self.close()
            raise
        return self

    def _add(self, name: str) -> None:
        _ip("netns", "add", name)
        self._created.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    # ------------------------------------------------------------------ use
    def addr(self, i: int) -> str:
        """Host ``i``'s address."""
        return f"{SUBNET}.{i + 1}"

    def prefix(self, i: int) -> list[str]:
        """The command prefix that runs a program on host ``i``."""
        return ["ip", "netns", "exec", self.names[i]]

    def run(self, i: int, argv: list[str], **kw: Any) -> subprocess.CompletedProcess:
        return subprocess.run([*self.prefix(i), *argv], **kw)

    def popen(self, i: int, argv: list[str], **kw: Any) -> subprocess.Popen:
        return subprocess.Popen([*self.prefix(i), *argv], **kw)

    def cut(self, i: int) -> None:
        """Pull host ``i``'s cable: it reaches nobody and nobody reaches it."""
        _ip("-n", self.switch, "link", "set", f"p{i}", "down")

    def restore(self, i: int) -> None:
        _ip("-n", self.switch, "link", "set", f"p{i}", "up")

    def cut_between(self, i: int, j: int) -> None:
        """Drop traffic between hosts ``i`` and ``j`` only (both directions)."""
        for a, b in ((i, j), (j, i)):
            _ip("-n", self.names[a], "route", "add", "blackhole", f"{self.addr(b)}/32")
            self._blackholes.add((a, b))

    def heal_between(self, i: int, j: int) -> None:
        for a, b in ((i, j), (j, i)):
            if (a, b) in self._blackholes:
                _ip("-n", self.names[a], "route", "del", "blackhole", f"{self.addr(b)}/32", check=False)
                self._blackholes.discard((a, b))

    def close(self) -> None:
        """Delete every namespace this object created (their veths go with them)."""
        for name in reversed(self._created):
            _ip("netns", "del", name, check=False)
        self._created.clear()

    def exists(self) -> list[str]:
        """Which of our namespaces still exist (tests check that none is left)."""
        mine = {self.switch, *self.names}
        return [n for n in _existing() if n in mine]

    def __enter__(self) -> "Hosts":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------- the watching client

def _emit(record: dict) -> None:
    sys.stdout.write(json.dumps(record, default=str) + "\n")
    sys.stdout.flush()


def watch(target: str, poll: float, query_every: float, sql: str, query_timeout: float, seconds: float,
          wait: float = 0.0) -> int:
    """Connect (timed; retried for up to ``wait`` s while the job comes up), then poll ``nodes_raw`` every ``poll`` s and run ``sql`` every
    ``query_every`` s on another thread, one JSON line per event, for ``seconds`` s or
    until stdin closes."""
    import kernel_probe

    give_up = time.monotonic() + wait
    while True:
        t0 = time.monotonic()
        try:
            client = kernel_probe.connect(target or None, timeout=5)
            break
        except kernel_probe.ProbeError as exc:
            if time.monotonic() >= give_up:
                _emit({"kind": "error", "t": time.time(), "error": str(exc)})
                return 1
            time.sleep(0.2)
    _emit({"kind": "connected", "t": time.time(), "seconds": time.monotonic() - t0, "run_id": client.run_id,
           "endpoint": client.endpoint})
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    end = time.monotonic() + seconds

    def queries() -> None:
        while not stop.is_set() and time.monotonic() < end:
            started = time.time()
            try:
                r = client.query(sql, timeout=query_timeout)
                cov = r.coverage
                _emit({"kind": "query", "t": started, "elapsed": time.time() - started, "partial": cov["partial"],
                       "answered": cov["answered"], "failed": {str(k): v for k, v in cov["failed"].items()},
                       "targeted": cov["targeted"], "rows": len(r.df)})
            except kernel_probe.ProbeError as exc:
                _emit({"kind": "query_error", "t": started, "elapsed": time.time() - started, "error": str(exc)})
            stop.wait(max(0.0, query_every - (time.time() - started)))

    if query_every > 0:
        threading.Thread(target=queries, daemon=True).start()
    while not stop.is_set() and time.monotonic() < end:
        started = time.time()
        try:
            raw = client.nodes_raw(timeout=2)
            _emit({"kind": "nodes", "t": started, "epoch": raw["epoch"],
                   "members": [{k: m.get(k) for k in ("rank", "state", "incarnation", "host", "endpoint", "tier",
                                                       "pid", "reason")} for m in raw["members"]],
                   "departures": raw["departures"]})
        except kernel_probe.ProbeError as exc:
            _emit({"kind": "nodes_error", "t": started, "error": str(exc)})
        stop.wait(max(0.0, poll - (time.time() - started)))
    client.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.support.netns")
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("watch", help="poll a job and print JSON lines")
    w.add_argument("target")
    w.add_argument("--poll", type=float, default=0.1)
    w.add_argument("--query-every", type=float, default=0.0)
    w.add_argument("--sql", default="SELECT _rank, count(*) AS n FROM process GROUP BY _rank")
    w.add_argument("--query-timeout", type=float, default=2.0)
    w.add_argument("--seconds", type=float, default=600.0)
    w.add_argument("--wait", type=float, default=0.0, help="retry connecting this long")
    args = p.parse_args(argv)
    return watch(args.target, args.poll, args.query_every, args.sql, args.query_timeout, args.seconds, args.wait)


if __name__ == "__main__":
    sys.exit(main())
