"""The wire protocol of kernel_probe: frames, signatures, payload encodings, limits.

Rules of this file (read them before changing it):

1. This is the only module that knows what a message looks like on the wire.
   Nothing else builds or parses frames; adding a message type means one row in
   ``SCHEMAS`` here and one handler where it is acted on.
2. Pure logic: no sockets, no threads, no logging, no ``time.time()`` inside the
   code paths -- the clock is injected, so every rule below is testable with a
   fake clock.
3. A message is one byte string: ``PROTOCOL | signature | signed``, where ``signed`` is
   ``count`` (2 bytes, big-endian), the length of each of the ``count`` parts (4 bytes
   each), then the parts themselves: header JSON, body JSON, the buffers. It travels as
   ONE ZeroMQ frame (a frame per part cost the sender, libzmq and the receiver a call and
   an allocation each, several times over for every message), or, when it is longer than
   ``Limits.max_frame_bytes`` (1 MiB), as consecutive frames of exactly that size, the last
   one shorter; any other split is malformed. The sockets refuse longer frames (ZeroMQ's
   MAXMSGSIZE), so a peer can never make the process allocate and free big buffers --
   which glibc would keep resident for good (its dynamic mmap/trim thresholds).
   The signature is HMAC-SHA256 over ``signed``: the lengths are signed with the parts,
   so bytes cannot move between parts, nor parts be dropped or appended, without
   breaking it. It is checked with ``hmac.compare_digest`` before the lengths or any
   JSON are read: unauthenticated bytes never reach a parser.
4. ``Codec.decode`` raises ``WireError`` and nothing else, whatever the peer
   sends, and counts every rejection by reason. ``Codec.encode`` raises
   ``ValueError`` only for our own programming errors (unknown type, body that
   fails its schema, message over our own limits).
5. Bodies are strict JSON (no NaN/Infinity); binary payloads travel as raw
   buffer frames. Never pickle.
6. The token never goes on the wire: only a key derived from it signs frames.
7. A ``Codec`` is owned by one thread (the probe's I/O thread); it is not locked.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import hmac
import itertools
import json
import math
import re
import secrets
import struct
import time
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, TypedDict

__all__ = [
    "PROTOCOL",
    "REFUSED",
    "REJECT_REASONS",
    "SCHEMAS",
    "WireError",
    "Message",
    "Header",
    "Envelope",
    "Limits",
    "Codec",
    "derive_key",
    "new_secret",
    "curve_options",
    "refusal_frames",
    "parse_refusal",
    "pack_json",
    "unpack_json",
]

PROTOCOL_VERSION = 1  # the application protocol (info handshake, connection files)
PROTOCOL = b"PMG2"  # first bytes of every message; bump on any incompatible change (PMG1: a frame a part)
REFUSED = b"PMG1-REFUSED"  # first frame of the one unsigned reply (see refusal_frames): unchanged since
# PMG1, so a peer of either layout still reads why it is refused
SIGNATURE_BYTES = 32  # raw SHA-256 digest
_TAG_BYTES = len(PROTOCOL)
_SIGNED_AT = _TAG_BYTES + SIGNATURE_BYTES  # where the signed bytes start: the part count
_PARTS_AT = _SIGNED_AT + 2  # the parts' lengths, 4 bytes each, then the parts

REJECT_REASONS = ("malformed", "bad_signature", "replay", "stale", "oversized", "unknown_type")

_KEY_CONTEXT = b"probing-magics/v1/"  # domain separation: a key for this protocol only
_CURVE_CONTEXT = b"probing-magics/v1/curve"  # the CURVE keypair's, apart from the signing key's
_HEADER_KEYS = ("type", "sender", "incarnation", "seq", "ts", "msg_id", "corr_id")

_NoneType = type(None)

# Every message body, declared once. The ``*Fields`` base holds the keys a body must
# have; the class itself adds the optional ones (checked too, when present). Unknown
# keys are allowed, so fields can grow without a protocol bump. ``SCHEMAS`` (below) is
# derived from these classes: the whole protocol is this one glance. bool never passes
# for int; int passes for float.


class HeartbeatBody(TypedDict):  # child -> parent: the child's report first, then (broker) its node's
    reports: list
    known_epoch: int


class _HeartbeatAckFields(TypedDict):
    epoch: int
    complete: bool
    delta: dict | None


class HeartbeatAckBody(_HeartbeatAckFields, total=False):
    parent: dict  # who answered: rank, pid, host, incarnation, tier


class _MembershipFields(TypedDict):
    epoch: int
    complete: bool
    delta: dict


class MembershipBody(_MembershipFields, total=False):  # parent -> child push
    level: int  # the sender's level in the tree, once it knows it (an ack says it in ``parent``)


class ByeBody(TypedDict):  # child -> parent, clean exit
    rank: int
    incarnation: str
    reason: str


class EmptyBody(TypedDict):
    pass


class _InfoFields(TypedDict):
    protocol: int
    run_id: str
    world_size: int
    rank: int
    tier: str
    pid: int
    incarnation: str


class InfoRequestBody(TypedDict, total=False):  # client -> probe: the handshake, or asking again
    warm: bool  # the client will query: load the query engine on every rank now (connect(warm=True))


class InfoBody(_InfoFields, total=False):
    counts: dict
    epoch: int
    host: str
    placed_at: float | None
    converged_at: float | None
    rejected: dict  # bad messages this probe dropped, by reason (REJECT_REASONS, plus "dropped" before decode)
    store: str  # the store:// address to type on another host ("" when the job has no store)


class NodesBody(TypedDict):
    members: list  # dicts with membership.record's MEMBER_COLUMNS (and ``via``)
    departures: list  # dicts with membership.record's DEPARTURE_COLUMNS
    epoch: int


class _QueryFields(TypedDict):
    sql: str
    timeout: float


class QueryBody(_QueryFields, total=False):  # client -> probe
    per_rank: bool
    local: bool
    explain: bool
    ranks: list | None
    params: dict | None
    native: bool  # `stacks` with native frames too (py-spy, on each rank asked)
    profile: bool  # coverage["profile"] with every hop's and rank's part (else the root's own only)
    direct: dict  # {rank, epoch}: a query its client pruned to the one rank it is sent to
    # the client puts back the constant columns a one-rank answer carries once (a client that
    # does not say so gets them as columns, as before)
    fold: bool


class QueryProgressBody(TypedDict):  # probe -> client, on long queries
    qid: str
    answered: int
    targeted: int


class _QueryResultFields(TypedDict):
    status: str  # "ok" | "error"


class QueryResultBody(_QueryResultFields, total=False):  # probe -> client; ok: one buffer, the answer
    # targeted, answered, pruned: rank ranges as text ('0-4095,4100'); failed: reason -> rank
    # ranges; partial, elapsed_ms, bytes_shipped, plan, explain, profile (a client expands them)
    coverage: dict
    error: dict  # code, message, line, col
    explain: str
    columns: list | None


class _SubqueryFields(TypedDict):
    qid: str
    deadline: float
    ranks: str  # the ranks asked below, as rank ranges: '0-4095,4100'


class SubqueryBody(_SubqueryFields, total=False):  # parent -> child
    plan: dict  # absent: the plan is the first buffer, as pack_json wrote it (forwarded as it came)
    params: dict | None
    native: bool  # as the query's
    profile: bool  # as the query's: the subresult carries this hop's part of the profile


class _SubresultFields(TypedDict):
    qid: str
    status: str
    answered: str  # rank ranges, as ``ranks`` of the subquery
    failed: dict  # reason -> the rank ranges that failed so (a rack of dead ranks is one entry)
    scans: list  # names of the scans, one buffer each (a partial: Arrow IPC, or packed when tiny)


class SubresultBody(_SubresultFields, total=False):  # child -> parent
    bytes_below: int
    error: dict
    profile: dict  # where this hop's time went (query_fanout.HopTiming), when the query asked
    rows: list  # rows of each scan's buffer (a broker relays small partials instead of merging them)
    parts: list  # how many scans each relayed part holds, in order (absent: one part)
    ship: dict  # a leaf's tags: ``scans`` names the tables its scans read, for the parent to scan


class _ProfileFields(TypedDict):
    action: str  # "arm" | "renew" | "cancel" (client -> root -> the ranks' parents); "accepted" (root -> client);
    id: str  # "clock" (client -> root -> client: the root's wall clock)


class ProfileBody(_ProfileFields, total=False):  # see profile_plane
    ranks: list  # arm / cancel: the ranks asked; accepted: those the request was passed on to
    steps: int
    timeout_sec: float  # arm: the caller's timeout, each rank's deadline for the capture
    lease_sec: float  # arm: the capture ends when its client has not renewed it for this long
    unreachable: list  # accepted: asked ranks the root has no way to
    refused: dict  # accepted: rank -> why it did not arm (the root's own answer only)
    now: float  # clock: the root's wall clock when it answered


class ErrorBody(TypedDict):
    code: str
    message: str


BODIES: dict[str, type] = {
    # membership plane
    "heartbeat": HeartbeatBody,
    "heartbeat_ack": HeartbeatAckBody,
    "membership": MembershipBody,
    "bye": ByeBody,
    # client plane
    "info_request": InfoRequestBody,
    "info": InfoBody,
    "nodes_request": EmptyBody,
    "nodes": NodesBody,
    # query plane; Arrow IPC streams travel in buffers (see tables.arrow_ipc)
    "query": QueryBody,
    "query_progress": QueryProgressBody,
    "query_result": QueryResultBody,
    "subquery": SubqueryBody,
    "warm": EmptyBody,  # parent -> child: a client connected; load the query engine now
    "subresult": SubresultBody,
    # profile plane: arming a capture on chosen ranks; its results are queried as tables
    "profile": ProfileBody,
    "error": ErrorBody,
}


def _json_types(annotation: Any) -> tuple[type, ...]:
    """``dict | None`` -> (dict, NoneType); ``list[dict]`` -> (list,)."""
    if annotation is None or annotation is _NoneType:
        return (_NoneType,)
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return tuple(t for arg in typing.get_args(annotation) for t in _json_types(arg))
    return (origin or annotation,)


def _schema(body: type) -> tuple[dict[str, tuple[type, ...]], dict[str, tuple[type, ...]]]:
    hints = typing.get_type_hints(body)
    required = {k: _json_types(hints[k]) for k in sorted(body.__required_keys__)}
    optional = {k: _json_types(hints[k]) for k in sorted(body.__optional_keys__)}
    return required, optional


# message type -> (required keys, optional keys), each key -> accepted JSON types
SCHEMAS: dict[str, dict[str, tuple[type, ...]]] = {}
OPTIONAL: dict[str, dict[str, tuple[type, ...]]] = {}
for _type, _body in BODIES.items():
    SCHEMAS[_type], OPTIONAL[_type] = _schema(_body)


class WireError(Exception):
    """A message was rejected. ``reason`` is one of ``REJECT_REASONS``."""

    def __init__(self, reason: str, detail: str = "") -> None:
        if reason not in REJECT_REASONS:
            raise ValueError(f"unknown reject reason {reason!r}")
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Message:
    """What a caller sends: a type, a JSON body, optional binary buffers."""

    type: str
    body: dict
    buffers: tuple[bytes, ...] = ()  # binary payloads (Arrow IPC); never pickle
    corr_id: str | None = None  # msg_id of the request this answers
    msg_id: str | None = None  # set by a caller that must match the answer; else a fresh id

    def __post_init__(self) -> None:
        # Accept a list for convenience; keep the frozen value a tuple.
        if not isinstance(self.buffers, tuple):
            object.__setattr__(self, "buffers", tuple(self.buffers))


class TooLarge(ValueError):
    """A message of ours over the wire's limits (``Codec.encode``): ``size`` bytes, ``limit`` allowed."""

    def __init__(self, message: str, size: int, limit: int) -> None:
        super().__init__(message)
        self.size, self.limit = size, limit


def too_large_answer(msg: Message, exc: TooLarge) -> Message | None:
    """The error answer that replaces an answer (``query_result``, ``subresult``) too big to
    send, so its asker hears why at once instead of waiting for its deadline; None for any
    other message."""
    if msg.type not in ("query_result", "subresult"):
        return None
    error = {"code": "too_large",
             "message": f"the answer is {exc.size / 2**20:.0f} MiB, over the {exc.limit / 2**20:.0f} MiB a message "
                        f"may carry: add a LIMIT, select fewer columns or aggregate on the ranks"}
    if msg.type == "query_result":
        body = {"status": "error", "error": error, **{k: msg.body[k] for k in ("coverage",) if k in msg.body}}
    else:
        body = {k: msg.body[k] for k in ("qid", "answered", "failed", "bytes_below", "profile") if k in msg.body}
        body.update(status="error", scans=[], error=error)
    return Message(msg.type, body, corr_id=msg.corr_id)


@dataclass(frozen=True)
class Header:
    type: str
    sender: str
    incarnation: str
    seq: int
    ts: float
    msg_id: str
    corr_id: str | None


@dataclass(frozen=True)
class Envelope:
    """What decode returns: the authenticated header and the message it carried."""

    header: Header
    msg: Message


@dataclass(frozen=True)
class Limits:
    max_message_bytes: int = 64 * 2**20  # whole message (sum of frames)
    max_frame_bytes: int = 2**20  # one ZeroMQ frame: the sockets' MAXMSGSIZE; a longer message is split
    max_frames: int = 96  # frames of a message (64 MiB in 1 MiB frames), and parts of one plus 2
    max_header_bytes: int = 4096
    max_body_bytes: int = 8 * 2**20
    skew_sec: float = 300.0  # |now - header.ts| beyond this -> "stale"
    history: int = 4096  # senders remembered for replay checks (LRU)


def derive_key(token: str | None, run_id: str) -> bytes:
    """The signing key of a job: HMAC(token, context + run id).

    Binding the run id means a message captured from one job (or a previous
    restart of it) never verifies in another. Without a token the key is still
    derived from the run id -- which anyone who knows the run id can compute;
    callers decide when that is acceptable (loopback only) or use new_secret().
    """
    return hmac.new((token or "").encode(), _KEY_CONTEXT + run_id.encode(), hashlib.sha256).digest()


def new_secret() -> str:
    """A per-job random secret, used in place of a token when none was given."""
    return secrets.token_hex(32)


def curve_options(key: bytes, *, server: bool) -> list[tuple[int, int | bytes]]:
    """The socket options that put a ZeroMQ socket under CURVE, the job's one keypair derived
    from its signing key: a ROUTER (``server``) or a DEALER dialing one.

    Whoever can sign for the job can complete the handshake; anybody else is cut off by
    libzmq before it keeps a byte of theirs -- without CURVE a peer speaking raw ZMTP can
    make libzmq hold an unfinished multipart message of any length (MAXMSGSIZE bounds each
    frame, not their number). ``zmq.curve_public`` is a pure function (X25519)."""
    import zmq
    from zmq.utils import z85

    secret = z85.encode(hmac.new(key, _CURVE_CONTEXT, hashlib.sha256).digest())
    public = zmq.curve_public(secret)
    if server:
        return [(zmq.CURVE_SERVER, 1), (zmq.CURVE_SECRETKEY, secret)]
    return [(zmq.CURVE_SERVERKEY, public), (zmq.CURVE_PUBLICKEY, public), (zmq.CURVE_SECRETKEY, secret)]


# --------------------------------------------------------------------------- helpers


class _Hmac:
    """HMAC-SHA256 with one key, its padded inner and outer states hashed once (RFC 2104):
    each message then costs its own blocks only -- half of ``hmac.digest`` for a small one."""

    def __init__(self, key: bytes) -> None:
        key = hashlib.sha256(key).digest() if len(key) > 64 else key.ljust(64, b"\0")
        self._inner = hashlib.sha256(bytes(b ^ 0x36 for b in key))
        self._outer = hashlib.sha256(bytes(b ^ 0x5C for b in key))

    def digest(self, *data: Any) -> bytes:
        """The MAC of the concatenation of ``data`` (bytes-like), without joining them."""
        inner = self._inner.copy()
        for chunk in data:
            inner.update(chunk)
        outer = self._outer.copy()
        outer.update(inner.digest())
        return outer.digest()


# Compact, strict JSON. ensure_ascii keeps lone surrogates (surrogateescape'd
# argv/env) encodable; the result is ASCII and therefore valid UTF-8. One encoder and
# one decoder for the process: json.dumps/loads with options build new ones per call.
_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)
# The C encoder JSONEncoder.encode makes on every call, made once, without the circular-reference
# bookkeeping (a dict of the id of every container, a fifth of a small body's cost): a body that
# contains itself is a RecursionError, which _dumps reports as the ValueError json would raise.
_C_ENCODE = None if json.encoder.c_make_encoder is None else json.encoder.c_make_encoder(
    None, _ENCODER.default, json.encoder.encode_basestring_ascii, None, ":", ",", False, False, False)


def _dumps(obj: Any) -> bytes:
    if _C_ENCODE is None:
        return _ENCODER.encode(obj).encode("ascii")
    try:
        return "".join(_C_ENCODE(obj, 0)).encode("ascii")
    except RecursionError:
        raise ValueError("a circular reference, or nesting too deep for JSON") from None


def pack_json(obj: Any) -> bytes:
    """``obj`` as the wire's compact, strict JSON, for a buffer (a plan sent once, forwarded
    as it came); ValueError for what JSON cannot hold."""
    return _dumps(obj)


def unpack_json(data: bytes) -> Any:
    """A buffer ``pack_json`` wrote; ValueError for anything else."""
    return _loads(data)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


# Strict UTF-8 and strict JSON: Python's json accepts NaN/Infinity by default.
_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


_SCAN = _DECODER.scan_once  # the C scanner that JSONDecoder.decode wraps in two Python calls


def _loads(data: bytes) -> Any:
    text = data.decode("utf-8")
    try:
        obj, end = _SCAN(text, 0)
    except StopIteration:
        end = -1
    if end != len(text):  # whitespace around the value, trailing data or no value: the full decoder decides
        return _DECODER.decode(text)
    return obj


def _json_str(text: str) -> str:
    """``text`` as a JSON string, as ``_dumps`` writes it: ids of ours are plain ASCII, quoted as they are."""
    if text.isascii() and text.isprintable() and '"' not in text and "\\" not in text:
        return f'"{text}"'
    return _ENCODER.encode(text)


def _as_bytes(frame: Any) -> bytes:
    if type(frame) is bytes:
        return frame
    if isinstance(frame, bytes):
        return frame
    if isinstance(frame, (bytearray, memoryview)):
        return bytes(frame)
    data = getattr(frame, "bytes", None)  # zmq.Frame and look-alikes
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    raise TypeError(f"frame of type {type(frame).__name__} is not bytes-like")


def _is_json_type(value: Any, expected: type | tuple[type, ...]) -> bool:
    allowed = expected if isinstance(expected, tuple) else (expected,)
    kind = type(value)
    if kind in allowed and kind is not int:  # the common case, decided at once
        return True
    if isinstance(value, bool):  # bool is an int subclass; it only passes as bool
        return bool in allowed
    if isinstance(value, int):  # an int is a perfectly good JSON number for a float
        return int in allowed or float in allowed
    return isinstance(value, allowed)


def _quick_types(expected: tuple[type, ...]) -> frozenset:
    """The exact types ``_is_json_type`` accepts for ``expected`` at a glance: those named, and
    int where float is (bool only where named: ``type(True)`` is bool); a subclass takes the
    full check."""
    return frozenset(expected) | ({int} if float in expected else set())


_MISSING = object()
# message type -> ((key, quick types, expected), ...) required, then optional: one pass each
_CHECKS: dict[str, tuple[tuple, tuple]] = {
    t: (tuple((k, _quick_types(e), e) for k, e in SCHEMAS[t].items()),
        tuple((k, _quick_types(e), e) for k, e in OPTIONAL[t].items()))
    for t in SCHEMAS}


def _schema_problem(type_: str, body: Any) -> str | None:
    """Why ``body`` does not fit the schema of ``type_``, or None if it does."""
    if not isinstance(body, dict):
        return f"body of {type_} is {type(body).__name__}, not an object"
    required, optional = _CHECKS[type_]
    get = body.get
    for key, quick, expected in required:
        value = get(key, _MISSING)
        if type(value) not in quick:
            if value is _MISSING and key not in body:
                return f"{type_} body lacks {key!r}"
            if not _is_json_type(value, expected):
                return f"{type_}.{key} has type {type(value).__name__}"
    if len(body) == len(required):  # every key a required one (checked above): no optional one to check
        return None
    for key, quick, expected in optional:
        value = get(key, _MISSING)
        if type(value) not in quick and not (value is _MISSING and key not in body) \
                and not _is_json_type(value, expected):
            return f"{type_}.{key} has type {type(value).__name__}"
    return None


@functools.lru_cache(maxsize=None)
def _table(count: int) -> struct.Struct:
    """The signed start of a message of ``count`` parts: the count, then each part's length."""
    return struct.Struct(f">H{count}I")


def _trusted(cls: type, **fields: Any) -> Any:
    """A frozen dataclass of ours made from values already checked (the codec's own output of a
    decode), without its ``__init__``: a frozen field costs an ``object.__setattr__`` call each."""
    obj = object.__new__(cls)
    obj.__dict__.update(fields)
    return obj


# A header exactly as ``Codec.encode`` writes it: compact, the keys in ``_HEADER_KEYS`` order,
# every string plain printable ASCII (no escapes), seq a positive integer, ts a JSON number with a
# fraction or an exponent (a float to json). What matches means what ``_loads`` would read from it;
# anything else -- a valid header written otherwise included -- is parsed as JSON and checked.
# (matched on the header's ASCII text: its groups are the strings, with no decode each)
_PLAIN_STR = r'"([ !#-\[\]-~]+)"'
_PLAIN_HEADER = re.compile(
    r'\{"type":' + _PLAIN_STR + r',"sender":' + _PLAIN_STR + r',"incarnation":' + _PLAIN_STR
    + r',"seq":([1-9][0-9]{0,18}),"ts":(-?(?:0|[1-9][0-9]*)(?:\.[0-9]+(?:[eE][-+]?[0-9]+)?|[eE][-+]?[0-9]+))'
    + r',"msg_id":' + _PLAIN_STR + r',"corr_id":(?:null|' + _PLAIN_STR + r')\}')

_REPLAY_NAME_CHARS = 64  # longer sender or incarnation names are remembered by their digest


def _replay_key(sender: str, incarnation: str) -> tuple[str, str] | bytes:
    """What the replay check remembers a peer by: its names, or a 16-byte digest of long ones,
    so ``Limits.history`` entries cost a few hundred KiB however long the names a peer signs."""
    if len(sender) <= _REPLAY_NAME_CHARS and len(incarnation) <= _REPLAY_NAME_CHARS:
        return (sender, incarnation)
    return hashlib.blake2b(f"{len(sender)}:{sender}{incarnation}".encode("utf-8", "surrogatepass"),
                           digest_size=16).digest()


# --------------------------------------------------------------------------- codec


class Codec:
    """Builds, signs, checks and parses messages for one endpoint.

    ``sender`` names this endpoint (e.g. its rank); ``incarnation`` is random
    per process start, so a restarted sender may begin again at seq 1.
    """

    def __init__(
        self,
        key: bytes,
        sender: str,
        incarnation: str,
        *,
        clock: Callable[[], float] = time.time,
        limits: Limits = Limits(),
    ) -> None:
        if not isinstance(key, (bytes, bytearray)):
            raise TypeError("key must be bytes (see derive_key)")
        if not (isinstance(sender, str) and sender and isinstance(incarnation, str) and incarnation):
            raise ValueError("sender and incarnation must be non-empty strings")
        self._key = bytes(key)
        self._mac = _Hmac(self._key)
        self.sender = sender
        self.incarnation = incarnation
        self._clock = clock
        self.limits = limits
        self.rejected: collections.Counter[str] = collections.Counter()
        self._seq = itertools.count(1)
        self._heads: dict[str, str] = {}  # message type -> the header's JSON up to the seq
        self._id_prefix = secrets.token_hex(8)  # default msg_id: 32 hex digits, this and the seq (no urandom per message)
        # _replay_key(sender, incarnation) -> (last accepted seq, newest ts accepted from it), least
        # recently used first. Bounded so a peer inventing incarnations cannot grow our memory, and
        # expiring: once all a peer's messages are older than skew_sec, a replay of any of them is
        # "stale" anyway, so its entry protects nothing and is let go.
        self._last_seq: collections.OrderedDict[tuple[str, str] | bytes, tuple[int, float]] = collections.OrderedDict()

    # ----------------------------------------------------------------- encode

    def encode(self, msg: Message) -> list[bytes]:
        """The signed frames of ``msg``. Raises ValueError on our own mistakes."""
        if msg.type not in SCHEMAS:
            raise ValueError(f"unknown message type {msg.type!r}")
        problem = _schema_problem(msg.type, msg.body)
        if problem:
            raise ValueError(problem)
        if msg.corr_id is not None and not isinstance(msg.corr_id, str):
            raise ValueError("corr_id must be a str or None")
        if msg.msg_id is not None and (not isinstance(msg.msg_id, str) or not msg.msg_id):
            raise ValueError("msg_id must be a non-empty str or None")
        try:
            buffers = [b if type(b) is bytes else _as_bytes(b) for b in msg.buffers]
            body = _dumps(msg.body)  # before a seq is spent
        except (TypeError, ValueError) as exc:  # NaN, numpy scalars, str buffers...
            raise ValueError(f"{msg.type} body or buffers not encodable: {exc}") from None
        ts = self._clock()
        if not (type(ts) is float and math.isfinite(ts)):
            if not (isinstance(ts, (int, float)) and not isinstance(ts, bool) and math.isfinite(ts)):
                raise ValueError(f"the clock gave {ts!r}, not a finite number")
            ts = float(ts)
        seq = next(self._seq)
        head = self._heads.get(msg.type)
        if head is None:  # the header's fixed start, written once per type: what _dumps writes
            head = self._heads[msg.type] = (f'{{"type":{_json_str(msg.type)},"sender":{_json_str(self.sender)},'
                                            f'"incarnation":{_json_str(self.incarnation)},"seq":')
        msg_id = f'"{self._id_prefix}{seq:016x}"' if msg.msg_id is None else _json_str(msg.msg_id)
        corr_id = "null" if msg.corr_id is None else _json_str(msg.corr_id)
        # the header's JSON written directly (the keys in _HEADER_KEYS order, compact), not by json.dumps
        fields = f'{head}{seq},"ts":{ts!r},"msg_id":{msg_id},"corr_id":{corr_id}'
        header = f"{fields}}}".encode("ascii")
        parts = [header, body, *buffers]
        count = len(parts)
        lengths = [len(header), len(body), *map(len, buffers)]
        size = _PARTS_AT + 4 * count + sum(lengths)
        # Refuse to send what a peer with the same limits would reject: better a
        # clear error here than a silent drop over there.
        lim = self.limits
        if (
            count + 2 > lim.max_frames
            or len(header) > lim.max_header_bytes
            or len(body) > lim.max_body_bytes
            or size > lim.max_message_bytes
            or -(-size // lim.max_frame_bytes) > lim.max_frames
        ):
            raise TooLarge(f"{msg.type} message exceeds wire limits", size, lim.max_message_bytes)
        signed = b"".join((_table(count).pack(count, *lengths), *parts))
        data = b"".join((PROTOCOL, self._mac.digest(signed), signed))  # (one hash update, not one a part)
        step = lim.max_frame_bytes
        if size <= step:  # the usual case: one frame
            return [data]
        return [data[i:i + step] for i in range(0, size, step)]

    # ----------------------------------------------------------------- decode

    def decode(self, frames: list[Any]) -> Envelope:
        """Check and parse received frames. Raises WireError and nothing else."""
        try:
            return self._decode(frames)
        except WireError as exc:
            self.rejected[exc.reason] += 1
            raise
        except Exception as exc:  # whatever a hostile peer found, it is "malformed"
            self.rejected["malformed"] += 1
            raise WireError("malformed", f"{type(exc).__name__}: {exc}") from None

    def _decode(self, raw_frames: list[Any]) -> Envelope:
        lim = self.limits

        # 1. Sizes first: cheap, and nothing big is copied or hashed.
        if len(raw_frames) > lim.max_frames:
            raise WireError("oversized", f"{len(raw_frames)} frames")
        authentic = False
        if len(raw_frames) == 1:  # the usual case
            data = raw_frames[0]
            if type(data) is not bytes:
                data = _as_bytes(data)
            size = len(data)
            if size > lim.max_frame_bytes or size > lim.max_message_bytes:
                raise WireError("oversized", f"a frame of {size} bytes")
        else:
            data = self._joined([_as_bytes(f) for f in raw_frames])  # authenticated before it is joined
            size = len(data)
            authentic = True

        # 2. Shape.
        if size < _PARTS_AT:
            raise WireError("malformed", f"{size} bytes, need at least {_PARTS_AT}")
        if not data.startswith(PROTOCOL):
            raise WireError("malformed", f"not a {PROTOCOL.decode()} message")

        # 3. Authenticity, before any parser sees the bytes (the lengths included).
        if not authentic and not hmac.compare_digest(data[_TAG_BYTES:_SIGNED_AT],
                                                     self._mac.digest(memoryview(data)[_SIGNED_AT:])):
            raise WireError("bad_signature")

        # 4. The parts, by the lengths signed with them.
        count = data[_SIGNED_AT] << 8 | data[_SIGNED_AT + 1]  # the table's ">H" (no slice made to read it)
        if count < 2:
            raise WireError("malformed", f"{count} parts, need a header and a body")
        if count + 2 > lim.max_frames:
            raise WireError("oversized", f"{count} parts")
        at = _PARTS_AT + 4 * count
        if at > size:
            raise WireError("malformed", f"{count} parts' lengths, {size} bytes")
        lengths = _table(count).unpack_from(data, _SIGNED_AT)
        if at + sum(lengths) - count != size:  # (the count itself is lengths[0])
            raise WireError("malformed", f"parts of {sum(lengths) - count} bytes, {size - at} came")
        if lengths[1] > lim.max_header_bytes:
            raise WireError("oversized", f"header of {lengths[1]} bytes")
        if lengths[2] > lim.max_body_bytes:
            raise WireError("oversized", f"body of {lengths[2]} bytes")
        end = at + lengths[1]
        header = self._parse_header(data[at:end])
        at, end = end, end + lengths[2]
        body_bytes = data[at:end]
        buffers = []
        for n in lengths[3:]:
            at, end = end, end + n
            buffers.append(data[at:end])

        # 5. Type, then body.
        type_ = header.type
        if type_ not in SCHEMAS:
            raise WireError("unknown_type", type_[:64])
        body = _loads(body_bytes)
        problem = _schema_problem(type_, body)
        if problem:
            raise WireError("malformed", problem)

        # 6. Freshness.
        now = self._clock()
        ts = header.ts
        if abs(now - ts) > lim.skew_sec:
            raise WireError("stale", f"ts {ts:.3f} vs now {now:.3f}")

        # 7. Replay. Recorded only now, so a rejected message never moves the bar.
        seen = self._last_seq
        peer = _replay_key(header.sender, header.incarnation)
        last, newest = seen.get(peer, (None, ts))
        seq = header.seq
        if last is not None and seq <= last:
            raise WireError("replay", f"seq {seq} <= {last} from {header.sender}")
        seen[peer] = (seq, newest if newest > ts else ts)
        seen.move_to_end(peer)
        self._expire_history(now)

        msg = _trusted(Message, type=type_, body=body, buffers=tuple(buffers), corr_id=header.corr_id, msg_id=None)
        return _trusted(Envelope, header=header, msg=msg)

    def _expire_history(self, now: float) -> None:
        """Forget the least recently heard peers past the bound, and those all of whose messages
        are now stale (checked from the least recently heard on: amortised O(1) a message)."""
        history = self._last_seq
        while len(history) > self.limits.history:
            history.popitem(last=False)
        while history:
            peer, (_, newest) = next(iter(history.items()))
            if now - newest <= self.limits.skew_sec:
                return
            del history[peer]

    def _joined(self, frames: list[bytes]) -> bytes:
        """The one byte string of a message that came in several frames: every one but the last
        exactly ``max_frame_bytes`` long (any other split is malformed, so a message has one
        form on the wire), its signature checked over the frames as they are first (an unsigned
        message is never copied: up to 64 MiB that a peer without the key could make us allocate)."""
        lim = self.limits
        total = sum(map(len, frames))
        if total > lim.max_message_bytes:
            raise WireError("oversized", f"{total} bytes")
        longest = max(map(len, frames), default=0)
        if longest > lim.max_frame_bytes:
            raise WireError("oversized", f"a frame of {longest} bytes")
        if not frames:
            raise WireError("malformed", "no frames")
        if not frames[-1] or any(len(f) != lim.max_frame_bytes for f in frames[:-1]):
            raise WireError("malformed", f"{len(frames)} frames not split at {lim.max_frame_bytes} bytes")
        first = frames[0]  # a whole frame: longer than the tag and signature
        if not first.startswith(PROTOCOL):
            raise WireError("malformed", f"not a {PROTOCOL.decode()} message")
        if not hmac.compare_digest(first[_TAG_BYTES:_SIGNED_AT],
                                   self._mac.digest(memoryview(first)[_SIGNED_AT:], *frames[1:])):
            raise WireError("bad_signature")
        return b"".join(frames)

    @staticmethod
    def _parse_header(data: bytes) -> Header:
        plain = _PLAIN_HEADER.fullmatch(data.decode("ascii")) if data.isascii() else None
        if plain is not None:  # as encode writes it: read as json would, without building a dict
            type_, sender, incarnation, seq, ts, msg_id, corr_id = plain.groups()
            ts = float(ts)
            if ts - ts == 0.0:  # finite (else the checks below say why not)
                return _trusted(Header, type=type_, sender=sender, incarnation=incarnation, seq=int(seq), ts=ts,
                                msg_id=msg_id, corr_id=corr_id)
        obj = _loads(data)
        if type(obj) is dict:  # the common case decided in one expression: every field plainly right
            get = obj.get
            type_, sender, incarnation, msg_id = get("type"), get("sender"), get("incarnation"), get("msg_id")
            seq, ts, corr_id = get("seq"), get("ts"), get("corr_id", _MISSING)
            if (type(type_) is str and type_ and type(sender) is str and sender and type(incarnation) is str
                    and incarnation and type(msg_id) is str and msg_id and type(seq) is int and seq >= 1
                    and type(ts) is float and ts - ts == 0.0 and (corr_id is None or type(corr_id) is str)):
                return _trusted(Header, type=type_, sender=sender, incarnation=incarnation, seq=seq, ts=ts,
                                msg_id=msg_id, corr_id=corr_id)
        if not isinstance(obj, dict):
            raise WireError("malformed", "header is not an object")
        missing = [k for k in _HEADER_KEYS if k not in obj]
        if missing:
            raise WireError("malformed", f"header lacks {missing}")
        for key in ("type", "sender", "incarnation", "msg_id"):
            if not isinstance(obj[key], str) or not obj[key]:
                raise WireError("malformed", f"header.{key} must be a non-empty string")
        seq, ts, corr_id = obj["seq"], obj["ts"], obj["corr_id"]
        if not _is_json_type(seq, int) or seq < 1:
            raise WireError("malformed", "header.seq must be a positive integer")
        if not _is_json_type(ts, float) or not math.isfinite(ts):
            raise WireError("malformed", "header.ts must be a finite number")
        if corr_id is not None and not isinstance(corr_id, str):
            raise WireError("malformed", "header.corr_id must be a string or null")
        return Header(
            type=obj["type"],
            sender=obj["sender"],
            incarnation=obj["incarnation"],
            seq=seq,
            ts=float(ts),
            msg_id=obj["msg_id"],
            corr_id=corr_id,
        )


# --------------------------------------------------------------------------- refusals

# A refusal is unsigned (the sender could not authenticate us either), so its
# reason is shown to a user and must stay a short, plain token.
_REASON_TOKEN = re.compile(rb"[A-Za-z0-9_.:-]{1,64}")


_RUN_ID_TOKEN = re.compile(rb"[A-Za-z0-9_.:/@+-]{0,200}")


def refusal_frames(reason: str, run_id: str = "") -> list[bytes]:
    """The UNSIGNED reply to a peer whose message failed to authenticate.

    It tells a client with a wrong token why it gets no answer. It carries no
    secret and no state, only the run id (not a secret: it names the job) so that a
    client holding the right token can derive the job's key; the caller rate-limits it.
    """
    data = reason.encode("ascii", "replace")
    if not _REASON_TOKEN.fullmatch(data):
        raise ValueError(f"refusal reason must be a short plain token, got {reason!r}")
    run = run_id.encode("ascii", "replace")
    if not _RUN_ID_TOKEN.fullmatch(run):
        run = b""
    return [REFUSED, data, run]


def parse_refusal(frames: list[Any]) -> tuple[str, str] | None:
    """(reason, run_id) if ``frames`` is a refusal, else None. Never raises."""
    try:
        if len(frames) not in (2, 3) or _as_bytes(frames[0]) != REFUSED:
            return None
        data = _as_bytes(frames[1])
        run = _as_bytes(frames[2]) if len(frames) == 3 else b""
        if not _REASON_TOKEN.fullmatch(data) or not _RUN_ID_TOKEN.fullmatch(run):
            return None
        return data.decode("ascii"), run.decode("ascii")
    except Exception:
        return None
