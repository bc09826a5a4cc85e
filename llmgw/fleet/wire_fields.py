"""The field checks of the agent stream's messages (llmgw.fleet.wire): each turns a decoded msgpack
value into the typed field, or raises :class:`WireProtocolError` naming the field's path
(``hello.engines[2].state: expected str, got int``). Also the nested decoders of engine specs,
engine reports and node facts, and the bounds they enforce."""

from __future__ import annotations

import reprlib
from collections.abc import Callable
from typing import Any

from llmgw.fleet.types import (
    ENGINE_STATES,
    EngineReport,
    EngineSpec,
    GpuInfo,
    GroupLaunch,
    LoraLaunch,
    NodeFacts,
    RouterAddr,
)

MAX_NAME = 253  # a DNS name: node names and label keys
MAX_LABEL_VALUE = 1024
MAX_LABELS = 256
MAX_ENGINES = 4096  # per message
MAX_LOG_LINES = 50  # log_tail beyond these is cut on decode, not refused
MAX_LOG_LINE = 500
MAX_SECRET = 1024  # a join token or node credential, in chars
MAX_ID = 256  # agent and router ids
MAX_FEATURES = 32
MAX_REASON = 4096  # refusals, rejections, bye reasons: read by people, so cut rather than refused
MAX_KV_BLOCKS = 8192  # block hashes (added + removed) in one kv_events message
MAX_KV_HASH_BYTES = 64  # a block hash as bytes (vLLM's sha256 digests are 32)
MAX_KV_MEDIUM = 32  # a storage medium's name ("GPU", "CPU" ...)
MAX_KV_COUNTS = 32  # named counters in one kv_events message
MAX_KV_COUNT_NAME = 64
MAX_KV_COUNT = 1 << 32  # one counter's increment in one message
MAX_LORA_ADAPTERS = 1024  # adapters an engine spec loads at start
MAX_LORA_TEXT = 4096  # an adapter's name or source, in chars
MAX_GROUP_NODES = 64  # nodes of one multi-node replica
MAX_ROLE = 32  # an engine spec's prefill/decode role ("prefill", "decode"; a newer router may say more)
MAX_PEER = MAX_NAME + 8  # a worker's address, host:port
MAX_ROUTERS = 64  # routers one welcome or `routers` message lists
MAX_PEM = 16 << 10  # a router's CA certificate (PEM) in a routers list, in chars
MAX_EPOCH = (1 << 63) - 1  # a leadership epoch (the store's BIGINT)


class WireProtocolError(Exception):
    """The peer broke the agent ↔ router stream's protocol (a malformed frame or message, a
    message type not accepted here, a sequence gap): the connection is unusable after it.
    Not HTTP's :class:`llmgw.http1.errors.ProtocolError`."""


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


def _reason(v: Any, path: str) -> str:
    return _str(v, path)[:MAX_REASON]


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
        generation=_field(d, path, "generation", _int, 0), kv_events=_field(d, path, "kv_events", _bool, False),
        lora=_field(d, path, "lora", _opt(_lora), None), group=_field(d, path, "group", _opt(_group), None),
        role=_field(d, path, "role", _bounded_str(MAX_ROLE), ""))


def _peer(v: Any, path: str) -> str:
    s = _bounded_str(MAX_PEER, empty=False)(v, path)
    host, sep, port = s.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or any(c in s for c in " ,/@\\"):
        raise WireProtocolError(f"{path}: expected host:port, got {_short.repr(v)}")
    return s


def _group(v: Any, path: str) -> GroupLaunch:
    d = _map(v, path)
    role = _field(d, path, "role", _str)
    if role not in ("head", "worker"):
        raise WireProtocolError(f"{path}.role: expected head or worker, got {_short.repr(role)}")
    size = _field(d, path, "size", _count(MAX_GROUP_NODES))
    rank = _field(d, path, "rank", _count(MAX_GROUP_NODES))
    if size < 2 or rank >= size or (rank == 0) != (role == "head"):
        raise WireProtocolError(f"{path}: rank {rank} of {size} does not fit role {role}")
    peers = _field(d, path, "peers", _tuple_of(_peer, MAX_GROUP_NODES), ())
    # A head is told its workers (llama.cpp); a worker its head (vLLM's Ray head).
    if peers and (len(peers) != size - 1 if role == "head" else len(peers) != 1):
        want = f"a head of {size} nodes has {size - 1}" if role == "head" else "a worker has 1 (its head)"
        raise WireProtocolError(f"{path}.peers: {len(peers)} given, {want}")
    return GroupLaunch(role=role, group=_field(d, path, "group", _bounded_str(MAX_NAME * 2, empty=False)),
                       rank=rank, size=size, peers=peers)


def _lora_pair(v: Any, path: str) -> tuple[str, str]:
    if type(v) is not list or len(v) != 2:
        raise WireProtocolError(f"{path}: expected a [name, source] pair, got {_short.repr(v)}")
    text = _bounded_str(MAX_LORA_TEXT, empty=False)
    return text(v[0], f"{path}[0]"), text(v[1], f"{path}[1]")


def _count(most: int) -> _Check:
    def check(v: Any, path: str) -> int:
        if not 0 <= _int(v, path) <= most:
            raise WireProtocolError(f"{path}: {v} is not in 0..{most}")
        return v
    return check


def _port(v: Any, path: str) -> int:
    if not 0 < _int(v, path) < 65536:
        raise WireProtocolError(f"{path}: {v} is not a TCP port (1..65535)")
    return v


def _lora(v: Any, path: str) -> LoraLaunch:
    d = _map(v, path)
    return LoraLaunch(max_loras=_field(d, path, "max_loras", _count(MAX_LORA_ADAPTERS), 0),
                      max_rank=_field(d, path, "max_rank", _count(1 << 16), 0),
                      adapters=_field(d, path, "adapters", _tuple_of(_lora_pair, MAX_LORA_ADAPTERS), ()))


def _report(v: Any, path: str) -> EngineReport:
    d = _map(v, path)
    return EngineReport(
        replica=_field(d, path, "replica", _str), model=_field(d, path, "model", _str),
        state=_field(d, path, "state", _state), spec_hash=_field(d, path, "spec_hash", _str, ""),
        generation=_field(d, path, "generation", _int, 0), url=_field(d, path, "url", _opt(_str), None),
        pid=_field(d, path, "pid", _opt(_int), None), restarts=_field(d, path, "restarts", _int, 0),
        detail=_field(d, path, "detail", _str, ""), log_tail=_field(d, path, "log_tail", _log_tail, ()),
        adopted=_field(d, path, "adopted", _bool, False),
        kv_endpoint=_field(d, path, "kv_endpoint", _opt(_str), None),
        kv_replay=_field(d, path, "kv_replay", _opt(_str), None),
        group_port=_field(d, path, "group_port", _opt(_port), None), spec=_field(d, path, "spec", _opt(_spec), None))


def _gpu(v: Any, path: str) -> GpuInfo:
    d = _map(v, path)
    return GpuInfo(index=_field(d, path, "index", _int), name=_field(d, path, "name", _str, ""),
                   memory_mb=_field(d, path, "memory_mb", _int, 0))


def _facts(v: Any, path: str) -> NodeFacts:
    d = _map(v, path)
    return NodeFacts(cpus=_field(d, path, "cpus", _int, 0), memory_mb=_field(d, path, "memory_mb", _int, 0),
                     gpus=_field(d, path, "gpus", _tuple_of(_gpu), ()),
                     hostname=_field(d, path, "hostname", _str, ""),
                     agent_version=_field(d, path, "agent_version", _str, ""),
                     # power: a bad figure is the placement's to judge (ignored with a warning), not a
                     # protocol error; only its type is checked here
                     declared_watts=_field(d, path, "declared_watts", _int, 0),
                     measured_watts=_field(d, path, "measured_watts", _opt(_float), None))


def _epoch(v: Any, path: str) -> int:
    if not 0 <= _int(v, path) <= MAX_EPOCH:
        raise WireProtocolError(f"{path}: {v} is not in 0..{MAX_EPOCH}")
    return v


_PEM_BEGIN = "-----BEGIN CERTIFICATE-----"


def _router_addr(v: Any, path: str) -> RouterAddr:
    d = _map(v, path)
    ca = _field(d, path, "ca_pem", _bounded_str(MAX_PEM), "")
    if ca and _PEM_BEGIN not in ca:
        raise WireProtocolError(f"{path}.ca_pem: not a PEM certificate (no {_PEM_BEGIN} line)")
    return RouterAddr(id=_field(d, path, "id", _bounded_str(MAX_ID, empty=False)),
                      control=_field(d, path, "control", _peer), ca_pem=ca,
                      server_name=_field(d, path, "server_name", _bounded_str(MAX_NAME), ""))


def _routers(v: Any, path: str) -> tuple[RouterAddr, ...]:
    """A routers list: at most MAX_ROUTERS, each id once."""
    out = _tuple_of(_router_addr, MAX_ROUTERS)(v, path)
    seen: set[str] = set()
    for i, r in enumerate(out):
        if r.id in seen:
            raise WireProtocolError(f"{path}[{i}].id: {_short.repr(r.id)} is listed twice")
        seen.add(r.id)
    return out


def _kv_block(v: Any, path: str) -> tuple[str | None, int | bytes]:
    """One block of a kv_events message: ``[medium or None, hash]``; the hash an int (vLLM's
    64-bit hashes) or bytes of at most MAX_KV_HASH_BYTES."""
    if type(v) is not list or len(v) != 2:
        raise WireProtocolError(f"{path}: expected a [medium, hash] pair, got {_short.repr(v)}")
    medium, h = v
    if medium is not None:
        _bounded_str(MAX_KV_MEDIUM)(medium, f"{path}[0]")
    if type(h) is bytes:
        if len(h) > MAX_KV_HASH_BYTES:
            raise WireProtocolError(f"{path}[1]: a hash of {len(h)} bytes, at most {MAX_KV_HASH_BYTES}")
    elif type(h) is not int:
        raise _expected("int or bytes", h, f"{path}[1]")
    return medium, h


def _kv_counts(v: Any, path: str) -> tuple[tuple[str, int], ...]:
    """A kv_events message's counter increments: ``{name: n}``, n in [0, MAX_KV_COUNT], at most
    MAX_KV_COUNTS names (the receiver ignores names it does not know)."""
    d = _map(v, path)
    if len(d) > MAX_KV_COUNTS:
        raise WireProtocolError(f"{path}: {len(d)} counters, at most {MAX_KV_COUNTS}")
    out = []
    for k, n in d.items():
        _bounded_str(MAX_KV_COUNT_NAME, empty=False)(k, f"{path} key")
        _int(n, f"{path}.{k}")
        if not 0 <= n <= MAX_KV_COUNT:
            raise WireProtocolError(f"{path}.{k}: {n} is not in [0, {MAX_KV_COUNT}]")
        out.append((k, n))
    return tuple(sorted(out))
