"""Talk to a running job from another process: the notebook kernel, the Jupyter server,
the CLI. ``connect(target)`` resolves where the root is and which key signs our
messages; ``Client`` sends requests over one DEALER and turns every failure into a
one-line ``ProbeError`` (never a traceback from zmq or torch).

Targets: ``tcp://host:port``; a connection-file path; ``store://host:port[/run_id]``
(the root's endpoint read from the job's TCPStore); nothing (the newest live
connection file on this machine).
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

import zmq

from . import wire
from .config import load_settings, run_id_from
from .shell import connfile

if TYPE_CHECKING:  # pandas is imported only when a DataFrame is asked for
    import pandas as pd

NODE_COLUMNS = [
    "rank", "world_size", "local_rank", "local_world_size", "node", "node_count", "host", "endpoint",
    "pid", "role", "incarnation", "state", "last_seen", "since", "step", "step_time_ms", "tier", "reason",
]
DEPARTURE_COLUMNS = ["rank", "incarnation", "host", "pid", "when", "why"]


class ProbeError(Exception):
    """Base of every error a client raises; its message is one line meant for a person."""


class ConnectError(ProbeError):
    """No job there: nothing found, nothing answering."""


class JobEndedError(ConnectError):
    """The job's root process is gone."""


class AuthError(ProbeError):
    """The probe refused our credentials."""


def connect(target: str | os.PathLike | None = None, token: str | None = None, timeout: float = 5.0) -> "Client":
    """A client of the job at ``target`` (see the module docstring), checked with a handshake."""
    settings = load_settings()
    token = token or settings.auth_token
    conn: connfile.ConnectionInfo | None = None
    run_id: str | None = None
    key: bytes | None = None
    target_s = os.fspath(target) if target is not None else None

    if target_s is None or target_s == "":
        conn = connfile.newest_alive(settings.runtime_dir)
        if conn is None:
            raise ConnectError(f"no running job found on this machine (no live connection file in "
                               f"{settings.runtime_dir}); start the job with PROBING=1 or pass a target")
        endpoint = conn.endpoint
    elif target_s.startswith("tcp://"):
        endpoint = target_s
        if not token:  # a job on this machine: its connection file has the key
            conn = next((c for c in connfile.list_files(settings.runtime_dir)
                         if c.endpoint == endpoint and connfile.is_alive(c)), None)
    elif target_s.startswith("store://"):
        endpoint, run_id, key = _from_store(target_s, token, settings.discover_timeout_sec)
    else:
        path = Path(target_s).expanduser()
        if not path.exists():
            raise ConnectError(f"unknown target {target_s!r}: expected tcp://host:port, store://host:port[/run_id], "
                               f"or a connection file")
        try:
            conn = connfile.read(path)
        except ValueError as exc:
            raise ConnectError(str(exc)) from None
        endpoint = conn.endpoint

    if conn is not None:
        run_id = conn.run_id
        key = bytes.fromhex(conn.key) if not token else wire.derive_key(token, conn.run_id)
    elif key is None:
        if not token:
            raise AuthError(f"no key for {endpoint}: pass token= (or set PROBING_AUTH_TOKEN), or use a "
                            f"connection file / store:// target")
        key = wire.derive_key(token, run_id or "")
    client = Client(endpoint, key, run_id=run_id, token=token, connection=conn)
    try:
        client.handshake(timeout)
    except BaseException:
        client.close()
        raise
    return client


def _from_store(target: str, token: str | None, timeout: float) -> tuple[str, str, bytes]:
    rest = target[len("store://"):]
    hostport, _, run = rest.partition("/")
    host, _, port_s = hostport.rpartition(":")
    if not host or not port_s.isdigit():
        raise ConnectError(f"bad store target {target!r}: expected store://host:port[/run_id]")
    from .shell.discovery import DiscoveryError, StoreDiscovery

    if run and "/r" in run:
        candidates = [run]
    else:
        base = run_id_from({"TORCHELASTIC_RUN_ID": run, "MASTER_ADDR": host, "MASTER_PORT": port_s}).rsplit("/r", 1)[0]
        candidates = [f"{base}/r{i}" for i in range(32)]
    try:
        disc = StoreDiscovery(host, int(port_s), candidates[0], timeout_sec=timeout)
    except DiscoveryError as exc:
        raise ConnectError(f"cannot reach the job's store: {exc}") from None
    try:
        master = None
        for run_id in candidates:  # r0, r1, ...: the newest restart of the job wins
            disc.run_id = run_id
            found = disc.read_master()
            if found is None:
                break
            master, newest = found, run_id
        if master is None:
            raise ConnectError(f"no probing root registered in the store at {hostport} for run "
                               f"{run or '(default)'}: is the job running with PROBING=1?")
        disc.run_id = newest
        if token:
            key = wire.derive_key(token, newest)
        else:
            secret = disc.read_secret()
            if secret is None:
                raise AuthError(f"the job in the store at {hostport} publishes no secret: pass its token")
            key = wire.derive_key(secret, newest)
        return master["endpoint"], newest, key
    except DiscoveryError as exc:
        raise ConnectError(f"cannot read the job's store: {exc}") from None
    finally:
        disc.close()


class Client:
    """One connection to a probe (normally the root). Thread-safe: one request at a time."""

    def __init__(self, endpoint: str, key: bytes, *, run_id: str | None = None, token: str | None = None,
                 connection: connfile.ConnectionInfo | None = None) -> None:
        self.endpoint = endpoint
        self.run_id = run_id
        self.connection = connection
        self.info_: dict[str, Any] = {}
        self._token = token
        self._lock = threading.Lock()
        self._ctx = zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._codec = self._new_codec(key)

    def _new_codec(self, key: bytes) -> wire.Codec:
        return wire.Codec(key, sender=f"client-{os.getpid()}", incarnation=uuid.uuid4().hex[:16])

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, wire.Limits().max_message_bytes)
            sock.setsockopt(zmq.RECONNECT_IVL, 100)
            sock.connect(self.endpoint)
            self._sock = sock
        return self._sock

    def _reset_socket(self) -> None:
        # after a timeout a late answer could still arrive: never mistake it for the next one
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None

    def request(self, type_: str, body: dict, timeout: float = 5.0,
                on_progress: Callable[[dict], None] | None = None) -> wire.Envelope:
        with self._lock:
            return self._request(type_, body, timeout, on_progress)

    def _request(self, type_: str, body: dict, timeout: float,
                 on_progress: Callable[[dict], None] | None = None) -> wire.Envelope:
        sock = self._socket()
        msg = wire.Message(type_, body, msg_id=uuid.uuid4().hex)
        sock.send_multipart(self._codec.encode(msg))
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(int(left * 1000) + 1):
                if time.monotonic() >= deadline:
                    self._reset_socket()
                    raise self._no_answer(timeout)
                continue
            frames = sock.recv_multipart()
            refusal = wire.parse_refusal(frames)
            if refusal is not None:
                raise _Refused(*refusal)
            try:
                env = self._codec.decode(frames)
            except wire.WireError:
                continue  # not for us, or forged: keep waiting for the real answer
            if env.msg.corr_id != msg.msg_id:
                continue
            if env.msg.type == "query_progress":
                if on_progress is not None:
                    on_progress(env.msg.body)
                continue
            if env.msg.type == "error":
                raise ProbeError(f"{env.msg.body.get('code')}: {env.msg.body.get('message')}")
            return env

    def _no_answer(self, timeout: float) -> ConnectError:
        conn = self.connection
        if conn is not None and not connfile.is_alive(conn):
            return JobEndedError(f"job {conn.run_id} has ended: its root (pid {conn.pid}) is gone")
        return ConnectError(f"no answer from {self.endpoint} within {timeout:g} s: the job ended or its root "
                            f"is unreachable")

    def handshake(self, timeout: float = 5.0) -> dict:
        """Check that a probe answers and accepts our key; learn the run id on the way."""
        try:
            env = self.request("info_request", {}, timeout)
        except _Refused as refused:
            if refused.run_id and self._token and refused.run_id != self.run_id:
                # tcp:// with a token: the refusal names the job, whose key we can now derive
                self.run_id = refused.run_id
                self._codec = self._new_codec(wire.derive_key(self._token, refused.run_id))
                return self.handshake(timeout)
            raise AuthError(f"the probe at {self.endpoint} refused our credentials ({refused.reason}): "
                            f"wrong or missing PROBING_AUTH_TOKEN?") from None
        info = env.msg.body
        if info.get("protocol") != wire.PROTOCOL_VERSION:
            raise ProbeError(f"the probe at {self.endpoint} speaks protocol {info.get('protocol')}, "
                             f"this client {wire.PROTOCOL_VERSION}: upgrade probing-magics on one side")
        self.info_ = info
        self.run_id = info.get("run_id", self.run_id)
        return info

    def info(self, timeout: float = 5.0) -> dict:
        """The answering probe's run id, world size, rank, tier, pid and member counts."""
        self.info_ = self._call("info_request", {}, timeout).msg.body
        return self.info_

    def _call(self, type_: str, body: dict, timeout: float) -> wire.Envelope:
        try:
            return self.request(type_, body, timeout)
        except _Refused as refused:
            raise AuthError(f"the probe at {self.endpoint} refused our credentials ({refused.reason})") from None

    def query(self, sql: str, timeout: float = 10.0, strict: bool = False, per_rank: bool = False,
              ranks: Iterable[int] | None = None, params: Mapping[str, Any] | None = None, *,
              local: bool = False, explain: bool = False,
              on_progress: Callable[[dict], None] | None = None) -> "QueryResult":
        """Run one read-only SELECT over the job (DESIGN section 5).

        ``ranks`` restricts the ranks asked; ``params`` bind as ``$name``; ``local`` asks
        only the probe connected to; ``explain`` returns the plan without running it.
        Partial answers are allowed unless ``strict``; ``coverage`` says who answered.
        """
        body: dict[str, Any] = {"sql": sql, "timeout": float(timeout), "per_rank": per_rank, "local": local,
                                "explain": explain, "ranks": None if ranks is None else [int(r) for r in ranks],
                                "params": dict(params) if params else None}
        try:
            env = self.request("query", body, timeout + ANSWER_GRACE, on_progress)
        except _Refused as refused:
            raise AuthError(f"the probe at {self.endpoint} refused our credentials ({refused.reason})") from None
        except ValueError as exc:  # params that JSON cannot carry
            raise QueryFailed(f"cannot send the query: {exc}", code="bad_params") from None
        reply = env.msg.body
        coverage = reply.get("coverage") or {}
        if reply.get("status") != "ok":
            err = reply.get("error") or {}
            raise QueryFailed(_error_line(err), code=err.get("code", "error"), line=err.get("line"),
                              col=err.get("col"), coverage=coverage)
        if explain:
            return QueryResult(None, coverage, explain=reply.get("explain", ""))
        if not env.msg.buffers:
            raise QueryFailed("the probe answered without a result", coverage=coverage)
        table = wire.ipc_to_table(env.msg.buffers[0])
        if strict and coverage.get("partial"):
            raise QueryFailed(f"partial answer refused (strict): {describe_failures(coverage)}", code="partial",
                              coverage=coverage)
        return QueryResult(table, coverage, explain=coverage.get("explain", ""))

    def nodes_raw(self, timeout: float = 5.0) -> dict:
        return self._call("nodes_request", {}, timeout).msg.body

    def nodes(self, timeout: float = 5.0) -> "pd.DataFrame":
        """One row per rank: the membership as the root sees it (DESIGN section 3 columns)."""
        return members_frame(self.nodes_raw(timeout)["members"])

    def departures(self, timeout: float = 5.0) -> "pd.DataFrame":
        """Ranks that died or left: rank, incarnation, host, pid, when, why."""
        import pandas as pd

        rows = self.nodes_raw(timeout)["departures"]
        df = pd.DataFrame(rows, columns=DEPARTURE_COLUMNS)
        df["when"] = pd.to_datetime(df["when"], unit="s", utc=True)
        return df

    def close(self) -> None:
        self._reset_socket()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<kernel_probe.Client {self.endpoint} run={self.run_id}>"


def members_frame(members: list[dict]) -> "pd.DataFrame":
    import pandas as pd

    df = pd.DataFrame(members, columns=NODE_COLUMNS)
    for col in ("last_seen", "since"):
        df[col] = pd.to_datetime(df[col], unit="s", utc=True)
    df["step"] = df["step"].astype("Int64")
    df["step_time_ms"] = pd.to_numeric(df["step_time_ms"], errors="coerce").astype("float64")
    return df


ANSWER_GRACE = 3.0  # the root answers by the deadline; allow for transfer and a slow client


class QueryFailed(ProbeError):
    """The query was refused or failed; ``code``, ``line``/``col`` where known, and coverage."""

    def __init__(self, message: str, *, code: str = "error", line: int | None = None, col: int | None = None,
                 coverage: dict | None = None) -> None:
        super().__init__(message)
        self.code, self.line, self.col, self.coverage = code, line, col, coverage or {}


def _error_line(err: dict) -> str:
    message = str(err.get("message") or err.get("code") or "query failed").splitlines()[0]
    if err.get("line") is not None and "line" not in message:
        message += f" (line {err['line']}" + (f", column {err['col']})" if err.get("col") is not None else ")")
    return message


def describe_failures(coverage: dict) -> str:
    failed = coverage.get("failed") or {}
    shown = ", ".join(f"rank {r} ({why})" for r, why in list(failed.items())[:8])
    more = f" and {len(failed) - 8} more" if len(failed) > 8 else ""
    return f"{len(failed)} of {len(coverage.get('targeted') or [])} ranks failed: {shown}{more}"


class QueryResult:
    """``df`` (pandas, coverage also in ``df.attrs``), ``table`` (Arrow), ``coverage``."""

    def __init__(self, table: Any, coverage: dict, explain: str = "") -> None:
        self.table = table
        self.coverage = coverage
        self.explain = explain
        self._df = None

    @property
    def df(self) -> "pd.DataFrame":
        if self._df is None and self.table is not None:
            self._df = self.table.to_pandas()
            self._df.attrs["coverage"] = self.coverage
        return self._df

    @property
    def plan(self) -> str:
        return self.coverage.get("plan", "")

    def footer(self) -> str:
        """One line: '8/8 ranks · 12 ms · partial-aggregate' (and what failed)."""
        c = self.coverage
        text = f"{len(c.get('answered', []))}/{len(c.get('targeted', []))} ranks · {c.get('elapsed_ms', 0):.0f} ms · {self.plan}"
        if c.get("pruned"):
            text += f" · {len(c['pruned'])} pruned"
        if c.get("partial"):
            text += f" · PARTIAL: {describe_failures(c)}"
        return text

    def __repr__(self) -> str:
        return f"<QueryResult {0 if self.table is None else self.table.num_rows} rows · {self.footer()}>"


class _Refused(Exception):
    def __init__(self, reason: str, run_id: str) -> None:
        super().__init__(reason)
        self.reason, self.run_id = reason, run_id
