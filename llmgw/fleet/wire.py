"""The agent ↔ router control stream's wire format, as a pure codec (bytes in, messages out).

A frame is a 4-byte big-endian length, then that many bytes of msgpack: one map
``{"v": 1, "t": TYPE, "seq": n, ...fields}``.  Each side numbers the messages it sends
from 1 and the receiver insists on exactly +1 each time, so a lost, repeated or reordered
message is an error, not a silent gap.

Decoding is strict and cheap: hand-written checks per field, every failure a
:class:`WireProtocolError` naming the field (``hello.engines[2].state: expected str, got int``).
Unknown keys are ignored (a newer peer may add fields); unknown message types are not.
Fields of the nested EngineSpec / EngineReport / NodeFacts that have defaults may be
absent; every field of a message itself is required.  ``NodeFacts.extra`` is not carried
(``NodeFacts.to_wire`` leaves it out).
"""

from __future__ import annotations

import reprlib
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, ClassVar

import msgpack

from llmgw.fleet.types import (
    ENGINE_STATES,
    EngineReport,
    EngineSpec,
    GpuInfo,
    NodeFacts,
)

__all__ = [
    "FROM_AGENT",
    "FROM_ROUTER",
    "MAX_FRAME",
    "MESSAGE_TYPES",
    "PROTOCOL_VERSION",
    "SUPPORTED_VERSIONS",
    "Bye",
    "Desired",
    "EngineUpdate",
    "FrameDecoder",
    "Heartbeat",
    "Hello",
    "Message",
    "Refused",
    "Welcome",
    "WireProtocolError",
    "encode",
]

PROTOCOL_VERSION = 1
SUPPORTED_VERSIONS = frozenset({PROTOCOL_VERSION})
MAX_FRAME = 4 << 20  # msgpack bytes of one frame, the length prefix not counted

MAX_NAME = 253  # a DNS name: node names and label keys
MAX_LABEL_VALUE = 1024
MAX_LABELS = 256
MAX_ENGINES = 4096  # per message
MAX_LOG_LINES = 50  # log_tail beyond these is cut on decode, not refused
MAX_LOG_LINE = 500


class WireProtocolError(Exception):
    """The peer broke the agent ↔ router stream's protocol (a malformed frame or message, a
    message type not accepted here, a sequence gap): the connection is unusable after it.
    Not HTTP's :class:`llmgw.http1.errors.ProtocolError`."""


# --------------------------------------------------------------------------- field checks
# A check is check(value, path) -> normalised value; `path` names the field for errors.

_Check = Callable[[Any, str], Any]
_REQUIRED: Any = object()

_short = reprlib.Repr()  # attributes, not kwargs: Repr(**kw) is 3.12+
_short.maxlevel, _short.maxlist, _short.maxdict, _short.maxstring, _short.maxother = 2, 4, 4, 40, 40


def _expected(what: str, v: Any, path: str) -> WireProtocolError:
    return WireProtocolError(f"{path}: expected {what}, got {type(v).__name__}")


def _field(d: dict[str, Any], path: str, key: str, check: _Check, default: Any = _REQUIRED) -> Any:
    try:
        v = d[key]
    except KeyError:
        if default is _REQUIRED:
            raise WireProtocolError(f"{path}.{key}: missing") from None
        return default
    return check(v, f"{path}.{key}")


def _str(v: Any, path: str) -> str:
    if type(v) is not str:
        raise _expected("str", v, path)
    return v


def _bounded_str(most: int, *, empty: bool = True) -> _Check:
    def check(v: Any, path: str) -> str:
        if type(v) is not str:
            raise _expected("str", v, path)
        if len(v) > most:
            raise WireProtocolError(f"{path}: {len(v)} chars, at most {most}")
        if not v and not empty:
            raise WireProtocolError(f"{path}: empty")
        return v
    return check


_node_name = _bounded_str(MAX_NAME, empty=False)


def _int(v: Any, path: str) -> int:
    if type(v) is not int:  # bool is an int subclass but never a valid value here
        raise _expected("int", v, path)
    return v


def _float(v: Any, path: str) -> float:
    if type(v) is not float and type(v) is not int:
        raise _expected("float", v, path)
    return float(v)


def _positive(v: Any, path: str) -> float:
    f = _float(v, path)
    if not f > 0:  # NaN too
        raise WireProtocolError(f"{path}: {f} is not > 0")
    return f


def _bool(v: Any, path: str) -> bool:
    if type(v) is not bool:
        raise _expected("bool", v, path)
    return v


def _opt(check: _Check) -> _Check:
    return lambda v, path: None if v is None else check(v, path)


def _map(v: Any, path: str) -> dict[str, Any]:
    if type(v) is not dict:
        raise _expected("dict", v, path)
    return v


def _list(v: Any, path: str, most: int | None = None) -> list[Any]:
    if type(v) is not list:
        raise _expected("list", v, path)
    if most is not None and len(v) > most:
        raise WireProtocolError(f"{path}: {len(v)} items, at most {most}")
    return v


def _tuple_of(check: _Check, most: int | None = None) -> _Check:
    def run(v: Any, path: str) -> tuple[Any, ...]:
        return tuple(check(x, f"{path}[{i}]") for i, x in enumerate(_list(v, path, most)))
    return run


def _env_pair(v: Any, path: str) -> tuple[str, str]:
    if type(v) is not list or len(v) != 2:
        raise WireProtocolError(f"{path}: expected a [name, value] pair, got {_short.repr(v)}")
    return _str(v[0], f"{path}[0]"), _str(v[1], f"{path}[1]")


def _labels(v: Any, path: str) -> dict[str, str]:
    d = _map(v, path)
    if len(d) > MAX_LABELS:
        raise WireProtocolError(f"{path}: {len(d)} labels, at most {MAX_LABELS}")
    key, value = _bounded_str(MAX_NAME), _bounded_str(MAX_LABEL_VALUE)
    for k, x in d.items():
        key(k, f"{path} key {_short.repr(k)}")  # strict_map_key lets bytes keys through
        value(x, f"{path}[{k!r}]")
    return d


def _log_tail(v: Any, path: str) -> tuple[str, ...]:
    # An engine's dying words are useful but unbounded: keep the last lines, cut each one.
    lines = _list(v, path)
    skip = max(0, len(lines) - MAX_LOG_LINES)
    return tuple(_str(x, f"{path}[{skip + i}]")[:MAX_LOG_LINE] for i, x in enumerate(lines[skip:]))


def _state(v: Any, path: str) -> str:
    if _str(v, path) not in ENGINE_STATES:
        raise WireProtocolError(f"{path}: unknown engine state {_short.repr(v)}")
    return v


def _spec(v: Any, path: str) -> EngineSpec:
    d = _map(v, path)
    return EngineSpec(
        replica=_field(d, path, "replica", _str), model=_field(d, path, "model", _str),
        engine=_field(d, path, "engine", _str), model_path=_field(d, path, "model_path", _str),
        simulate=_field(d, path, "simulate", _bool, False), binary=_field(d, path, "binary", _opt(_str), None),
        args=_field(d, path, "args", _tuple_of(_str), ()), env=_field(d, path, "env", _tuple_of(_env_pair), ()),
        gpu_indices=_field(d, path, "gpu_indices", _tuple_of(_int), ()),
        health_timeout_s=_field(d, path, "health_timeout_s", _positive, 600.0),
        generation=_field(d, path, "generation", _int, 0))


def _report(v: Any, path: str) -> EngineReport:
    d = _map(v, path)
    return EngineReport(
        replica=_field(d, path, "replica", _str), model=_field(d, path, "model", _str),
        state=_field(d, path, "state", _state), spec_hash=_field(d, path, "spec_hash", _str, ""),
        generation=_field(d, path, "generation", _int, 0), url=_field(d, path, "url", _opt(_str), None),
        pid=_field(d, path, "pid", _opt(_int), None), restarts=_field(d, path, "restarts", _int, 0),
        detail=_field(d, path, "detail", _str, ""), log_tail=_field(d, path, "log_tail", _log_tail, ()),
        adopted=_field(d, path, "adopted", _bool, False), spec=_field(d, path, "spec", _opt(_spec), None))


def _gpu(v: Any, path: str) -> GpuInfo:
    d = _map(v, path)
    return GpuInfo(index=_field(d, path, "index", _int), name=_field(d, path, "name", _str, ""),
                   memory_mb=_field(d, path, "memory_mb", _int, 0))


def _facts(v: Any, path: str) -> NodeFacts:
    d = _map(v, path)
    return NodeFacts(cpus=_field(d, path, "cpus", _int, 0), memory_mb=_field(d, path, "memory_mb", _int, 0),
                     gpus=_field(d, path, "gpus", _tuple_of(_gpu), ()),
                     hostname=_field(d, path, "hostname", _str, ""),
                     agent_version=_field(d, path, "agent_version", _str, ""))


# --------------------------------------------------------------------------- messages
# to_dict: the message's own fields as plain msgpack-able data (no v/t/seq);
# from_dict: the strict inverse, raising WireProtocolError.

@dataclass(frozen=True)
class Hello:
    """agent → router, first: who I am, what I run. `agent_id` is random per agent process,
    so the router tells a restarted agent from a reconnecting one."""

    TYPE: ClassVar[str] = "hello"
    token: str
    node: str
    agent_id: str
    versions: tuple[int, ...]  # protocol versions the agent speaks
    labels: dict[str, str]
    facts: NodeFacts
    engines: tuple[EngineReport, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"token": self.token, "node": self.node, "agent_id": self.agent_id, "versions": list(self.versions),
                "labels": dict(self.labels), "facts": self.facts.to_wire(),
                "engines": [e.to_wire() for e in self.engines]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Hello:
        p = cls.TYPE
        return cls(token=_field(d, p, "token", _str), node=_field(d, p, "node", _node_name),
                   agent_id=_field(d, p, "agent_id", _str), versions=_field(d, p, "versions", _tuple_of(_int)),
                   labels=_field(d, p, "labels", _labels), facts=_field(d, p, "facts", _facts),
                   engines=_field(d, p, "engines", _tuple_of(_report, MAX_ENGINES)))


@dataclass(frozen=True)
class Heartbeat:
    """Either way: I'm alive (each side sends one every `Welcome.heartbeat_s`)."""

    TYPE: ClassVar[str] = "heartbeat"

    def to_dict(self) -> dict[str, Any]:
        return {}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Heartbeat:
        return cls()


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
        return cls(reason=_field(d, cls.TYPE, "reason", _str))


@dataclass(frozen=True)
class Welcome:
    """router → agent, the answer to a good Hello: the version chosen and the heartbeat period."""

    TYPE: ClassVar[str] = "welcome"
    node: str
    router_id: str
    version: int
    heartbeat_s: float

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "router_id": self.router_id, "version": self.version,
                "heartbeat_s": self.heartbeat_s}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Welcome:
        p = cls.TYPE
        return cls(node=_field(d, p, "node", _node_name), router_id=_field(d, p, "router_id", _str),
                   version=_field(d, p, "version", _int), heartbeat_s=_field(d, p, "heartbeat_s", _positive))


@dataclass(frozen=True)
class Refused:
    """router → agent, the answer to a bad Hello (token, version, node name taken ...); then close."""

    TYPE: ClassVar[str] = "refused"
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"reason": self.reason}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Refused:
        return cls(reason=_field(d, cls.TYPE, "reason", _str))


@dataclass(frozen=True)
class Desired:
    """router → agent: the full set of engines wanted on the node (absent ones are to stop).
    `rev` grows with every change, so the agent can say which one it has acted on."""

    TYPE: ClassVar[str] = "desired"
    rev: int
    engines: tuple[EngineSpec, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"rev": self.rev, "engines": [e.to_wire() for e in self.engines]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Desired:
        p = cls.TYPE
        return cls(rev=_field(d, p, "rev", _int), engines=_field(d, p, "engines", _tuple_of(_spec, MAX_ENGINES)))


Message = Hello | Heartbeat | EngineUpdate | Bye | Welcome | Refused | Desired
MESSAGE_TYPES: dict[str, type[Message]] = {
    c.TYPE: c for c in (Hello, Heartbeat, EngineUpdate, Bye, Welcome, Refused, Desired)}
FROM_AGENT = frozenset({Hello.TYPE, Heartbeat.TYPE, EngineUpdate.TYPE, Bye.TYPE})  # what a router accepts
FROM_ROUTER = frozenset({Welcome.TYPE, Refused.TYPE, Desired.TYPE, Heartbeat.TYPE})  # what an agent accepts


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
    """

    __slots__ = ("_accept", "_buf", "_error", "_max_frame", "last_seq")

    def __init__(self, *, max_frame: int = MAX_FRAME, accept: Collection[str] | None = None) -> None:
        self._buf = bytearray()
        self._max_frame = max_frame
        self._accept = frozenset(MESSAGE_TYPES if accept is None else accept)
        self._error: WireProtocolError | None = None
        self.last_seq = 0  # seq of the last message decoded; 0 before the first

    @property
    def buffered(self) -> int:
        """Bytes of an incomplete frame held (non-zero at EOF: the peer stopped mid-frame)."""
        return len(self._buf)

    def feed(self, data: bytes | bytearray | memoryview) -> list[Message]:
        if self._error is not None:
            raise self._error
        try:
            return self._feed(data)
        except WireProtocolError as e:
            self._error = e
            raise

    def _feed(self, data: bytes | bytearray | memoryview) -> list[Message]:
        buf = self._buf
        buf += data
        out: list[Message] = []
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

    def _message(self, body: bytearray) -> Message:
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
