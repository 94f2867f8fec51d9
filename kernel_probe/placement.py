"""Sans-IO: where a rank sits in the tree, decided through the job's store, which key
signs its messages, and where it listens and whether it encrypts (``listening``: the one
rule, read by the rank's shell and by a client guessing how a job it dials listens).

Rules of this file:
- No store, socket or clock: the store's answers come in as inputs
  (``on_store_result``), store steps go out as ``StoreOp`` effects, decisions as
  ``Place``; the rank core applies them. The real shell runs the steps against the
  job's TCPStore (``shell/discovery.py``), the simulator against a dictionary.
- The election: global rank 0 is the root (it publishes
  itself); each node's broker is whoever wins ``compare_set`` on the node's key. Local
  rank 0 runs at once; any other rank first reads, and runs itself only after
  ``discover_timeout`` without a winner (with ``--virtual-local-rank`` every worker has
  local rank 0, so the first to arrive wins). A broker serves its leaves before it
  knows the root; a leaf reports to its broker, and learns the root for re-parenting.
- Brokers of brokers (``tree_parent``): past ``fanout`` nodes, a node's broker reports to
  the broker of another node, chosen from the node indices alone (which every rank
  agrees on: torchrun's GROUP_RANK / GROUP_WORLD_SIZE, or the hosts' order), so every
  rank draws the same tree without asking anyone. That broker is found through the
  same store key as any node's broker; one not there within ``discover_timeout`` is
  waited for at the root (the rank core moves back when it appears).
- Failover (``failover_path``): a rank whose parent is lost goes to the next usable broker
  up its path (grandparent, then great-grandparent, ..., the root last), so a lost broker's
  subtree lands one level up, not on the root; its endpoint comes with the membership
  pushed down (each child is pushed the brokers of the nodes above it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from .config import Identity, Settings
from .effects import Note, StoreOp
from .wire import derive_key

T = TypeVar("T")

RETRY_SEC = 0.05  # a key that is not there yet is read again this soon
ERROR_RETRY_SEC = 1.0  # after a store error


def _tree_walk(node: int, node_count: int, fanout: int) -> tuple[list[int], tuple[int, int]]:
    """The heads above ``node`` (node 0, the root's, first) and the range of nodes its own
    subtree spans.

    The nodes form one tree in which every subtree is a run of consecutive node indices
    (a rack, when racks are numbered in order) headed by its first node: the head of
    ``[lo, hi)`` splits the rest, ``[lo + 1, hi)``, into at most ``fanout`` runs of
    sizes that differ by at most one, each a subtree. So no broker has more than
    ``fanout`` brokers below it, and the tree is as shallow as that allows: with
    ``node_count <= fanout + 1`` every node reports to the root, as in a two-level tree.
    """
    if fanout < 1:
        raise ValueError(f"fanout must be >= 1, got {fanout!r}")
    if not 0 <= node < node_count:  # a node outside the job's count (misconfigured): straight to the root
        return ([0] if node else []), (node, node + 1)
    lo, hi = 0, node_count
    heads: list[int] = []
    while node != lo:
        heads.append(lo)
        first, size = lo + 1, hi - lo - 1
        parts = min(fanout, size)
        small, extra = divmod(size, parts)  # the first ``extra`` runs hold one node more
        off = node - first
        if off < extra * (small + 1):
            lo = first + (off // (small + 1)) * (small + 1)
            hi = lo + small + 1
        else:
            rest = off - extra * (small + 1)
            lo = first + extra * (small + 1) + (rest // small) * small
            hi = lo + small
    return heads, (lo, hi)


def tree_parent(node: int, node_count: int, fanout: int) -> int | None:
    """The node whose broker ``node``'s broker reports to; None: the root (node 0's head)."""
    heads, _ = _tree_walk(node, node_count, fanout)
    return heads[-1] if heads and heads[-1] != 0 else None


def tree_depth(node: int, node_count: int, fanout: int) -> int:
    """The level of ``node``'s broker below the root: 1 for a node that reports to the root
    (0 for node 0, the root's own)."""
    return len(_tree_walk(node, node_count, fanout)[0])


def subtree(node: int, node_count: int, fanout: int) -> range:
    """The nodes whose members ``node``'s broker holds: its own and those below it."""
    lo, hi = _tree_walk(node, node_count, fanout)[1]
    return range(lo, hi)


def ancestors(node: int, node_count: int, fanout: int) -> tuple[int, ...]:
    """The nodes whose brokers stand above ``node``'s broker, nearest first: its parent's,
    its grandparent's, ... (node 0, the root's, is not listed: the root is known anyway)."""
    heads = _tree_walk(node, node_count, fanout)[0]
    return tuple(h for h in reversed(heads) if h != 0)


def failover_path(node: int, node_count: int, fanout: int, *, leaf: bool) -> tuple[int, ...]:
    """The nodes whose brokers a rank of ``node`` reports to, in order of preference: its
    parent's first (a leaf's own node's broker; a broker's ``tree_parent``), then each
    ancestor's up the tree; the root is the last resort, after the path. A rank whose parent
    is lost goes to the first broker after it on the path that is usable (``first_usable``),
    and back to a nearer one when one appears, so a lost broker's subtree lands on its
    grandparent, not on the root. Every rank derives it from the node indices alone."""
    above = ancestors(node, node_count, fanout)
    return ((node,) + above) if leaf and 0 < node < node_count else above


def first_usable(path: Sequence[int], usable: Callable[[int], T | None], start: int = 0,
                 stop: int | None = None) -> tuple[int, T] | None:
    """The first (index on ``path``, broker) from ``start`` up to ``stop`` whose node has a
    usable broker (``usable(node)``: the broker, or None); None: none, the root it is."""
    for i in range(start, len(path) if stop is None else min(stop, len(path))):
        broker = usable(path[i])
        if broker is not None:
            return i, broker
    return None


@dataclass(frozen=True)
class Place:
    """Decision: this rank's tier, its parent's endpoint and the root's (None: not known yet)."""

    tier: str
    parent: str | None
    root: str | None


class Placement:
    """One rank's discovery, driven by the rank core."""

    def __init__(self, identity: Identity, settings: Settings, record: dict, *, use_store: bool) -> None:
        self.identity = identity
        self.settings = settings
        self.record = record  # what this rank publishes: endpoint, rank, incarnation, pid, host
        self.use_store = use_store
        self.tier: str | None = None
        self.parent: str | None = None
        self.root: str | None = None
        self.retry_at: float | None = None
        self._started = 0.0
        # a broker's parent by the tree rule: that node's broker (None: the root)
        self.home: int | None = None
        self._home_since: float | None = None  # when we began to look for the home broker

    @property
    def done(self) -> bool:
        if self.tier == "root":
            return True
        return self.tier is not None and self.root is not None and (self.tier == "leaf" or self.parent is not None)

    def start(self, now: float) -> list[StoreOp | Place | Note]:
        s, ident = self.settings, self.identity
        self._started = now
        if s.parent_endpoint:  # an explicit tree, no store
            self.tier, self.parent, self.root = "leaf", s.parent_endpoint, s.root_endpoint or s.parent_endpoint
            return [Place(self.tier, self.parent, self.root)]
        if ident.rank == 0 or not self.use_store:  # a rank cut off from its store runs alone
            self.tier = "root"
            out: list[StoreOp | Place | Note] = []
            if self.use_store:
                out.append(StoreOp("publish_master", {"record": self.record}))
                if ident.local_rank == 0:
                    out.append(StoreOp("elect_local0", {"node": ident.node, "record": self.record}))
            return out + [Place("root", None, None)]
        self.retry_at = now
        return []

    def next_deadline(self) -> float | None:
        return None if self.done else self.retry_at

    def on_timer(self, now: float) -> list[StoreOp]:
        if self.done or self.retry_at is None or now < self.retry_at:
            return []
        self.retry_at = None
        if self.tier is None:
            waited = now - self._started >= self.settings.discover_timeout_sec
            if self.identity.local_rank == 0 or waited:
                return [StoreOp("elect_local0", {"node": self.identity.node, "record": self.record})]
            return [StoreOp("read_local0", {"node": self.identity.node})]
        if self.root is not None and self.home is not None:
            return [StoreOp("read_local0", {"node": self.home})]
        return [StoreOp("read_master", {})]

    def on_store_result(self, op: str, result: object, now: float) -> list[StoreOp | Place | Note]:
        """The outcome of a ``StoreOp``: a dict record, None (not there yet), or
        ``{"error": text}`` when the store failed."""
        if isinstance(result, dict) and "error" in result:
            if op == "publish_master" or self.tier == "root":
                return [Note(f"could not {op.replace('_', ' ')} in the store: {result['error']}")]
            self.retry_at = now + ERROR_RETRY_SEC
            return [Note(f"discovery step {op} failed ({result['error']}); retrying")]
        if self.tier == "root" or self.done:
            return []
        if op in ("elect_local0", "read_local0") and self.tier is None:
            if not isinstance(result, dict):
                self.retry_at = now + RETRY_SEC
                return []
            if result.get("rank") == self.record.get("rank") and result.get("incarnation") != self.record.get(
                    "incarnation"):
                # the node's key names an earlier process of this very rank (it restarted): take over
                return [StoreOp("elect_local0", {"node": self.identity.node, "record": self.record, "stale": result})]
            if result.get("incarnation") == self.record.get("incarnation"):
                self.tier, self.parent = "broker", None  # serve leaves before the root is known
                ident = self.identity
                self.home = tree_parent(ident.node, ident.node_count, self.settings.fanout)
            else:
                self.tier, self.parent = "leaf", str(result.get("endpoint"))
            return [Place(self.tier, self.parent, None), StoreOp("read_master", {})]
        if op == "read_master" and self.tier is not None:
            if not isinstance(result, dict):
                self.retry_at = now + RETRY_SEC
                return []
            self.root = str(result.get("endpoint"))
            if self.tier == "broker" and self.home is not None:  # a broker of brokers is our parent
                self._home_since = now
                return [StoreOp("read_local0", {"node": self.home})]
            if self.tier == "broker":
                self.parent = self.root
            return [Place(self.tier, self.parent, self.root)]
        if op == "read_local0" and self.tier == "broker" and self.root is not None:
            if isinstance(result, dict) and result.get("endpoint"):
                self.parent = str(result["endpoint"])
            elif self._home_since is None or now - self._home_since >= self.settings.discover_timeout_sec:
                self.parent = self.root  # not elected yet: wait at the root (the core moves back)
            else:
                self.retry_at = now + RETRY_SEC
                return []
            return [Place(self.tier, self.parent, self.root)]
        return []


def signing_key(settings: Settings, identity: Identity, *, use_store: bool, store_secret: str | None,
                fresh_secret: str) -> tuple[bytes, str | None]:
    """The key that signs this rank's messages, and a warning to log once (or None).

    A token wins. Without one, ranks that share a store agree on the secret published
    there (``store_secret``); a lone process keeps a fresh secret that only its
    connection file knows; ranks wired by explicit endpoints derive from the run id
    (loopback only: the shell binds loopback without a token).
    """
    if settings.auth_token:
        return derive_key(settings.auth_token, identity.run_id), None
    if use_store and store_secret:
        warning = None if identity.single_host else (
            "no PROBING_AUTH_TOKEN; peers authenticate with a per-job secret kept in the job's store "
            "(anyone who can reach the store can read it)")
        return derive_key(store_secret, identity.run_id), warning
    if identity.world_size == 1 and not settings.parent_endpoint and not settings.root_endpoint:
        return derive_key(fresh_secret, identity.run_id), None
    return derive_key(None, identity.run_id), None


def is_loopback(host: str) -> bool:
    return host.startswith("127.") or host in ("localhost", "::1", "[::1]")


@dataclass(frozen=True)
class Listening:
    """Where a job's ranks listen and whether their sockets are under CURVE. ``advertise``:
    the address peers dial; None where the rule leaves it to the machine (the address of the
    interface that routes to the job's store, which only the shell can ask the OS for)."""

    bind: str
    advertise: str | None
    curve: bool


def listening(settings: Settings, *, single_host: bool = False, dialled: str | None = None) -> Listening:
    """The job's rule: without a token a single-host job binds loopback, else every interface
    (``PROBING_BIND_ADDR`` wins); a loopback bind advertises loopback (``PROBING_ADVERTISE_ADDR``
    wins); the sockets are under CURVE as ``PROBING_CURVE`` says, else when the bind is off
    loopback. Every rank of a job shares the settings, so a job decides as one.

    ``dialled``: a client's view of a job it reaches at that host (the job advertises it): a job
    binds loopback exactly when it advertises loopback, so that decides the guess of whether it
    encrypts (a connection file or the store's record says for sure)."""
    if dialled is not None:
        bind = "127.0.0.1" if is_loopback(dialled) else "0.0.0.0"
        return Listening(bind, dialled, encrypts(settings, bind))
    if settings.bind_addr:
        bind = settings.bind_addr
    else:
        bind = "127.0.0.1" if not settings.auth_token and single_host else "0.0.0.0"
    advertise = settings.advertise_addr or (_loopback_of(bind) if is_loopback(bind) else None)
    return Listening(bind, advertise, encrypts(settings, bind))


def _loopback_of(bind: str) -> str:
    return "[::1]" if bind in ("::1", "[::1]") else "127.0.0.1"


def encrypts(settings: Settings, bind_host: str) -> bool:
    """Whether a rank's sockets are under CURVE: as PROBING_CURVE says, else when it listens
    beyond loopback (``listening`` applies it)."""
    if settings.curve is not None:
        return settings.curve
    return not is_loopback(bind_host)


def curve_material(token: str | None, key: bytes) -> bytes:
    """What the job's CURVE keypair derives from: a key derived from the token alone when there
    is one (a client that knows only the token and the root's address can dial before it learns
    the run id), else the signing key. The connection file keeps it, never the token."""
    return derive_key(token, "\0curve") if token else key
