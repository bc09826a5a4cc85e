"""The usage tap: what an engine says a request used, read from the answer as it is relayed.

- A non-streamed answer carries ``usage`` in its JSON body (vLLM and llama.cpp alike, and
  ``/v1/embeddings``): :class:`UsageTap` keeps the body's tail and reads the last ``"usage"``
  object in it at the end (``json``'s C decoder on that object alone, never the whole body).
- A stream carries it in a chunk before ``data: [DONE]`` only when the request asked
  (``stream_options.include_usage``): vLLM sends a chunk with ``"choices":[]`` and ``usage``;
  llama.cpp the same (with ``timings``) on chat, and ``usage`` in its last chunk on
  ``/v1/completions`` always. With ``[tenants] stream_usage`` the router asks for it on the
  client's behalf (:func:`with_include_usage`) and takes the usage-only chunk out of what the
  client gets when the client did not ask.

The tap wraps the client's :class:`~llmgw.http1.sinks.BodySink`: a stream goes to the client in
whole SSE events (a read that ends inside an event keeps that event's start until the rest
comes: a client cannot use half an event anyway), each forwarded piece is searched for
``b'"usage"'`` (C speed), and only the events that hold it are parsed. No usage found (an engine
that gives none, a stream cut off): :attr:`UsageTap.found` is False and :attr:`UsageTap.events`
counts the data events relayed (the estimate of completion tokens: an engine sends about one
token per event)."""

from __future__ import annotations

import json
from typing import Any

import msgspec

from llmgw.http1.sinks import BodySink

__all__ = ["UsageTap", "client_asked_usage", "usage_tap", "with_include_usage"]

_USAGE = b'"usage"'
_TAIL = 16384  # a non-streamed body's last bytes kept: its usage object is near its end
_HOLD_MAX = 1 << 16  # a stream without event separators this long is forwarded as it is
_decode = json.JSONDecoder().raw_decode
_INJECT = b',"stream_options":{"include_usage":true}}'
_NO_CHOICES = b'"choices":[]'  # the usage-only chunk (vLLM's and llama.cpp's compact JSON)
_members = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode  # top-level members, values as bytes
_encode = msgspec.json.encode


def client_asked_usage(body: dict[str, Any]) -> bool:
    """Whether a stream's client asked for its usage chunk itself."""
    opts = body.get("stream_options")
    return isinstance(opts, dict) and opts.get("include_usage") is True


def with_include_usage(raw: bytes, body: dict[str, Any]) -> bytes | None:
    """``raw`` (the JSON object ``body`` was parsed from) asking for a stream's usage, or None
    when it cannot be asked (``stream_options`` is not an object: the engine's 400 stays the
    client's). Never a decode and re-encode of the whole body (a long prompt would pay for it on
    every stream): without ``stream_options`` the member is appended to the bytes (there is no
    other); with one, the top-level members are split out as raw bytes (msgspec: the values are
    skipped at C speed, not decoded) and joined again with only ``stream_options`` encoded anew
    — once, even when the client sent the name twice (the last one, as every parser reads it).
    A body only :mod:`json` reads (parse_body's fallback: NaN, UTF-16...) is encoded again."""
    opts = body.get("stream_options", None)
    if opts is None and "stream_options" not in body:
        end = len(raw)
        while end and raw[end - 1] in b" \t\r\n":
            end -= 1
        if end and raw[end - 1] == 125 and len(body) > 0:  # '}'
            return b"".join((memoryview(raw)[:end - 1], _INJECT))  # one copy of the body
        return None
    if not isinstance(opts, dict):
        return None
    asked = {**opts, "include_usage": True}
    try:
        members = _members(raw)
    except (msgspec.DecodeError, RecursionError, TypeError):
        return json.dumps({**body, "stream_options": asked}).encode()
    members["stream_options"] = msgspec.Raw(json.dumps(asked).encode())
    return _encode(members)


def _usage_of(obj: Any) -> tuple[int, int, int] | None:
    """(prompt, cached, completion) of a ``usage`` object, or None if it is not one."""
    if not isinstance(obj, dict):
        return None
    p, c = obj.get("prompt_tokens"), obj.get("completion_tokens", 0)
    if type(p) is not int or type(c) is not int or p < 0 or c < 0:  # noqa: E721 - not bool
        return None
    details = obj.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return p, cached if type(cached) is int and 0 <= cached <= p else 0, c  # noqa: E721


class UsageTap:
    """A BodySink around the client's: relays everything (a stream in whole events, less the
    usage-only chunk when ``strip``) and keeps the engine's usage. Read :attr:`usage` at the end."""

    __slots__ = ("events", "held", "inner", "send", "strip", "stream", "tail", "usage")

    def __init__(self, inner: BodySink, *, stream: bool, strip: bool) -> None:
        self.inner, self.stream, self.strip = inner, stream, strip
        self.send = inner.send_nowait
        self.held = b""  # a stream's unfinished event
        self.tail = b""  # a body's last bytes
        self.events = 0  # data events relayed (a stream)
        self.usage: tuple[int, int, int] | None = None  # (prompt, cached, completion) as the engine said

    @property
    def found(self) -> bool:
        return self.usage is not None

    # -- BodySink -----------------------------------------------------------------------------
    def send_nowait(self, data: bytes, end: bool = False) -> bool:
        """A stream's piece: on the hot path (a read of whole events without usage) four C calls."""
        if self.held or _USAGE in data or not data.endswith(b"\n\n"):
            return self._stream_send(data, end)
        self.events += data.count(b"data:")
        return self.send(data, end)

    def _stream_send(self, data: bytes, end: bool) -> bool:
        if self.held:
            data, self.held = self.held + data, b""
        if not end and not data.endswith(b"\n\n"):
            cut = data.rfind(b"\n\n") + 2
            if cut == 1:  # no whole event yet
                if len(data) < _HOLD_MAX:
                    self.held = data
                    return True
            else:
                data, self.held = data[:cut], data[cut:]
        if _USAGE in data:
            data = self._stream_usage(data)
        if not data and not end:
            return True
        self.events += data.count(b"data:")
        return self.send(data, end)

    def flush_nowait(self) -> None:
        self.inner.flush_nowait()

    async def drain(self) -> None:
        await self.inner.drain()

    # -- reading usage --------------------------------------------------------------------------
    def _body_usage(self) -> None:
        tail = self.tail
        at = tail.rfind(_USAGE)
        if at >= 0:
            self.usage = _usage_at(tail, at)

    def _stream_usage(self, data: bytes) -> bytes:
        """The events of ``data`` that mention usage read (only their ``usage`` object decoded);
        the usage-only chunk (``"choices":[]``) dropped when ``strip``. Events without it pass
        as they are."""
        out: list[bytes] = []
        dropped = False
        for ev in data.split(b"\n\n"):
            at = ev.rfind(_USAGE)
            if at >= 0:
                u = _usage_at(ev, at)
                if u is not None:
                    self.usage = u
                    if self.strip and _NO_CHOICES in ev:
                        dropped = True
                        continue
            out.append(ev)
        return b"\n\n".join(out) if dropped else data


def _usage_at(buf: bytes, at: int) -> tuple[int, int, int] | None:
    """The usage object of the member ``"usage": {...}`` whose name starts at ``at`` (JSON text
    escapes the quotes of any ``"usage"`` inside a string, so an unescaped one is a name or a
    whole string value; a value is followed by no colon and gives None)."""
    i, n = at + len(_USAGE), len(buf)
    while i < n and buf[i] in b" \t\r\n":
        i += 1
    if i >= n or buf[i] != 58:  # ':'
        return None
    try:
        obj, _ = _decode(buf[i + 1:].decode("utf-8", "replace").lstrip())
    except ValueError:
        return None
    return _usage_of(obj)


class _BodyTap(UsageTap):
    """A non-streamed body's tap: its tail kept, its usage read at the end."""

    __slots__ = ()

    def send_nowait(self, data: bytes, end: bool = False) -> bool:
        self.tail = (self.tail + data)[-_TAIL:] if self.tail else data[-_TAIL:]
        if end:
            self._body_usage()
        return self.send(data, end)


def usage_tap(inner: BodySink, *, stream: bool, strip: bool) -> UsageTap:
    """The tap for a stream (SSE events) or for a whole body."""
    return (UsageTap if stream else _BodyTap)(inner, stream=stream, strip=strip)
