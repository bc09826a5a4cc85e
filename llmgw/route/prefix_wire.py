"""The peer feed's message (routing as one): a batch of :class:`~.prefix_share.PrefixInsert`
from one router, as bytes and back. Pure; the shell (``llmgw.daemon.router.peer_feed``) moves
the bytes over ZeroMQ.

One message is one ZeroMQ frame::

    version (1 byte, 1) | MAC (32 bytes) | body (msgpack)

    body = {"s": sender router id, "i": incarnation (the sender's random 63-bit number for
            this run), "n": seq (1, 2, ... within the incarnation),
            "t": [[model, adapter|nil, cache_salt|nil, replica, head (bin), count], ...],
            "f": [[k, first block], ...]}   (optional)

    "f" gives insert k (its index in "t") its tier-2 first block hash (a uint64: the request's
    first KV block, PrefixInsert.first_block). It is a key of its own, not a 7th field of an
    insert, so a router that predates it decodes the message as before (it ignores the key).

    MAC  = HMAC-SHA256(key, version byte + body)   (key: the store's cluster_secret)

:func:`decode` checks, in this order and before any unpacking it can avoid: the size
(``oversize``), the layout and version (``malformed``, ``version``), the MAC (``bad_mac``,
compared in constant time), then the body's shape (``malformed``: any field of any insert out
of shape drops the whole message — it came from a router with the key, so it is a bug or a
version skew, not noise to salvage). It never raises.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Any

import msgpack

from .prefix_share import PrefixInsert

__all__ = ["VERSION", "MAC_BYTES", "MAX_MESSAGE_BYTES", "FeedMessage", "encode", "decode",
           "insert_bytes", "overhead_bytes", "DROP_REASONS"]

VERSION = 1
MAC_BYTES = 32
MAX_MESSAGE_BYTES = 1 << 20  # a message's cap (the receiver drops larger ones)
MAX_NAME = 1024  # characters of a sender, model, adapter, salt or replica id
# Why a received message is dropped whole (the receiver's counts; ``decode`` gives the first four).
DROP_REASONS = ("oversize", "malformed", "version", "bad_mac", "own", "unknown_peer", "replay")
_VERSION_BYTE = bytes([VERSION])


@dataclass(frozen=True, slots=True)
class FeedMessage:
    sender: str
    incarnation: int
    seq: int
    inserts: list[PrefixInsert]


def insert_bytes(ins: PrefixInsert) -> int:
    """An upper bound of the insert's share of a message body (msgpack: a header of at most 5
    bytes a field, at most 4 bytes a character)."""
    return len(ins.head) + 4 * (len(ins.model) + len(ins.replica) + len(ins.adapter or "")
                                + len(ins.salt or "")) + 40 + (0 if ins.first_block is None else 16)


def overhead_bytes(sender: str) -> int:
    """An upper bound of a message's bytes besides its inserts'."""
    return 1 + MAC_BYTES + 40 + 4 * len(sender)


def encode(key: bytes, sender: str, incarnation: int, seq: int, inserts: list[PrefixInsert]) -> bytes:
    d: dict[str, Any] = {"s": sender, "i": incarnation, "n": seq,
                         "t": [[i.model, i.adapter, i.salt, i.replica, i.head, i.count] for i in inserts]}
    firsts = [[k, i.first_block] for k, i in enumerate(inserts) if i.first_block is not None]
    if firsts:
        d["f"] = firsts
    body = msgpack.packb(d, use_bin_type=True)
    return _VERSION_BYTE + hmac.digest(key, _VERSION_BYTE + body, "sha256") + body


def decode(key: bytes, frame: bytes, *, max_bytes: int = MAX_MESSAGE_BYTES) -> FeedMessage | str:
    """The message, or why it is dropped (one of the first four :data:`DROP_REASONS`)."""
    if len(frame) > max_bytes:
        return "oversize"
    if len(frame) <= 1 + MAC_BYTES:
        return "malformed"
    if frame[0] != VERSION:
        return "version"
    body = frame[1 + MAC_BYTES:]
    mac = hmac.digest(key, frame[:1] + body, "sha256")
    if not hmac.compare_digest(mac, frame[1:1 + MAC_BYTES]):
        return "bad_mac"
    try:
        d = msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True)
        return _shape(d)
    except Exception:  # noqa: BLE001 — msgpack raises a zoo of types; all mean "malformed"
        return "malformed"


def _name(v: Any, *, optional: bool = False) -> str | None:
    if v is None and optional:
        return None
    if type(v) is not str or not v or len(v) > MAX_NAME:
        raise ValueError("not a name")
    return v


def _int(v: Any, lo: int, hi: int) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise ValueError("not an integer in range")
    return v


def _shape(d: Any) -> FeedMessage | str:
    if type(d) is not dict:
        return "malformed"
    ts = d.get("t")
    if type(ts) is not list:
        return "malformed"
    out: list[PrefixInsert] = []
    for t in ts:
        if type(t) is not list or len(t) != 6 or type(t[4]) is not bytes or not t[4]:
            return "malformed"
        out.append(PrefixInsert(_name(t[0]), _name(t[1], optional=True), _name(t[2], optional=True),  # type: ignore[arg-type]
                                _name(t[3]), t[4], _int(t[5], 1, 1 << 31)))  # type: ignore[arg-type]
    fs = d.get("f")
    if fs is not None:
        if type(fs) is not list:
            return "malformed"
        for f in fs:
            if type(f) is not list or len(f) != 2:
                return "malformed"
            k = _int(f[0], 0, len(out) - 1)
            out[k] = out[k]._replace(first_block=_int(f[1], 0, (1 << 64) - 1))
    return FeedMessage(_name(d.get("s")), _int(d.get("i"), 0, (1 << 63) - 1),  # type: ignore[arg-type]
                       _int(d.get("n"), 1, (1 << 63) - 1), out)
