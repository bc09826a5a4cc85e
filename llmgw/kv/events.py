"""vLLM KV-cache event wire format as a pure codec (bytes in, events out; no I/O).

Spec: the shared vLLM wire notes (vllm-wire.md) §1. vLLM encodes ``KVEventBatch`` with
msgspec; :func:`encode_batch` reproduces those bytes exactly with the ``msgpack``
package for any release, and :func:`decode_batch` reads every release's layout.
ZMQ framing helpers build/parse the frames only; sockets live elsewhere.
"""

from __future__ import annotations

import reprlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgpack

from llmgw.kv.hashing import VersionLike, VllmVersion, as_version

__all__ = [
    "KVEventDecodeError", "ExternalBlockHash",
    "BlockStored", "BlockRemoved", "AllBlocksCleared", "UnknownEvent", "KVEvent", "EventBatch",
    "event_fields", "encode_batch", "decode_batch",
    "REPLAY_END_SEQ", "pub_frames", "parse_pub_frames", "replay_request_frames",
    "parse_replay_request", "replay_reply_frames", "replay_end_frames", "parse_replay_reply",
]

MAP_EVENTS_SINCE = VllmVersion(0, 24, 0)  # PR #42892 dropped array_like from KVCacheEvent
REPLAY_TOPIC_SINCE = VllmVersion(0, 26, 0)  # replay replies gained the topic frame


class KVEventDecodeError(ValueError):
    """Malformed KV event payload or frames. The only error the decoders raise."""


ExternalBlockHash = int | bytes  # uint64 (default), raw digest, or signed int64 (0.10.0/0.10.1)


# --------------------------------------------------------------------------- events
# Field order is vLLM 0.33's declaration order; older releases have a prefix of it.
# Fields without a default here have none in vLLM either (always on the wire).

@dataclass(slots=True)
class BlockStored:
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None  # one entry (tuple or None) per block
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


@dataclass(slots=True)
class AllBlocksCleared:
    pass


@dataclass(slots=True)
class UnknownEvent:
    """An event type this codec doesn't know (a newer vLLM); kept so nothing is lost."""

    type: str
    raw: Any


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared | UnknownEvent


@dataclass(slots=True)
class EventBatch:
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


class _Field(NamedTuple):
    name: str
    since: VllmVersion
    has_default: bool  # in vLLM's struct: omitted from maps when it equals None
    check: Callable[[Any], Any]  # decoder: validate/normalise a wire value


# --------------------------------------------------------------------------- value checks

_short = reprlib.Repr()  # attributes, not kwargs: Repr(**kw) is 3.12+
_short.maxlevel, _short.maxlist, _short.maxdict, _short.maxstring, _short.maxother = 2, 4, 4, 40, 40


def _bad(what: str, value: Any) -> KVEventDecodeError:
    # reprlib: bounded size and depth, so hostile input can't make the message itself fail
    return KVEventDecodeError(f"bad {what}: {_short.repr(value)}")


def _int(v: Any) -> int:
    if type(v) is not int:  # bool is an int subclass but never a valid value here
        raise _bad("integer", v)
    return v


def _opt(check: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda v: None if v is None else check(v)


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise _bad("string", v)
    return v


def _hash(v: Any) -> ExternalBlockHash:
    if isinstance(v, bytes):
        return v
    return _int(v)


def _list_of(check: Callable[[Any], Any]) -> Callable[[Any], list[Any]]:
    def run(v: Any) -> list[Any]:
        if not isinstance(v, list):
            raise _bad("array", v)
        return [check(x) for x in v]
    return run


def _tuples(v: Any) -> Any:
    # vLLM's extra keys are tuples; msgpack arrays decode as lists.
    return tuple(_tuples(x) for x in v) if isinstance(v, list) else v


_V0 = VllmVersion(0, 10, 0)
_STORED_FIELDS = (
    _Field("block_hashes", _V0, False, _list_of(_hash)),
    _Field("parent_block_hash", _V0, False, _opt(_hash)),
    _Field("token_ids", _V0, False, _list_of(_int)),
    _Field("block_size", _V0, False, _int),
    _Field("lora_id", _V0, False, _opt(_int)),
    _Field("medium", VllmVersion(0, 10, 2), False, _opt(_str)),
    _Field("lora_name", VllmVersion(0, 14, 0), False, _opt(_str)),
    _Field("extra_keys", VllmVersion(0, 17, 0), True, _opt(_list_of(_tuples))),
    _Field("group_idx", VllmVersion(0, 20, 0), True, _opt(_int)),
    _Field("kv_cache_spec_kind", VllmVersion(0, 22, 0), True, _opt(_str)),
    _Field("kv_cache_spec_sliding_window", VllmVersion(0, 22, 0), True, _opt(_int)),
    _Field("locality", VllmVersion(0, 26, 0), True, _opt(_str)),
    _Field("ownership", VllmVersion(0, 29, 0), True, _opt(_str)),
    _Field("session_id", VllmVersion(0, 30, 0), True, _opt(_str)),
    _Field("lookahead_token_ids", VllmVersion(0, 33, 0), True, _opt(_list_of(_list_of(_int)))),
)
_REMOVED_FIELDS = (
    _Field("block_hashes", _V0, False, _list_of(_hash)),
    _Field("medium", VllmVersion(0, 10, 2), False, _opt(_str)),
    _Field("group_idx", VllmVersion(0, 20, 0), True, _opt(_int)),
    _Field("locality", VllmVersion(0, 26, 0), True, _opt(_str)),
    _Field("ownership", VllmVersion(0, 29, 0), True, _opt(_str)),
)
_FIELDS: dict[type, tuple[_Field, ...]] = {
    BlockStored: _STORED_FIELDS, BlockRemoved: _REMOVED_FIELDS, AllBlocksCleared: (),
}
_BY_TAG: dict[str, type] = {cls.__name__: cls for cls in _FIELDS}  # msgspec tag = class name
# Decoding can't do without these; any other absent field decodes as None.
_REQUIRED = frozenset({"block_hashes", "token_ids", "block_size"})


def _fields(cls: type, v: VllmVersion) -> tuple[_Field, ...]:
    return tuple(f for f in _FIELDS[cls] if f.since <= v)


def event_fields(cls: type, version: VersionLike) -> tuple[str, ...]:
    """Field names of an event type in a release, in wire order."""
    return tuple(f.name for f in _fields(cls, as_version(version)))


# --------------------------------------------------------------------------- encode

def _map_header(n: int, declared: int) -> bytes:
    # msgspec sizes a struct's map header by its *declared* field count (tag
    # included) before omitting defaults: fixmap below 16, else map16. So 0.33's
    # BlockStored (15 fields + tag) is always de00xx even with 8 keys present.
    if declared < 16:
        return bytes([0x80 | n])
    return b"\xde" + n.to_bytes(2, "big")


def _encode_event(ev: KVEvent, v: VllmVersion, packer: msgpack.Packer) -> bytes:
    cls = type(ev)
    if cls not in _FIELDS:
        raise TypeError(f"cannot encode {cls.__name__} as a vLLM KV event")
    fields = _fields(cls, v)
    tag = packer.pack(cls.__name__)
    if v < MAP_EVENTS_SINCE:
        # array_like ignores omit_defaults: every field of the release, trailing Nones too
        body = b"".join(packer.pack(getattr(ev, f.name)) for f in fields)
        return packer.pack_array_header(1 + len(fields)) + tag + body
    present = [f for f in fields if not (f.has_default and getattr(ev, f.name) is None)]
    body = b"".join(packer.pack(f.name) + packer.pack(getattr(ev, f.name)) for f in present)
    return _map_header(1 + len(present), 1 + len(fields)) + packer.pack("type") + tag + body


def encode_batch(batch: EventBatch, version: VersionLike) -> bytes:
    """Bytes identical to vLLM ``version``'s msgspec encoding of ``batch``.

    Fields the release doesn't have are dropped, whatever their value.
    """
    v = as_version(version)
    if v < _V0:
        raise ValueError(f"vLLM {v} predates KV events encoding support (0.10.0+)")
    packer = msgpack.Packer(use_bin_type=True, autoreset=True)  # float64, bin for bytes
    parts = [b"\x93", packer.pack(float(batch.ts)), packer.pack_array_header(len(batch.events))]
    parts += [_encode_event(ev, v, packer) for ev in batch.events]
    parts.append(packer.pack(batch.data_parallel_rank))  # array_like: always present
    return b"".join(parts)


# --------------------------------------------------------------------------- decode

def _decode_event(raw: Any) -> KVEvent:
    if isinstance(raw, list):  # <= 0.23: ["Tag", f1, f2, ...] by position
        if not raw or not isinstance(raw[0], str):
            raise _bad("array event tag", raw[:1])
        tag = raw[0]
        cls = _BY_TAG.get(tag)
        if cls is None:
            return UnknownEvent(tag, raw)
        fields = _FIELDS[cls]
        values = {f.name: x for f, x in zip(fields, raw[1:])}  # extra trailing items ignored
    elif isinstance(raw, dict):  # >= 0.24: {"type": "Tag", name: value, ...}
        tag = raw.get("type")
        if not isinstance(tag, str):
            raise _bad("map event tag", tag)
        cls = _BY_TAG.get(tag)
        if cls is None:
            return UnknownEvent(tag, raw)
        fields = _FIELDS[cls]
        values = raw  # unknown keys ignored
    else:
        raise _bad("event (expected array or map)", raw)
    kwargs: dict[str, Any] = {}
    for f in fields:
        if f.name in values:
            try:
                kwargs[f.name] = f.check(values[f.name])
            except KVEventDecodeError as e:
                raise KVEventDecodeError(f"{tag}.{f.name}: {e}") from None
        elif f.name in _REQUIRED:
            raise KVEventDecodeError(f"{tag} lacks required field {f.name!r}")
        else:
            kwargs[f.name] = None
    return cls(**kwargs)


def decode_batch(payload: bytes) -> EventBatch:
    """Decode a KVEventBatch from any vLLM release (0.10 → 0.33, and tolerant of newer).

    Raises only :class:`KVEventDecodeError`.
    """
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises a zoo: ValueError subclasses, TypeError, ...
        raise KVEventDecodeError(f"not a msgpack document: {type(e).__name__}: {e}") from None
    try:
        return _decode_batch_obj(obj)
    except RecursionError:  # absurdly nested values (msgpack allows ~1000 levels)
        raise KVEventDecodeError("msgpack nesting too deep") from None


def _decode_batch_obj(obj: Any) -> EventBatch:
    if not isinstance(obj, list) or len(obj) < 2:
        raise _bad("batch (expected [ts, events, dp_rank])", obj)
    ts, events = obj[0], obj[1]
    if type(ts) not in (float, int):
        raise _bad("batch ts", ts)
    if not isinstance(events, list):
        raise _bad("batch events", events)
    dp = obj[2] if len(obj) > 2 else None  # extra trailing items ignored
    if dp is not None and type(dp) is not int:
        raise _bad("batch data_parallel_rank", dp)
    return EventBatch(float(ts), [_decode_event(e) for e in events], dp)


# --------------------------------------------------------------------------- ZMQ frames

REPLAY_END_SEQ = -1  # vLLM's END_SEQ is (-1).to_bytes(8, "big", signed=True)
_END_SEQ_BYTES = b"\xff" * 8


def _seq8(seq: int) -> bytes:
    return seq.to_bytes(8, "big")  # unsigned; itertools.count() never goes negative


def pub_frames(topic: str, seq: int, payload: bytes) -> list[bytes]:
    """The 3 frames vLLM's PUB socket sends per batch."""
    return [topic.encode(), _seq8(seq), payload]


def parse_pub_frames(frames: Sequence[bytes]) -> tuple[str, int, bytes]:
    """(topic, seq, payload) of a SUB message; raises KVEventDecodeError."""
    if len(frames) != 3 or len(frames[1]) != 8:
        raise KVEventDecodeError(f"expected [topic, seq8, payload], got {len(frames)} frames")
    try:
        topic = bytes(frames[0]).decode()
    except UnicodeDecodeError:
        raise _bad("topic", frames[0]) from None
    return topic, int.from_bytes(frames[1], "big"), bytes(frames[2])


def replay_request_frames(start_seq: int) -> list[bytes]:
    """What a DEALER sends to ask for every buffered batch with seq >= start_seq."""
    return [b"", _seq8(start_seq)]


def parse_replay_request(frames: Sequence[bytes]) -> int | None:
    """Start seq from a ROUTER-side request ``[identity, b"", start_seq8]``.

    Mirrors vLLM exactly: only the frame count is checked (else None, which vLLM
    logs and ignores); the seq is ``int.from_bytes(frame, "big")`` of any length.
    """
    if len(frames) != 3:
        return None
    return int.from_bytes(frames[2], "big")


def replay_reply_frames(topic: str, seq: int, payload: bytes,
                        version: VersionLike) -> list[bytes]:
    """One replayed batch as a DEALER sees it (the ROUTER prepends the identity)."""
    if as_version(version) >= REPLAY_TOPIC_SINCE:
        return [b"", topic.encode(), _seq8(seq), payload]
    return [b"", _seq8(seq), payload]


def replay_end_frames(version: VersionLike) -> list[bytes]:
    """The end-of-replay marker as a DEALER sees it (its topic frame is always empty)."""
    if as_version(version) >= REPLAY_TOPIC_SINCE:
        return [b"", b"", _END_SEQ_BYTES, b""]
    return [b"", _END_SEQ_BYTES, b""]


def parse_replay_reply(frames: Sequence[bytes]) -> tuple[int, bytes] | None:
    """(seq, payload) of a replayed batch, or None for the end marker.

    Accepts both layouts (with the 0.26+ topic frame and without).
    """
    if len(frames) not in (3, 4) or frames[0] != b"":
        raise KVEventDecodeError(f"bad replay reply: {len(frames)} frames")
    seq, payload = frames[-2], frames[-1]
    if len(seq) != 8:
        raise _bad("replay seq frame", seq)
    if seq == _END_SEQ_BYTES:
        return None
    return int.from_bytes(seq, "big"), bytes(payload)
