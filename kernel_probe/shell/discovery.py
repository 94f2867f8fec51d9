"""Discovery through the job's own TCPStore: no extra service.

torchrun hands every worker ``MASTER_ADDR``/``MASTER_PORT`` of the agent's store; a
client works without ``init_process_group``. A process that becomes a rank in
``init_process_group`` (mp.spawn, mpirun, srun) uses its process group's TCPStore. The probe keeps four keys there, all
under ``probing/``:

* ``MASTER_KEY``  -- the root's endpoint and incarnation (set by the root).
* ``LOCAL0_KEY``  -- each node's broker, elected with ``compare_set``.
* ``SECRET_KEY``  -- a per-job random secret when no auth token is configured.
* ``HOST_KEY``    -- each rank's host, when only the hosts can say which ranks share a
  node (ranks that became ranks in ``init_process_group``: mp.spawn, mpirun).

Where a client finds the root: the store a user knows is the rendezvous
store at ``--rdzv-endpoint`` (the c10d backend's TCPStore, hosted by one agent), not the
agent store at ``MASTER_PORT`` (measured with torch 2.13: two different TCPStores; the
workers' environment names only the agent store). So the root also publishes its
master record and the job's secret in the rendezvous store under the rendezvous id
(``probing/torchrun/<rdzv id>/r<restart>/...``); it learns the endpoint from its
agent's command line (``rendezvous_of_agent``).

Probes and clients talk to either store with ``PlainStore``: the TCPStore wire protocol
in plain Python (validate, check, get, set, compare_set), so neither ever imports torch
(~5 s and hundreds of MB here): a rank whose script never imported torch does not gain
torch's memory from its probe, and ``store://`` answers in milliseconds.

Facts this module is built around (measured on torch 2.13): ``get`` on a missing
key blocks until the store timeout, so every read does a non-blocking ``check`` first;
after a store error the client connection can stay broken for good, so any failure
rebuilds the client once and retries. Callers only ever see ``DiscoveryError`` with a
one-line message.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = [
    "DiscoveryError",
    "PlainStore",
    "StoreRefused",
    "rendezvous_of_agent",
    "agent_arguments",
    "LOCAL0_KEY",
    "MASTER_KEY",
    "SECRET_KEY",
    "HOST_KEY",
    "StoreDiscovery",
    "with_retries",
]

MASTER_KEY = "probing/torchrun/{run_id}/master"
LOCAL0_KEY = "probing/torchrun/{run_id}/node/{node}/local0"
SECRET_KEY = "probing/torchrun/{run_id}/secret"
HOST_KEY = "probing/torchrun/{run_id}/host/{rank}"  # each rank's host, where no launcher numbered the nodes

_PREFIX = "probing/"
_T = TypeVar("_T")


class DiscoveryError(Exception):
    """The store is unreachable, misbehaves, or holds garbage under one of our keys."""


class StoreRefused(DiscoveryError):
    """Nothing listens at the store's address: the agents that host it are gone."""


def _encode(value: Any) -> str:
    # Compact and key-sorted: the same dict always encodes to the same bytes, which
    # compare_set relies on when replacing a stale entry.
    return json.dumps(value, separators=(",", ":"), sort_keys=True)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def with_retries(attempt: Callable[[], _T], budget_sec: float, *, first_wait: float = 0.25, max_wait: float = 4.0,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 on_retry: Callable[[Exception, float], None] | None = None) -> _T:
    """``attempt()``, tried again after a growing wait (``first_wait`` doubling up to ``max_wait``)
    while ``budget_sec`` has not passed; the last failure is raised. One store call times out
    after a couple of seconds: on a loaded machine the store can be that slow for a moment,
    and a probe that gave up at once stayed out of the tree for the whole job."""
    give_up = clock() + budget_sec
    wait = first_wait
    while True:
        try:
            return attempt()
        except Exception as exc:
            if clock() + wait > give_up:
                raise
            if on_retry is not None:
                on_retry(exc, wait)
            sleep(wait)
            wait = min(wait * 2, max_wait)


class StoreDiscovery:
    """A TCPStore client restricted to the probe's ``probing/`` keys.

    Thread-safe: one lock serialises store calls, because a rebuild swaps the client.
    """

    def __init__(self, host: str, port: int, run_id: str, timeout_sec: float = 2.0) -> None:
        if timeout_sec <= 0:
            raise ValueError("timeout_sec must be positive")
        self.host = host
        self.port = int(port)
        self.run_id = run_id
        self.timeout_sec = float(timeout_sec)
        #: how many times the client has been rebuilt after an error (for logs/tests)
        self.rebuilds = 0
        self._lock = threading.Lock()
        self._closed = False
        self._store: PlainStore | None = self._connect()

    # -- connection -------------------------------------------------------------
    def _where(self) -> str:
        return f"TCPStore {self.host}:{self.port}"

    def _connect(self) -> PlainStore:
        return PlainStore(self.host, self.port, timeout_sec=self.timeout_sec)

    def _call(self, what: str, op: Callable[[PlainStore], _T]) -> _T:
        """Run ``op`` on the client; on failure rebuild the client once and retry."""
        with self._lock:
            if self._closed:
                raise DiscoveryError(f"{self._where()}: discovery client is closed")
            if self._store is not None:
                try:
                    return op(self._store)
                except Exception:
                    pass  # the connection may now be silently broken: rebuild below
            # Drop the old client before reconnecting so its socket is closed.
            self._store = None
            self.rebuilds += 1
            self._store = self._connect()
            try:
                return op(self._store)
            except Exception as exc:
                self._store = None  # do not reuse a client that just failed
                raise DiscoveryError(f"{self._where()}: {what} failed: {_one_line(exc)}") from None

    def _key(self, template: str, **kw: Any) -> str:
        key = template.format(run_id=self.run_id, **kw)
        # Guard against a run id or template ever escaping our namespace.
        if not key.startswith(_PREFIX):
            raise DiscoveryError(f"refusing to touch key outside {_PREFIX!r}: {key!r}")
        return key

    def _decode(self, key: str, raw: bytes | str) -> Any:
        try:
            text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
            return json.loads(text)
        except (UnicodeDecodeError, ValueError):
            raise DiscoveryError(
                f"{self._where()}: key {key!r} holds a non-JSON value"
            ) from None

    def _decode_dict(self, key: str, raw: bytes | str) -> dict:
        value = self._decode(key, raw)
        if not isinstance(value, dict):
            raise DiscoveryError(f"{self._where()}: key {key!r} holds {type(value).__name__}, not an object")
        return value

    def _read(self, key: str) -> dict | None:
        raw = self._call(f"read {key!r}", lambda store: store.get(key))
        return None if raw is None else self._decode_dict(key, raw)

    def _elect(self, key: str, desired: str) -> bytes:
        # compare_set with expected "" sets only an absent key and returns the value
        # that holds afterwards. It is idempotent for us: if a first attempt landed but
        # its reply was lost, the retry returns our own value and we still win.
        return self._call(f"compare_set {key!r}", lambda s: s.compare_set(key, "", desired))

    # -- public API -------------------------------------------------------------
    def publish_master(self, info: dict) -> None:
        """Publish the root's endpoint and incarnation (overwrites a previous one)."""
        key = self._key(MASTER_KEY)
        value = _encode(info)

        def op(store: PlainStore) -> bytes | None:
            # TCPStore's set is fire-and-forget: on a silently broken connection it
            # "succeeds". Reading back on the same connection (ordered after the set, so
            # it never blocks) makes a lost write an error, which triggers the rebuild.
            store.set(key, value)
            return store.get(key)

        raw = self._call(f"set {key!r}", op)
        if raw != value.encode():
            raise DiscoveryError(f"{self._where()}: {key!r} did not hold the published value")

    def read_master(self) -> dict | None:
        """The root's published info, or None when not (yet) published."""
        return self._read(self._key(MASTER_KEY))

    def elect_local0(self, node: int, info: dict, stale: dict | None = None) -> dict:
        """Try to become node ``node``'s broker; return the winner's info (``info`` if we won).

        ``stale``: a winner known to be dead; when it still holds the key, replace it
        with ``info`` (compare-and-swap, so only one rank replaces it).
        """
        key = self._key(LOCAL0_KEY, node=int(node))
        desired = _encode(info)
        if stale is None:
            raw = self._elect(key, desired)
        else:
            expected = _encode(stale)
            raw = self._call(
                f"compare_set {key!r}", lambda s: s.compare_set(key, expected, desired)
            )
            if raw == expected.encode():
                # torch answers ``expected`` when the key is absent: elect normally.
                raw = self._elect(key, desired)
        winner = self._decode_dict(key, raw)
        # Return the caller's own dict when we won, so identity checks work too.
        return info if _encode(winner) == desired else winner

    def read_local0(self, node: int) -> dict | None:
        """Node ``node``'s elected broker, or None when none was elected yet."""
        return self._read(self._key(LOCAL0_KEY, node=int(node)))

    def shared_secret(self, candidate: str) -> str:
        """Agree on one per-job secret: the first candidate stored wins everywhere.

        Stored as a JSON string like every other value.
        """
        if not isinstance(candidate, str) or not candidate:
            raise ValueError("candidate secret must be a non-empty string")
        key = self._key(SECRET_KEY)
        value = self._decode(key, self._elect(key, _encode(candidate)))
        if not isinstance(value, str) or not value:
            raise DiscoveryError(f"{self._where()}: key {key!r} does not hold a secret string")
        return value

    def read_secret(self) -> str | None:
        """The per-job secret if one was agreed on (a client never creates one)."""
        key = self._key(SECRET_KEY)

        raw = self._call(f"get {key!r}", lambda store: store.get(key))
        if raw is None:
            return None
        value = self._decode(key, raw)
        if not isinstance(value, str) or not value:
            raise DiscoveryError(f"{self._where()}: key {key!r} does not hold a secret string")
        return value

    def publish_host(self, rank: int, host: str) -> None:
        """Say which host rank ``rank`` runs on (read back by ``read_hosts``)."""
        key = self._key(HOST_KEY, rank=int(rank))
        self._call(f"set {key!r}", lambda store: store.set(key, _encode(host)))

    def read_hosts(self, world_size: int) -> dict[int, str] | None:
        """Every rank's host once all ``world_size`` ranks said it, else None."""
        keys = [self._key(HOST_KEY, rank=r) for r in range(world_size)]
        if not self._call("check host keys", lambda store: store.check(keys)):
            return None
        hosts = {}
        for rank, key in enumerate(keys):
            value = self._decode(key, self._call(f"get {key!r}", lambda store, k=key: store.get(k)))
            if not isinstance(value, str):
                raise DiscoveryError(f"{self._where()}: key {key!r} does not hold a host name")
            hosts[rank] = value
        return hosts

    def close(self) -> None:
        """Drop the client connection; later calls raise DiscoveryError."""
        with self._lock:
            self._closed = True
            store, self._store = self._store, None
        if store is not None:
            store.close()

    def __enter__(self) -> StoreDiscovery:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"StoreDiscovery({self.host!r}, {self.port}, run_id={self.run_id!r})"


# -- a TCPStore client without torch ---------------------------------------------------------

# torch/csrc/distributed/c10d/TCPStoreBackend.hpp (stable since torch 2.0): a query is
# one QueryType byte, then arguments; strings and byte vectors are a uint64 length
# (native byte order: little-endian everywhere torch runs) and the bytes. SET has no
# reply; COMPARE_SET replies with the value that holds afterwards (``expected`` itself
# when the key is absent and ``expected`` is not empty), as torch's own client sees it.
_VALIDATE, _SET, _COMPARE_SET, _GET, _CHECK = 0, 1, 2, 3, 5
_MAGIC = 0x3C85F7CE
_READY = 0
_MAX_VALUE = 1 << 20  # our values are a few hundred bytes
_KEY_PREFIX = "/"  # torch's TCPStore client puts this before every user key


def _key(value: str) -> bytes:
    return _bytes((_KEY_PREFIX + value).encode())


def _bytes(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def _data(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class PlainStore:
    """A TCPStore client in plain Python: ``check``, ``get``, ``set``, ``compare_set``.

    ``DiscoveryError`` (one line) when the store is not there or answers nonsense;
    ``StoreRefused`` when nothing listens: the job's agents are gone. Not thread-safe:
    ``StoreDiscovery`` serialises its calls.
    """

    def __init__(self, host: str, port: int, timeout_sec: float = 2.0) -> None:
        self.host, self.port, self.timeout_sec = host, int(port), float(timeout_sec)
        try:
            self._sock = socket.create_connection((host, self.port), timeout=self.timeout_sec)
        except OSError as exc:
            error = StoreRefused if isinstance(exc, ConnectionRefusedError) else DiscoveryError
            raise error(f"TCPStore {host}:{port} is not reachable: {_one_line(exc)}") from None
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._send(struct.pack("<BI", _VALIDATE, _MAGIC))

    def _send(self, data: bytes) -> None:
        try:
            self._sock.sendall(data)
        except OSError as exc:
            raise DiscoveryError(f"TCPStore {self.host}:{self.port}: {_one_line(exc)}") from None

    def _recv(self, n: int) -> bytes:
        out = bytearray()
        try:
            while len(out) < n:
                chunk = self._sock.recv(n - len(out))
                if not chunk:
                    raise DiscoveryError(f"TCPStore {self.host}:{self.port} closed the connection")
                out += chunk
        except OSError as exc:
            raise DiscoveryError(f"TCPStore {self.host}:{self.port}: {_one_line(exc)}") from None
        return bytes(out)

    def check(self, keys: str | list[str]) -> bool:
        """Are ``keys`` all set? (never blocks, unlike torch's ``get`` on a missing key)"""
        keys = [keys] if isinstance(keys, str) else list(keys)
        self._send(struct.pack("<BQ", _CHECK, len(keys)) + b"".join(_key(k) for k in keys))
        return self._recv(1)[0] == _READY

    def _value(self, what: str) -> bytes:
        (size,) = struct.unpack("<Q", self._recv(8))
        if size > _MAX_VALUE:
            raise DiscoveryError(f"TCPStore {self.host}:{self.port}: value of {what!r} is too large ({size} bytes)")
        return self._recv(size)

    def get(self, key: str) -> bytes | None:
        """The value of ``key``, or None when it is not set."""
        if not self.check(key):
            return None
        self._send(struct.pack("<B", _GET) + _key(key))
        return self._value(key)

    def set(self, key: str, value: str | bytes) -> None:
        """Set ``key`` (no reply comes: read it back to know it landed)."""
        self._send(struct.pack("<B", _SET) + _key(key) + _bytes(_data(value)))

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected`` (``""``: if it is absent);
        the value that holds afterwards."""
        self._send(struct.pack("<B", _COMPARE_SET) + _key(key) + _bytes(_data(expected)) + _bytes(_data(desired)))
        return self._value(key)

    def get_json(self, key: str) -> Any:
        raw = self.get(key)
        if raw is None:
            return None
        try:
            return json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            raise DiscoveryError(f"TCPStore {self.host}:{self.port}: key {key!r} holds a non-JSON value") from None

    def read_master(self, run_id: str) -> dict | None:
        value = self.get_json(MASTER_KEY.format(run_id=run_id))
        return value if isinstance(value, dict) else None

    def read_secret(self, run_id: str) -> str | None:
        value = self.get_json(SECRET_KEY.format(run_id=run_id))
        return value if isinstance(value, str) and value else None

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass

    def __enter__(self) -> PlainStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- the rendezvous endpoint as typed on the torchrun command line -------------------------

def _flag_value(argv: list[str], names: tuple[str, ...]) -> str | None:
    for i, arg in enumerate(argv):
        for name in names:
            if arg == name and i + 1 < len(argv):
                return argv[i + 1]
            if arg.startswith(name + "="):
                return arg[len(name) + 1:]
    return None


def agent_arguments(argv: list[str], environ: dict[str, str]) -> dict[str, str | None]:
    """What a torchrun agent was told about its rendezvous: ``endpoint``, ``backend``, ``id``
    (its command line first, then torchrun's ``PET_*`` variables, as torchrun reads them)."""
    def pick(flag: str, env: str) -> str | None:
        names = (f"--{flag}", f"--{flag.replace('-', '_')}")
        return _flag_value(argv, names) or environ.get(env) or None

    return {"endpoint": pick("rdzv-endpoint", "PET_RDZV_ENDPOINT"),
            "backend": pick("rdzv-backend", "PET_RDZV_BACKEND"),
            "id": pick("rdzv-id", "PET_RDZV_ID"),
            "standalone": "1" if ("--standalone" in argv or environ.get("PET_STANDALONE")) else None}


def rendezvous_of_agent(default_port: int = 29400) -> tuple[str, int, str] | None:
    """``(host, port, rdzv id)`` of this worker's torchrun agent (its nearest ancestor) as the
    user typed them (``--rdzv-endpoint``, ``--rdzv-id``), or None (no agent; static or
    standalone rendezvous: then the agent store is the only store)."""
    args = None
    try:
        import psutil

        # the agent is the parent, unless the worker runs under a wrapper (a shell, --no-python)
        for proc in psutil.Process().parents()[:3]:
            argv = proc.cmdline()
            if any("torch.distributed.run" in a or a.endswith("torchrun") or a.startswith("--rdzv") for a in argv):
                args = agent_arguments(argv, proc.environ())
                break
    except Exception:  # we may not look at it
        return None
    if args is None:
        return None
    if args["standalone"] or (args["backend"] or "static") != "c10d" or not args["endpoint"]:
        return None
    host, sep, port = args["endpoint"].strip().rpartition(":")
    if not sep:
        host, port = args["endpoint"].strip(), str(default_port)
    host = host.strip("[]")
    if not host or not port.isdigit():
        return None
    return host, int(port), args["id"] or "none"
