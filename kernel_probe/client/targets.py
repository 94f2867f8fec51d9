"""Where a job's root is and which key signs our messages, from what a user typed.

Targets: ``tcp://host:port``; a connection-file path; ``store://host:port[/run_id]``
(the root's endpoint read from the job's TCPStore); nothing (the newest live
connection file on this machine). Resolving never talks to the probe itself; the
client's handshake does that. ``dump://DIR`` names an ended job's dumps: no endpoint
to resolve, ``dumps.open_dumps`` reads them; ``dump_spec`` is the one reader of the scheme.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .. import wire
from ..config import Settings, load_settings, run_id_from, split_run_id
from ..placement import curve_material, listening
from ..shell import connfile
from .alive import root_alive
from .errors import AuthError, BadTarget, ConnectError, JobEndedError


@dataclass(frozen=True)
class Target:
    """A resolved target: enough to open a connection to the root."""

    endpoint: str
    key: bytes
    run_id: str | None = None
    token: str | None = None  # kept in memory only, to re-derive the key for tcp:// targets
    connection: connfile.ConnectionInfo | None = None  # the job's connection file, when there is one
    spec: str | None = None  # what the user typed (None: the newest job here), to find a relaunch by
    store: str | None = None  # the job's store:// address, when known (for people to copy)
    curve: bytes | None = None  # the root's sockets are under CURVE: what its keys derive from
    curve_guessed: bool = False  # by the job's rule, not from the job: the handshake may try the other way


def find_token(token: str | None = None, token_env: str | None = None,
               settings: Settings | None = None) -> str | None:
    """The token a client signs with: ``token`` as given, else the environment variable
    named ``token_env`` (``ValueError`` when it is not set), else ``PROBING_AUTH_TOKEN``.
    None: no token anywhere (a connection file or the job's store may still give the key;
    a front end may ask its user)."""
    if token:
        return token
    if token_env is not None:
        value = os.environ.get(token_env)
        if not value:
            raise ValueError(f"the environment variable {token_env} is not set")
        return value
    return (settings or load_settings()).auth_token


DUMP_SCHEME = "dump://"
ADDRESS_SCHEMES = ("tcp://", "store://", DUMP_SCHEME)  # what a user types for a job not found here


def dump_spec(target: str | os.PathLike | None) -> str | None:
    """``dump://DIR[,DIR2]`` -> ``DIR[,DIR2]`` ("" for ``dump://`` alone: the newest run under
    PROBING_DUMP_DIR); None when ``target`` names a running job. The one reader of ``dump://``."""
    if isinstance(target, str) and target.strip().startswith(DUMP_SCHEME):
        return target.strip()[len(DUMP_SCHEME):]
    return None


def is_dump(target: str | os.PathLike | None) -> bool:
    """``dump://DIR``: an ended job's dumps, not a running job."""
    return dump_spec(target) is not None


def is_address(target: str) -> bool:
    """``tcp://``, ``store://`` or ``dump://``: a job a user adds by what it is reached at."""
    return target.strip().startswith(ADDRESS_SCHEMES)


def resolve(target: str | os.PathLike | None = None, token: str | None = None,
            settings: Settings | None = None) -> Target:
    """Turn what a user typed into an endpoint and a key; ``ConnectError``/``AuthError`` if it cannot."""
    settings = settings or load_settings()
    token = find_token(token, settings=settings)
    conn: connfile.ConnectionInfo | None = None
    run_id: str | None = None
    key: bytes | None = None
    curve: bytes | None | bool = None  # known material, or whether to derive it (None: the rule decides)
    target_s = os.fspath(target) if target is not None else None

    if is_dump(target_s):
        raise ConnectError(f"{target_s} is an ended job's dumps: open it with connect(), not a live connection")
    if target_s is None or target_s == "":
        conn = connfile.newest_alive(settings.runtime_dir)
        if conn is None:
            raise ConnectError(f"no running job found on this machine (no live connection file in "
                               f"{settings.runtime_dir}); start the job with PROBING=1 or pass a target")
        endpoint = conn.endpoint
    elif target_s.startswith("tcp://"):
        _host_port(target_s[len("tcp://"):], f"bad target {target_s!r}: expected tcp://host:port (a port of 1-65535)")
        endpoint = target_s
        here = next((c for c in connfile.list_files(settings.runtime_dir)
                     if c.endpoint == endpoint and root_alive(c)), None)
        if not token:  # a job on this machine: its connection file has the key
            conn = here
        elif here is not None:
            curve = bytes.fromhex(here.curve) if here.curve else False
    elif target_s.startswith("store://"):
        endpoint, run_id, key, curve = _from_store(target_s, token, settings.discover_timeout_sec)
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
        run_id, curve = conn.run_id, (bytes.fromhex(conn.curve) if conn.curve else False)
        key = bytes.fromhex(conn.key) if not token else wire.derive_key(token, conn.run_id)
    elif key is None:
        if not token:
            raise AuthError(f"no key for {endpoint}: pass token= (or set PROBING_AUTH_TOKEN), or use a "
                            f"connection file / store:// target")
        key = wire.derive_key(token, run_id or "")
    store = target_s if target_s and target_s.startswith("store://") else (conn.store if conn else None)
    guessed = curve is None and settings.curve is None
    if curve is None:  # a tcp:// target off this machine: the job's own rule, from here
        curve = listening(settings, dialled=endpoint_host(endpoint)).curve
    if curve is True:
        curve = curve_material(token, key)
    return Target(endpoint, key, run_id=run_id, token=token, connection=conn, spec=target_s or None,
                  store=store or None, curve=curve or None, curve_guessed=guessed)


def endpoint_host(endpoint: str) -> str:
    """``tcp://host:port`` -> host."""
    return endpoint[len("tcp://"):].rpartition(":")[0] if endpoint.startswith("tcp://") else endpoint


def parse_store(target: str) -> tuple[str, int, str]:
    """``store://host:port[/run]`` -> (host, port, run); ``ConnectError`` when malformed."""
    hostport, _, run = target[len("store://"):].partition("/")
    host, port = _host_port(hostport, f"bad store target {target!r}: expected store://host:port[/run_id]")
    return host, port, run.strip("/")


def _host_port(hostport: str, error: str) -> tuple[str, int]:
    """'host:port' ('[::1]:port' too) -> (host, port); ``BadTarget(error)`` without a host or a port."""
    host, _, port_s = hostport.rpartition(":")
    host = host.strip("[]")
    if not host or not port_s.isdigit() or not 0 < int(port_s) < 65536:
        raise BadTarget(error)
    return host, int(port_s)


def _from_store(target: str, token: str | None, timeout: float) -> tuple[str, str, bytes, bool]:
    """Read the root's record from the store a user named: the rendezvous store at
    ``--rdzv-endpoint`` (run = ``--rdzv-id``) or the agent store at ``MASTER_PORT``.
    Plain-Python reads (no torch import): a few milliseconds."""
    from ..shell.discovery import DiscoveryError, PlainStore, StoreRefused

    host, port, run = parse_store(target)
    hostport = f"{host}:{port}"
    if run and split_run_id(run)[1] is not None:
        bases, fixed = [split_run_id(run)[0]], run
    else:
        # the rendezvous id as typed ("none" when torchrun got no --rdzv-id), or, for the
        # agent store, the run id torchrun derives from MASTER_ADDR:MASTER_PORT
        default = run_id_from({"TORCHELASTIC_RUN_ID": run, "MASTER_ADDR": host,
                               "MASTER_PORT": str(port)})
        default = split_run_id(default)[0]
        bases, fixed = ([default] if run else [default, "none"]), None
    try:
        reader = PlainStore(host, port, timeout_sec=min(timeout, 2.0))
    except DiscoveryError as exc:
        if isinstance(exc, StoreRefused):  # the agents hosting the store are gone: so is the job
            raise JobEndedError(f"the job's store at {hostport} is gone: the job ended (or is not started yet)") from None
        raise ConnectError(f"cannot reach the job's store: {exc}") from None
    try:
        found: tuple[dict, str] | None = None
        for base in bases:
            candidates = [fixed] if fixed else [f"{base}/r{i}" for i in range(64)]
            for store_run in candidates:  # r0, r1, ...: the newest restart of the job wins
                master = reader.read_master(store_run)
                if master is None:
                    break
                found = master, store_run
            if found:
                break
        if found is None:
            raise ConnectError(f"no probing root registered in the store at {hostport} for run "
                               f"{run or '(default)'}: is the job running with PROBING=1 (and is this its "
                               f"--rdzv-endpoint and --rdzv-id)?")
        master, store_run = found
        run_id = str(master.get("run_id") or store_run)  # the rendezvous store's record names the run id
        if token:
            key = wire.derive_key(token, run_id)
        else:
            secret = reader.read_secret(store_run)
            if secret is None:
                raise AuthError(f"the job in the store at {hostport} publishes no secret: pass its token")
            key = wire.derive_key(secret, run_id)
        endpoint = master.get("endpoint")
        if not isinstance(endpoint, str) or not endpoint.startswith("tcp://"):
            raise ConnectError(f"the store at {hostport} holds a bad root record for run {store_run}")
        return endpoint, run_id, key, master.get("curve") is True
    except DiscoveryError as exc:
        raise ConnectError(f"cannot read the job's store: {exc}") from None
    finally:
        reader.close()
