"""A minimal, fast, sans-I/O HTTP/1.1 client codec: a response parser and a request serializer.

Pure: bytes in, events out; no sockets, no trio.  It plays h11's client role for the
router's upstream connections at a fraction of the cost: a streamed response spends
its time in the chunked body path, which handles every chunk that one ``feed()``
carries with ``bytes.find`` and slicing, never a loop over single bytes.

    p = ResponseParser()
    for ev in p.feed(data): ...     # Head(...), Data(...), End(...)
    p.feed_eof()                     # the peer closed: End for a read-until-close body
    p.keep_alive                     # after End: may the connection carry another request?

Framing follows RFC 9112 §6.3 for responses: no body for HEAD, 1xx, 204 and 304;
``Transfer-Encoding`` with ``chunked`` last → chunked (extensions ignored, trailers
parsed); any other transfer coding → until close; else ``Content-Length``; else until
close.  Interim 1xx responses (100, 102, 103) are skipped; 101 is an error (we never ask
to upgrade).  Bare-LF line endings and obsolete header folding are tolerated, as h11
does.  Anything else malformed raises :class:`~llmgw.http1.errors.RemoteProtocolError`;
a request that cannot be serialized, :class:`~llmgw.http1.errors.LocalProtocolError`
(both ``ValueError``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from llmgw.http1.errors import LocalProtocolError, RemoteProtocolError
from llmgw.http1.fields import END_OF_HEAD, MAX_CHUNK_LINE, TOKEN, VALUE, first_header, parse_fields

__all__ = [
    "Data",
    "End",
    "Event",
    "Head",
    "ResponseParser",
    "serialize_request",
]


@dataclass(slots=True)
class Head:
    status: int
    headers: list[tuple[str, str]]  # names lowercased, in arrival order; values latin-1
    reason: str = ""
    http_version: str = "1.1"

    def header(self, name: str) -> str | None:
        """First value of header ``name`` (give it lowercase), or None."""
        return first_header(self.headers, name)


@dataclass(slots=True)
class Data:
    data: bytes


@dataclass(slots=True)
class End:
    trailers: list[tuple[str, str]] = field(default_factory=list)  # chunked trailers, if any


Event = Head | Data | End

# parser states
_HEAD, _LENGTH, _SIZE, _CHUNK, _CRLF, _TRAILER, _CLOSE, _DONE, _ERROR = range(9)

_STATUS_LINE = re.compile(rb"HTTP/1\.([0-9]) ([0-9]{3})(?:[ \t]([\t\x20-\x7e\x80-\xff]*))?\r?")
_CHUNK_SIZE = re.compile(rb"0*([0-9A-Fa-f]{1,15})[ \t]*(?:;[^\x00-\x08\x0a-\x1f\x7f]*)?\r?")
_SIZE_LINES = {b"%x\r" % i: i for i in range(4096)}  # chunk-size lines as h11/uvicorn write them
_NO_BODY_STATUS = frozenset((204, 304))


def _parse_fields(block: bytes) -> list[tuple[str, str]]:
    fields = parse_fields(block)
    if fields is None:
        raise RemoteProtocolError("malformed header line")
    return fields


class ResponseParser:
    """Incremental parser of one HTTP/1.1 response (make a new one per request).

    ``head_request``: the request was HEAD, so the response has no body whatever its
    headers say.  ``max_head_bytes`` bounds the status line + headers (and trailers).
    """

    __slots__ = (
        "_buf",
        "_extra",
        "_head_request",
        "_max_head",
        "_remaining",
        "_state",
        "_trailers",
        "head",
        "keep_alive",
    )

    def __init__(self, *, head_request: bool = False, max_head_bytes: int = 65536) -> None:
        self._state = _HEAD
        self._buf: bytes | bytearray = b""  # unconsumed: a partial head, chunk-size line or trailer
        self._remaining = 0  # body bytes left (Content-Length) or left in the current chunk
        self._head_request = head_request
        self._max_head = max_head_bytes
        self._trailers: list[tuple[str, str]] = []
        self._extra = False
        self.keep_alive = False  # meaningful once done: reusable for another request
        self.head: Head | None = None

    # -- state -------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        """The whole response was parsed (End was returned)."""
        return self._state == _DONE

    @property
    def until_close(self) -> bool:
        """The body is delimited by the connection closing: EOF ends it (see feed_eof)."""
        return self._state == _CLOSE

    @property
    def buffered(self) -> int:
        """Bytes held back waiting for the rest of a line (never body bytes)."""
        return len(self._buf)

    @property
    def length_left(self) -> int | None:
        """Body bytes still to come of a Content-Length body; None for any other framing."""
        return self._remaining if self._state == _LENGTH else None

    # -- input -------------------------------------------------------------------------------
    def feed(self, data: bytes) -> list[Event]:
        """Parse the next bytes from the connection; return the events they complete.

        All body bytes one call yields come as a single Data event (the chunk framing
        removed), followed by End when the response is complete.  Bytes after the end
        of the response are dropped and make the connection not reusable.
        """
        state = self._state
        if state != _HEAD:
            if state == _DONE:
                if data:
                    self._extra = True
                    self.keep_alive = False
                return []
            if state == _ERROR:
                raise RemoteProtocolError("parser is in an error state")
            body = self.feed_body(data)
            out: list[Event] = [Data(body)] if body else []
            if self._state == _DONE:
                out.append(End(self._trailers))
            return out
        if not data:
            return []
        try:
            return self._feed_head(data)
        except RemoteProtocolError:
            self._state = _ERROR
            raise

    def feed_body(self, data: bytes) -> bytes:
        """Fast path once the head is parsed: the body bytes in ``data``, de-chunked.

        Check :attr:`done` afterwards (then :attr:`keep_alive` is final and chunked
        trailers are in ``trailers``).  After the end, ``data`` is ignored but makes the
        connection not reusable.
        """
        state = self._state
        if state == _LENGTH:
            rem = self._remaining
            n = len(data)
            if n < rem:
                self._remaining = rem - n
                return data
            self._remaining = 0
            self._state = _DONE
            if n > rem:
                self._extra = True
                self.keep_alive = False
                return data[:rem]
            return data
        if _SIZE <= state <= _TRAILER:
            try:
                return self._chunked(data)
            except RemoteProtocolError:
                self._state = _ERROR
                raise
        if state == _CLOSE:
            return data
        if state == _DONE:
            if data:
                self._extra = True
                self.keep_alive = False
            return b""
        if state == _ERROR:
            raise RemoteProtocolError("parser is in an error state")
        raise RuntimeError("feed_body() before the head was parsed")

    @property
    def trailers(self) -> list[tuple[str, str]]:
        return self._trailers

    def feed_eof(self) -> list[Event]:
        """The peer closed the connection.  Returns [End] for a read-until-close body
        (or [] if the response was already complete); raises RemoteProtocolError if the
        response is incomplete."""
        state = self._state
        if state == _CLOSE:
            self._state = _DONE
            self.keep_alive = False
            return [End()]
        if state == _DONE:
            self.keep_alive = False
            return []
        self._state = _ERROR
        if state == _HEAD and not self._buf:
            raise RemoteProtocolError("connection closed before any response")
        raise RemoteProtocolError("connection closed in the middle of the response")

    # -- head ------------------------------------------------------------------------------
    def _feed_head(self, data: bytes) -> list[Event]:
        partial = self._buf
        if partial:
            # A head in many small reads: grow in place and resume the blank-line search
            # where it stopped, so a trickled head costs linear, not quadratic, time.
            if type(partial) is not bytearray:
                partial = self._buf = bytearray(partial)
            partial += data
            buf: bytes | bytearray = partial
            scan = max(0, len(partial) - len(data) - 2)
        else:
            buf = data
            scan = 0
        out: list[Event] = []
        while True:
            m = END_OF_HEAD.search(buf, scan)
            if m is None:
                if len(buf) > self._max_head:
                    raise RemoteProtocolError("response head too large")
                if buf[:1] != b"H" or (len(buf) >= 5 and buf[:5] != b"HTTP/"):
                    raise RemoteProtocolError("not an HTTP/1.x response")
                self._buf = buf
                return out
            end = m.start() + 1  # the head includes its last line's LF
            if end > self._max_head:
                raise RemoteProtocolError("response head too large")
            head = self._parse_head(bytes(buf[:end]))
            buf = bytes(buf[m.end():])
            scan = 0
            if head is not None:
                self._buf = b""
                out.append(head)
                break
            # an interim 1xx: parse the next head from what follows
            if not buf:
                self._buf = b""
                return out
        if self._state == _DONE:
            out.append(End())
            if buf:
                self._extra = True
                self.keep_alive = False
        elif buf:
            body = self.feed_body(buf)
            if body:
                out.append(Data(body))
            if self._state == _DONE:
                out.append(End(self._trailers))
        return out

    def _parse_head(self, head: bytes) -> Head | None:
        nl = head.find(b"\n")
        m = _STATUS_LINE.fullmatch(head, 0, nl)
        if m is None:
            raise RemoteProtocolError(f"malformed status line: {head[:nl][:80]!r}")
        minor, status = m[1], int(m[2])
        if status < 100:
            raise RemoteProtocolError(f"invalid status code {status}")
        headers = _parse_fields(head[nl + 1:])
        if status < 200:
            if status == 101:
                raise RemoteProtocolError("unexpected 101 Switching Protocols")
            return None  # interim response: skip it
        te: str | None = None
        length: int | None = None
        connection = ""
        for name, value in headers:
            if name == "content-length":
                if value.isdigit() and value.isascii() and len(value) <= 18:
                    n = int(value)
                else:  # "5, 5" is a tolerated duplicate; anything else is an error
                    parts = {p.strip(" \t") for p in value.split(",")}
                    if len(parts) != 1 or not (v := parts.pop()).isdigit() or not v.isascii() or len(v) > 18:
                        raise RemoteProtocolError(f"invalid content-length {value!r}")
                    n = int(v)
                if length is not None and n != length:
                    raise RemoteProtocolError("conflicting content-length headers")
                length = n
            elif name == "transfer-encoding":
                te = value if te is None else f"{te},{value}"
            elif name == "connection":
                connection = f"{connection},{value}" if connection else value
        if connection:
            tokens = {t.strip(" \t") for t in connection.lower().split(",")}
            keep_alive = "keep-alive" in tokens and "close" not in tokens if minor == b"0" else "close" not in tokens
        else:
            keep_alive = minor != b"0"
        if self._head_request or status in _NO_BODY_STATUS:
            self._state = _DONE
        elif te is not None:
            if te.rpartition(",")[2].strip(" \t").lower() == "chunked":
                self._state = _SIZE
            else:
                self._state = _CLOSE
                keep_alive = False
        elif length is not None:
            self._remaining = length
            self._state = _LENGTH if length else _DONE
        else:
            self._state = _CLOSE
            keep_alive = False
        self.keep_alive = keep_alive
        reason = m[3].rstrip(b" \t").decode("latin-1") if m[3] else ""
        self.head = Head(status, headers, reason, "1.1" if minor == b"1" else "1." + minor.decode())
        return self.head

    # -- chunked body ------------------------------------------------------------------------
    def _chunked(self, data: bytes) -> bytes:
        if self._buf:
            buf = bytes(self._buf) + data  # bytes here (the head's bytearray is gone): no copy
            self._buf = b""
        else:
            buf = data
        n = len(buf)
        pos = 0
        pieces: list[bytes] = []
        state = self._state
        while pos < n:
            if state == _CHUNK:
                end = pos + self._remaining
                if end > n:  # the chunk continues in a later read
                    pieces.append(buf[pos:] if pos else buf)
                    self._remaining = end - n
                    pos = n
                    break
                pieces.append(buf[pos:end])
                pos = end
                if end + 1 < n and buf[end] == 13 and buf[end + 1] == 10:
                    pos += 2
                    state = _SIZE
                    continue
                state = _CRLF
            elif state == _SIZE:
                nl = buf.find(b"\n", pos)
                if nl < 0:
                    if n - pos > MAX_CHUNK_LINE:
                        raise RemoteProtocolError("chunk-size line too long")
                    break
                # The usual line ("1a3\r") is one dict lookup; extensions, padding,
                # uppercase, big sizes or garbage take the regex.
                size = _SIZE_LINES.get(buf[pos:nl])
                if size is None:
                    m = _CHUNK_SIZE.fullmatch(buf, pos, nl)
                    if m is None:
                        raise RemoteProtocolError(f"invalid chunk-size line {buf[pos:nl][:40]!r}")
                    size = int(m[1], 16)
                pos = nl + 1
                if not size:
                    state = _TRAILER
                    self._remaining = 0  # trailer bytes seen, against max_head_bytes
                    continue
                end = pos + size
                if end > n:  # the chunk continues in a later read
                    pieces.append(buf[pos:])
                    self._remaining = end - n
                    pos = n
                    state = _CHUNK
                    break
                pieces.append(buf[pos:end])
                # the CRLF after the data, usually right here
                if end + 1 < n and buf[end] == 13 and buf[end + 1] == 10:
                    pos = end + 2
                else:
                    pos = end
                    state = _CRLF
            elif state == _CRLF:
                if buf[pos] == 10:  # bare LF
                    pos += 1
                    state = _SIZE
                elif buf[pos:pos + 2] == b"\r\n":
                    pos += 2
                    state = _SIZE
                elif n - pos == 1 and buf[pos] == 13:
                    break  # "\r" now, "\n" in the next read
                else:
                    raise RemoteProtocolError("missing CRLF after chunk data")
            elif state == _TRAILER:
                nl = buf.find(b"\n", pos)
                if nl < 0:
                    if self._remaining + n - pos > self._max_head:
                        raise RemoteProtocolError("trailer section too large")
                    break
                line_end = nl + 1
                if nl == pos or (nl == pos + 1 and buf[pos] == 13):
                    pos = line_end
                    state = _DONE
                    break
                self._remaining += line_end - pos
                if self._remaining > self._max_head:
                    raise RemoteProtocolError("trailer section too large")
                if buf[pos] in b" \t" and self._trailers:  # folded trailer line
                    name, value = self._trailers.pop()
                    extra = _parse_fields(b"x:" + buf[pos:line_end])[0][1]
                    self._trailers.append((name, f"{value} {extra}"))
                else:
                    self._trailers.extend(_parse_fields(buf[pos:line_end]))
                pos = line_end
            else:  # pragma: no cover - _DONE exits the loop above
                break
        self._state = state
        if pos < n:
            if state == _DONE:
                self._extra = True
                self.keep_alive = False
            else:
                self._buf = buf[pos:]
        if not pieces:
            return b""
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)


# -- requests --------------------------------------------------------------------------------
_REQUEST_HEAD = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+ [\x21-\x7e\x80-\xff]+ HTTP/1\.1\r\n"
                           rb"(?:" + TOKEN + rb": " + VALUE + rb"\r\n)*\r\n")
_BODY_METHODS = frozenset(("POST", "PUT", "PATCH"))


def serialize_request(method: str, target: str, headers: Iterable[tuple[str, str]] = (),
                      body: bytes | bytearray | memoryview | None = None, *, host: str | None = None) -> bytes:
    """The bytes of an HTTP/1.1 request with a fixed-length body (``body`` appended).

    Headers go out as given (str, latin-1).  ``host`` is added as the Host header when
    ``headers`` has none; ``Content-Length`` is added when absent and there is a body or
    the method is POST/PUT/PATCH.  Transfer-Encoding is refused (bodies are bytes).
    Raises :class:`LocalProtocolError` for names/values that would break the framing (CR,
    LF, controls, invalid token characters).
    """
    lines = [f"{method} {target} HTTP/1.1\r\n"]
    has_host = has_length = False
    for name, value in headers:
        lname = name.lower()
        if lname == "host":
            has_host = True
        elif lname == "content-length":
            has_length = True
        elif lname == "transfer-encoding":
            raise LocalProtocolError("transfer-encoding is not supported in requests; send bytes")
        lines.append(f"{name}: {value}\r\n")
    if not has_host and host is not None:
        lines.append(f"host: {host}\r\n")
    size = len(body) if body is not None else 0
    if not has_length and (size or method in _BODY_METHODS):
        lines.append(f"content-length: {size}\r\n")
    lines.append("\r\n")
    try:
        head = "".join(lines).encode("latin-1")
    except UnicodeEncodeError as exc:
        raise LocalProtocolError(f"request head is not latin-1: {exc}") from None
    # The regex checks the shape; the LF count catches a CRLF smuggled inside one value,
    # which would otherwise pass as two well-formed header lines.
    if head.count(b"\n") != len(lines) or _REQUEST_HEAD.fullmatch(head) is None:
        raise LocalProtocolError("invalid characters in the request line or a header")
    if size:
        return head + bytes(body) if not isinstance(body, bytes) else head + body  # type: ignore[arg-type]
    return head
