"""The agent ↔ router control stream's wire format, as a pure codec (bytes in, messages out).

A frame is a 4-byte big-endian length, then that many bytes of msgpack: one map
``{"v": 1, "t": TYPE, "seq": n, ...fields}``.  Each side numbers the messages it sends
from 1 and the receiver insists on exactly +1 each time, so a lost, repeated or reordered
message is an error, not a silent gap.

Decoding is strict and cheap: hand-written checks per field, every failure a
:class:`WireProtocolError` naming the field (``hello.engines[2].state: expected str, got int``).
Unknown keys are ignored (a newer peer may add fields); unknown message types are not.
Fields of the nested EngineSpec / EngineReport / NodeFacts that have defaults may be
absent; every field of a message itself is required, except those added after the first
release, which older peers leave out (``Hello.credential`` and ``features``,
``Welcome.credential``, ``features``, ``epoch``, ``leading`` and ``routers``, ``Desired.epoch``,
``Refused.retry``).  ``NodeFacts.extra`` is not carried
(``NodeFacts.to_wire`` leaves it out).

An agent sends :class:`KvEvents` only after listing :data:`FEATURE_KV_EVENTS` in its hello and
only to a router whose welcome lists it (:data:`ROUTER_FEATURES`); a router refuses them (a
protocol error) from an agent that did not list it.

A router sends :class:`ReportRejected` only to an agent whose hello lists the
:data:`FEATURE_REPORT_REJECTED` feature, :class:`Routers` only to one listing :data:`FEATURE_ROUTERS`,
and issues node credentials only to one listing :data:`FEATURE_CREDENTIAL`: an older agent would not
understand them (an unknown message type ends the stream).

Several routers (docs/ha.md): each welcome says the leadership `epoch` the router knows (0: none),
whether it `leading`, and every live router's control address and TLS pin (`routers`); a
:class:`Routers` message says it again whenever any of these change. A `desired` carries the epoch
of the leader that sent it. Absent, they read as an older router's: epoch 0, leading, no others.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, ClassVar

import msgpack

from llmgw.fleet.types import EngineReport, EngineSpec, NodeFacts, RouterAddr
from llmgw.fleet.wire_peek import peek_frame
from llmgw.fleet.wire_fields import (
    MAX_ENGINES,
    MAX_FEATURES,
    MAX_ID,
    MAX_KV_BLOCKS,
    MAX_NAME,
    MAX_SECRET,
    WireProtocolError,
    _bool,
    _bounded_str,
    _epoch,
    _facts,
    _field,
    _float,
    _int,
    _kv_block,
    _kv_counts,
    _labels,
    _node_name,
    _opt,
    _positive,
    _reason,
    _report,
    _routers,
    _short,
    _spec,
    _str,
    _tuple_of,
)

__all__ = [
    "AGENT_FEATURES",
    "FEATURE_CREDENTIAL",
    "FEATURE_GROUPS",
    "FEATURE_KV_EVENTS",
    "FEATURE_REPORT_REJECTED",
    "FEATURE_ROUTERS",
    "FROM_AGENT",
    "FROM_ROUTER",
    "MAX_FRAME",
    "MAX_HELLO",
    "MESSAGE_TYPES",
    "PROTOCOL_VERSION",
    "ROUTER_FEATURES",
    "SUPPORTED_VERSIONS",
    "Bye",
    "Desired",
    "EngineUpdate",
    "FrameDecoder",
    "Gate",
    "Heartbeat",
    "Hello",
    "KvEvents",
    "Message",
    "Refused",
    "ReportRejected",
    "RouterAddr",
    "Routers",
    "Skipped",
    "Welcome",
    "WireProtocolError",
    "encode",
]

PROTOCOL_VERSION = 1
SUPPORTED_VERSIONS = frozenset({PROTOCOL_VERSION})
MAX_FRAME = 4 << 20  # msgpack bytes of one frame, the length prefix not counted
MAX_HELLO = 64 << 10  # a router's default frame cap until it has accepted a hello

# What an agent may list in its hello's `features`: what it understands beyond the first release.
FEATURE_CREDENTIAL = "credential"  # keeps the node credential a welcome issues, presents it in hellos
FEATURE_REPORT_REJECTED = "report_rejected"  # understands the report_rejected message
FEATURE_KV_EVENTS = "kv_events"  # sends kv_events messages (a router accepts them only then)
# runs the parts of multi-node replicas (EngineSpec.group); an older agent would run a worker's spec
# as a whole engine, so a router places multi-node replicas only on agents listing it
FEATURE_GROUPS = "groups"
FEATURE_ROUTERS = "routers"  # understands the routers message (and dials the routers it lists)
AGENT_FEATURES = (FEATURE_CREDENTIAL, FEATURE_REPORT_REJECTED, FEATURE_KV_EVENTS, FEATURE_GROUPS, FEATURE_ROUTERS)
# What a router may list in its welcome's `features`: messages it accepts beyond the first release
# (an older router would close the stream on a message type it does not know).
ROUTER_FEATURES = (FEATURE_KV_EVENTS,)


# --------------------------------------------------------------------------- messages
# to_dict: the message's own fields as plain msgpack-able data (no v/t/seq);
# from_dict: the strict inverse, raising WireProtocolError.

@dataclass(frozen=True)
class Hello:
    """agent → router, first: who I am, what I run. `agent_id` is random per agent process,
    so the router tells a restarted agent from a reconnecting one."""

    TYPE: ClassVar[str] = "hello"
    token: str  # the join token: admits a node that has no credential yet
    node: str
    agent_id: str
    versions: tuple[int, ...]  # protocol versions the agent speaks
    labels: dict[str, str]
    facts: NodeFacts
    engines: tuple[EngineReport, ...]
    credential: str = ""  # the node's credential, issued by an earlier welcome; "" if it has none
    features: tuple[str, ...] = ()  # AGENT_FEATURES it understands; absent from older agents

    def to_dict(self) -> dict[str, Any]:
        return {"token": self.token, "node": self.node, "agent_id": self.agent_id, "versions": list(self.versions),
                "labels": dict(self.labels), "facts": self.facts.to_wire(),
                "engines": [e.to_wire() for e in self.engines], "credential": self.credential,
                "features": list(self.features)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Hello:
        p = cls.TYPE
        return cls(token=_field(d, p, "token", _bounded_str(MAX_SECRET)), node=_field(d, p, "node", _node_name),
                   agent_id=_field(d, p, "agent_id", _bounded_str(MAX_ID)),
                   versions=_field(d, p, "versions", _tuple_of(_int, MAX_FEATURES)),
                   labels=_field(d, p, "labels", _labels), facts=_field(d, p, "facts", _facts),
                   engines=_field(d, p, "engines", _tuple_of(_report, MAX_ENGINES)),
                   credential=_field(d, p, "credential", _bounded_str(MAX_SECRET), ""),
                   features=_field(d, p, "features", _tuple_of(_bounded_str(MAX_NAME), MAX_FEATURES), ()))

    def has(self, feature: str) -> bool:
        return feature in self.features


@dataclass(frozen=True)
class Heartbeat:
    """Either way: I'm alive (each side sends one every `Welcome.heartbeat_s`). An agent's may carry
    its GPUs' measured power draw when it changed (optional: a router that predates it ignores it)."""

    TYPE: ClassVar[str] = "heartbeat"
    measured_watts: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {} if self.measured_watts is None else {"measured_watts": self.measured_watts}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Heartbeat:
        return cls(measured_watts=_field(d, cls.TYPE, "measured_watts", _opt(_float), None))


@dataclass(frozen=True)
class EngineUpdate:
    """agent → router: one engine changed; the report is whole, not a delta."""

    TYPE: ClassVar[str] = "engine_update"
    report: EngineReport

    def to_dict(self) -> dict[str, Any]:
        return {"report": self.report.to_wire()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EngineUpdate:
        return cls(report=_field(d, cls.TYPE, "report", _report))


@dataclass(frozen=True)
class Bye:
    """agent → router, last: I'm leaving on purpose (not a crash)."""

    TYPE: ClassVar[str] = "bye"
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"reason": self.reason}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Bye:
        return cls(reason=_field(d, cls.TYPE, "reason", _reason))


@dataclass(frozen=True)
class Welcome:
    """router → agent, the answer to a good Hello: the version chosen and the heartbeat period.
    `credential`, when not empty, is the node's new credential: the agent keeps it (before it
    sends anything else) and presents it in every later hello. `epoch`, `leading`, `routers`: as
    in :class:`Routers` (an older router: 0, True, none)."""

    TYPE: ClassVar[str] = "welcome"
    node: str
    router_id: str
    version: int
    heartbeat_s: float
    credential: str = ""
    features: tuple[str, ...] = ()  # ROUTER_FEATURES it understands; absent from older routers
    epoch: int = 0
    leading: bool = True
    routers: tuple[RouterAddr, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "router_id": self.router_id, "version": self.version,
                "heartbeat_s": self.heartbeat_s, "credential": self.credential, "features": list(self.features),
                "epoch": self.epoch, "leading": self.leading, "routers": [r.to_wire() for r in self.routers]}

    def has(self, feature: str) -> bool:
        return feature in self.features

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Welcome:
        p = cls.TYPE
        return cls(node=_field(d, p, "node", _node_name), router_id=_field(d, p, "router_id", _bounded_str(MAX_ID)),
                   version=_field(d, p, "version", _int), heartbeat_s=_field(d, p, "heartbeat_s", _positive),
                   credential=_field(d, p, "credential", _bounded_str(MAX_SECRET), ""),
                   features=_field(d, p, "features", _tuple_of(_bounded_str(MAX_NAME), MAX_FEATURES), ()),
                   epoch=_field(d, p, "epoch", _epoch, 0), leading=_field(d, p, "leading", _bool, True),
                   routers=_field(d, p, "routers", _routers, ()))


@dataclass(frozen=True)
class Routers:
    """router → agent (one listing FEATURE_ROUTERS), whenever one of these changed for that router:
    the leadership `epoch` it knows (0: none), whether it is `leading` (only a leader sends
    `desired`), and every live router's control address and TLS pin (`routers`, at most
    MAX_ROUTERS, each id once). The agent keeps a session to each; see docs/architecture.md."""

    TYPE: ClassVar[str] = "routers"
    epoch: int
    leading: bool
    routers: tuple[RouterAddr, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "leading": self.leading, "routers": [r.to_wire() for r in self.routers]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Routers:
        p = cls.TYPE
        return cls(epoch=_field(d, p, "epoch", _epoch), leading=_field(d, p, "leading", _bool),
                   routers=_field(d, p, "routers", _routers))


@dataclass(frozen=True)
class Refused:
    """router → agent, the answer to a bad Hello (token, credential, version ...); then close.
    `retry`: the cause is passing (the node's old connection has not timed out yet, the router
    cannot write its store): the agent retries with its usual backoff, not its longest."""

    TYPE: ClassVar[str] = "refused"
    reason: str
    retry: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"reason": self.reason, "retry": self.retry}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Refused:
        return cls(reason=_field(d, cls.TYPE, "reason", _reason), retry=_field(d, cls.TYPE, "retry", _bool, False))


@dataclass(frozen=True)
class ReportRejected:
    """router → agent: one engine report was refused (its URL is malformed or not on the node's
    own address); the router treats that engine as failed. The connection goes on."""

    TYPE: ClassVar[str] = "report_rejected"
    replica: str
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"replica": self.replica, "reason": self.reason}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ReportRejected:
        p = cls.TYPE
        return cls(replica=_field(d, p, "replica", _str), reason=_field(d, p, "reason", _reason))


@dataclass(frozen=True)
class Desired:
    """router → agent: the full set of engines wanted on the node (absent ones are to stop).
    `rev` grows with every change, so the agent can say which one it has acted on. `epoch`: the
    leadership epoch of the router that sent it (0 from an older router); an agent applies it only
    if no router has told it of a higher one."""

    TYPE: ClassVar[str] = "desired"
    rev: int
    engines: tuple[EngineSpec, ...]
    epoch: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"rev": self.rev, "engines": [e.to_wire() for e in self.engines], "epoch": self.epoch}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Desired:
        p = cls.TYPE
        return cls(rev=_field(d, p, "rev", _int), engines=_field(d, p, "engines", _tuple_of(_spec, MAX_ENGINES)),
                   epoch=_field(d, p, "epoch", _epoch, 0))


@dataclass(frozen=True)
class KvEvents:
    """agent → router: net changes of one engine's KV blocks since the previous kv_events of
    that replica in this session (:class:`llmgw.kv.mirror.Delta`). ``reset``: clear the
    replica's index first (a full copy follows in this and later messages). ``event_seq`` is the
    engine's event sequence number the changes reach (None before any event). Blocks are
    ``(medium, hash)``: medium None when the engine does not say; at most MAX_KV_BLOCKS in all.
    ``counts``: what the agent counted for this engine since its previous message of the replica
    (sequence gaps, replays by reason and outcome: llmgw.kv.mirror.AGENT_COUNTS), sent once each;
    omitted when empty, and names the router does not know are ignored."""

    TYPE: ClassVar[str] = "kv_events"
    replica: str
    event_seq: int | None
    reset: bool
    added: tuple[tuple[str | None, int | bytes], ...]
    removed: tuple[tuple[str | None, int | bytes], ...]
    counts: tuple[tuple[str, int], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d = {"replica": self.replica, "event_seq": self.event_seq, "reset": self.reset,
             "added": [list(b) for b in self.added], "removed": [list(b) for b in self.removed]}
        if self.counts:
            d["counts"] = dict(self.counts)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KvEvents:
        p = cls.TYPE
        added = _field(d, p, "added", _tuple_of(_kv_block, MAX_KV_BLOCKS))
        removed = _field(d, p, "removed", _tuple_of(_kv_block, MAX_KV_BLOCKS))
        if len(added) + len(removed) > MAX_KV_BLOCKS:
            raise WireProtocolError(f"{p}: {len(added) + len(removed)} blocks, at most {MAX_KV_BLOCKS}")
        return cls(replica=_field(d, p, "replica", _bounded_str(MAX_ID, empty=False)),
                   event_seq=_field(d, p, "event_seq", _opt(_int)), reset=_field(d, p, "reset", _bool),
                   added=added, removed=removed, counts=_field(d, p, "counts", _kv_counts, ()))


@dataclass(frozen=True)
class Skipped:
    """Not a wire message: a well-formed frame (version, type and seq checked) that the receiver's
    gate turned away before decoding its fields (:class:`FrameDecoder`'s `gate`); `why` is the
    gate's, `replica` what a kv_events frame named (None if it named no string)."""

    TYPE: ClassVar[str] = "skipped"
    type: str
    why: str
    replica: str | None = None
    blocks: int = 0


# (message type, the replica a kv_events frame names or None, its blocks) -> turned away, or None
Gate = Callable[[str, "str | None", int], "Skipped | None"]

Message = Hello | Heartbeat | EngineUpdate | Bye | Welcome | Refused | Desired | ReportRejected | KvEvents | Routers
MESSAGE_TYPES: dict[str, type[Message]] = {
    c.TYPE: c for c in (Hello, Heartbeat, EngineUpdate, Bye, Welcome, Refused, Desired, ReportRejected, KvEvents,
                        Routers)}
FROM_AGENT = frozenset({Hello.TYPE, Heartbeat.TYPE, EngineUpdate.TYPE, Bye.TYPE,  # what a router accepts
                        KvEvents.TYPE})
FROM_ROUTER = frozenset({Welcome.TYPE, Refused.TYPE, Desired.TYPE, Heartbeat.TYPE,  # what an agent accepts
                         ReportRejected.TYPE, Routers.TYPE})


# --------------------------------------------------------------------------- frames

def encode(msg: Message, seq: int, *, max_frame: int = MAX_FRAME) -> bytes:
    """The whole frame for `msg`, length prefix included.

    Raises ValueError for a frame the peer would refuse (over `max_frame`) or a seq < 1:
    both are the sender's bugs, not the peer's.
    """
    if type(seq) is not int or seq < 1:
        raise ValueError(f"seq must be an int >= 1, got {seq!r}")
    body = msgpack.packb({"v": PROTOCOL_VERSION, "t": msg.TYPE, "seq": seq, **msg.to_dict()}, use_bin_type=True)
    if len(body) > max_frame:
        raise ValueError(f"{msg.TYPE} frame of {len(body)} bytes exceeds the {max_frame} byte limit")
    return len(body).to_bytes(4, "big") + body


class FrameDecoder:
    """Incremental decoder of the frames one peer sends.

        d = FrameDecoder()
        for msg in d.feed(data):   # bytes as they come; 0..n complete messages
            ...

    ``feed`` raises :class:`WireProtocolError` for anything malformed, and for a frame over
    `max_frame` as soon as its length prefix arrives.  `accept`, if given, is the set of
    message types this side may receive (:data:`FROM_AGENT` / :data:`FROM_ROUTER`).  After
    an error the decoder is unusable (every later ``feed`` raises again), and messages
    decoded earlier in the same ``feed`` call are lost with it: close the connection.

    `gate` (settable any time) sees each frame's head — type, the replica a kv_events frame
    names, its block count (:func:`llmgw.fleet.wire_peek.peek_frame`, which skips the blocks
    without building them) — once its version, type and seq are checked, before the frame is
    parsed and decoded: returning a :class:`Skipped` yields that instead (the seq still counts),
    so a receiver turns a flood away for about a tenth of what decoding it would cost.
    """

    __slots__ = ("_accept", "_buf", "_error", "_max_frame", "gate", "last_seq")

    def __init__(self, *, max_frame: int = MAX_FRAME, accept: Collection[str] | None = None,
                 gate: Gate | None = None) -> None:
        self.gate = gate
        self._buf = bytearray()
        self._max_frame = max_frame
        self._accept = frozenset(MESSAGE_TYPES if accept is None else accept)
        self._error: WireProtocolError | None = None
        self.last_seq = 0  # seq of the last message decoded; 0 before the first

    @property
    def max_frame(self) -> int:
        return self._max_frame

    @max_frame.setter
    def max_frame(self, value: int) -> None:
        """Change the frame cap, e.g. from the small pre-authentication one to the configured one
        once a hello is accepted; it applies from the next frame header."""
        self._max_frame = value

    @property
    def buffered(self) -> int:
        """Bytes of an incomplete frame held (non-zero at EOF: the peer stopped mid-frame)."""
        return len(self._buf)

    def feed(self, data: bytes | bytearray | memoryview) -> list[Message | Skipped]:
        if self._error is not None:
            raise self._error
        try:
            return self._feed(data)
        except WireProtocolError as e:
            self._error = e
            raise

    def _feed(self, data: bytes | bytearray | memoryview) -> list[Message | Skipped]:
        buf = self._buf
        buf += data
        out: list[Message | Skipped] = []
        pos, end = 0, len(buf)
        while end - pos >= 4:
            n = int.from_bytes(buf[pos:pos + 4], "big")
            if n > self._max_frame:  # before buffering it: a hostile prefix can claim 4 GiB
                raise WireProtocolError(f"frame of {n} bytes exceeds the {self._max_frame} byte limit")
            if end - pos - 4 < n:
                break
            out.append(self._message(buf[pos + 4:pos + 4 + n]))
            pos += 4 + n
        del buf[:pos]
        return out

    def _message(self, body: bytearray) -> Message | Skipped:
        if self.gate is not None and (head := peek_frame(body)) is not None and type(head.t) is str \
                and head.t in self._accept and type(head.v) is int and head.v in SUPPORTED_VERSIONS \
                and type(head.seq) is int and head.seq == self.last_seq + 1 \
                and (skipped := self.gate(head.t, head.replica, head.blocks)) is not None:
            self.last_seq = head.seq
            return skipped
        try:
            obj = msgpack.unpackb(body, raw=False, strict_map_key=True)
        except Exception as e:  # noqa: BLE001 — msgpack raises a zoo: ExtraData, UnpackValueError, ValueError, TypeError ...
            raise WireProtocolError(f"not a msgpack document: {type(e).__name__}: {e}") from None
        if type(obj) is not dict:
            raise WireProtocolError(f"expected a map, got {type(obj).__name__}")
        v = obj.get("v")
        if type(v) is not int or v not in SUPPORTED_VERSIONS:
            raise WireProtocolError(f"unsupported protocol version {_short.repr(v)} "
                                f"(supported: {', '.join(map(str, sorted(SUPPORTED_VERSIONS)))})")
        t = obj.get("t")
        cls = MESSAGE_TYPES.get(t) if type(t) is str else None
        if cls is None:
            raise WireProtocolError(f"unknown message type {_short.repr(t)}")
        if t not in self._accept:
            raise WireProtocolError(f"unexpected {t} message (accepted here: {', '.join(sorted(self._accept))})")
        seq = _field(obj, t, "seq", _int)
        if seq != self.last_seq + 1:
            raise WireProtocolError(f"{t}.seq: {seq} after {self.last_seq}, expected {self.last_seq + 1}")
        msg = cls.from_dict(obj)
        self.last_seq = seq
        return msg
