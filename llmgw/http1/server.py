"""The server side of HTTP/1.1, sans-I/O: the request parser (the response-head serializer
is its sibling, :mod:`llmgw.http1.response_head`).

Pure: bytes in, requests out; no sockets, no trio (``llmgw.daemon.net.httpserver``
moves the bytes).  It plays h11's SERVER role at a fraction of the cost: a request whose
head and body come in one read is parsed with one blank-line search, one regex for the
request line and one pass over the header block.

Requests (RFC 9112): ``method SP request-target SP HTTP/1.x``, header fields, then a body
framed by ``Transfer-Encoding: chunked`` or ``Content-Length`` (else none).  Strict where
leniency is a risk: the request line is exact (single spaces, visible-ASCII target), field
names are tokens with no space before the colon, field values hold no control characters
but HTAB, chunk framing needs CRLF, HTTP/1.1 needs exactly one Host, and a request with
both Transfer-Encoding and Content-Length is refused (a request-smuggling vector).  Like
h11 it accepts bare-LF line endings and obs-fold in the head, rejects a leading empty
line, supports no transfer coding but ``chunked`` (501) and keeps no HTTP/1.0 connection
alive.  Bodies are buffered whole: a request comes out complete.  A request to refuse
raises :class:`~llmgw.http1.errors.RemoteProtocolError` with the status to answer.

Responses are written by :func:`llmgw.http1.response_head.serialize_response_head`
(framing fixed up as h11 does); ``CONTINUE`` below is the interim answer to
``Expect: 100-continue``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from llmgw.http1.errors import RemoteProtocolError
from llmgw.http1.fields import END_OF_HEAD, MAX_CHUNK_LINE, TOKEN, _content_length, _token_set, parse_fields

__all__ = ["CONTINUE", "ParsedRequest", "RequestParser"]


_FIELD_BYTES = bytes([9, *range(0x20, 0x7F), *range(0x80, 0x100)])  # a field line's, but its end
_TOKEN_STR = re.compile(TOKEN.decode())
_NAMES: dict[str, str] = {}  # field names seen valid -> lowercased; bounded (see _MAX_NAMES)
_MAX_NAMES = 512


def _parse_fields(block: bytes | bytearray) -> list[tuple[str, str]]:
    """Header lines (each ending in LF) -> [(lowercased name, value)]; values stripped."""
    text = block.decode("latin-1")
    # Fast path: CRLF line ends the only control characters (one translate() proves
    # it), names already seen valid.  Anything else (bare LF, obs-fold, a new name,
    # an error) takes the regex path, which is exact.
    lines = text.split("\r\n")
    if not lines[-1] and block.translate(None, _FIELD_BYTES) == b"\r\n" * (len(lines) - 1):
        lines.pop()
        out = []
        names = _NAMES
        for line in lines:
            name, sep, value = line.partition(":")
            lname = names.get(name)
            if lname is None:
                if not sep or _TOKEN_STR.fullmatch(name) is None:
                    break
                lname = name.lower()
                if len(names) < _MAX_NAMES:
                    names[name] = lname
            out.append((lname, value.strip(" \t")))
        else:
            return out
    fields = parse_fields(block)
    if fields is None:
        raise RemoteProtocolError("malformed header line")
    return fields


CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"  # the interim answer to "Expect: 100-continue"

_REQUEST_LINE = re.compile(rb"(" + TOKEN + rb") ([\x21-\x7e]+) HTTP/([0-9])\.([0-9])\r?")
_REQ_CHUNK_SIZE = re.compile(rb"([0-9A-Fa-f]{1,20})[ \t]*(?:;[\t\x20-\x7e\x80-\xff]*)?")
_REQ_SPECIAL = frozenset(("host", "content-length", "transfer-encoding", "connection", "expect"))
_VERSIONS = {0: "1.0", 1: "1.1"}
# parser states
_R_HEAD, _R_LENGTH, _R_SIZE, _R_CHUNK, _R_CRLF, _R_TRAILER, _R_ERROR = range(7)


@dataclass(slots=True)
class ParsedRequest:
    """One complete request as :class:`RequestParser` returns it."""
    method: str
    target: str  # raw request-target
    headers: list[tuple[str, str]]  # names lowercased, in arrival order; values latin-1
    http_version: str = "1.1"
    keep_alive: bool = True  # the client allows another request on this connection
    expect_continue: bool = False  # it sent "Expect: 100-continue" (HTTP/1.1 only)
    content_length: int = 0  # declared length (0 when chunked or absent)
    chunked: bool = False
    body: bytes = b""


def _normalized(headers: list[tuple[str, str]], length: str | None) -> list[tuple[str, str]]:
    """Request headers as h11 passed them on: one Content-Length with its normalized
    value (repeats dropped), Transfer-Encoding lowercased."""
    out = []
    for name, value in headers:
        if name == "content-length":
            if length is None:
                continue  # a repeat
            value, length = length, None
        elif name == "transfer-encoding":
            value = value.lower()
        out.append((name, value))
    return out


def _bytes(buf: bytes | bytearray, start: int, end: int) -> bytes:
    """``buf[start:end]`` as bytes, one copy (a bytearray's slice would be a copy, then another)."""
    if type(buf) is bytes:
        return buf[start:end]
    with memoryview(buf) as view:
        return bytes(view[start:end])


class RequestParser:
    """Incremental parser of the requests on one server connection (pipelining included).

        p = RequestParser(max_head_bytes=65536, max_body_bytes=16 << 20)
        p.feed(data)                # bytes from the socket
        req = p.next_request()      # a complete ParsedRequest, or None: feed more

    ``next_request`` raises :class:`RemoteProtocolError` for a request to refuse, its
    ``status`` saying how: 400 malformed, 413 body over ``max_body_bytes`` (checked
    against Content-Length before the body arrives), 431 head over ``max_head_bytes``,
    501 an unsupported transfer coding, 505 an HTTP version other than 1.x.  The parser
    is unusable afterwards: answer, then close.  While a body is awaited,
    ``expect_continue`` is True if the client waits for ``CONTINUE`` before sending it;
    clear it once that is sent.
    """

    __slots__ = (
        "_buf",
        "_max_body",
        "_max_head",
        "_pieces",
        "_remaining",
        "_req",
        "_scan",
        "_size",
        "_state",
        "expect_continue",
    )

    def __init__(self, *, max_head_bytes: int = 65536, max_body_bytes: int = 16 << 20) -> None:
        self._state = _R_HEAD
        self._buf: bytes | bytearray = b""  # received, not yet consumed
        self._scan = 0  # where the search for the end of a head (or trailer) resumes
        self._remaining = 0  # body bytes still due (Content-Length), or left in this chunk
        self._pieces: list[bytes] = []  # the body so far
        self._size = 0  # chunked: body bytes announced so far
        self._req: ParsedRequest | None = None  # head parsed, body pending
        self._max_head, self._max_body = max_head_bytes, max_body_bytes
        self.expect_continue = False

    @property
    def buffered(self) -> int:
        """Bytes received but not yet consumed (e.g. a pipelined request)."""
        return len(self._buf)

    def feed(self, data: bytes | bytearray) -> None:
        """Add bytes received from the client."""
        buf = self._buf
        if not buf:
            self._buf = data
        elif type(buf) is bytearray:
            buf += data  # a head in many reads: grow in place, linear not quadratic
        else:
            self._buf = bytearray(buf)
            self._buf += data

    def next_request(self) -> ParsedRequest | None:
        """The next complete request, or None until more bytes are fed."""
        try:
            if self._state != _R_HEAD:
                return self._body()
            buf = self._buf
            if not buf:
                return None
            m = END_OF_HEAD.search(buf, self._scan)
            if m is None:
                n = len(buf)
                if n > self._max_head:
                    raise RemoteProtocolError("request head too large", 431)
                if buf[0] < 0x21:  # as h11: no request line starts with a space or control
                    raise RemoteProtocolError("illegal request line")
                self._scan = max(0, n - 2)
                return None
            end = m.start() + 1  # the head with its last line's LF
            if end > self._max_head:
                raise RemoteProtocolError("request head too large", 431)
            req = self._parse_head(buf, end)
            pos = m.end()
            self._scan = 0
            n = req.content_length
            if req.chunked:
                self._buf = buf[pos:]
                self._req, self._state, self._size, self._pieces = req, _R_SIZE, 0, []
                self.expect_continue = req.expect_continue and not self._buf
                return self._chunked()
            if not n:
                self._buf = buf[pos:]
                return req
            if len(buf) - pos >= n:  # the usual case: the body came with the head
                req.body = _bytes(buf, pos, pos + n)
                self._buf = buf[pos + n:]
                return req
            self._req, self._state, self._remaining = req, _R_LENGTH, n - (len(buf) - pos)
            self._pieces = [_bytes(buf, pos, len(buf))] if len(buf) > pos else []
            self.expect_continue = req.expect_continue and not self._pieces
            self._buf = b""
            return None
        except RemoteProtocolError:
            self._state = _R_ERROR
            self.expect_continue = False
            raise

    # -- head ------------------------------------------------------------------------------
    def _parse_head(self, buf: bytes | bytearray, end: int) -> ParsedRequest:
        nl = buf.find(b"\n", 0, end)
        m = _REQUEST_LINE.fullmatch(buf, 0, nl)
        if m is None:
            raise RemoteProtocolError(f"illegal request line: {bytes(buf[:nl])[:80]!r}")
        if m[3] != b"1":
            raise RemoteProtocolError(f"HTTP/{m[3].decode()}.{m[4].decode()} is not supported", 505)
        minor = m[4][0] - 48
        version = _VERSIONS.get(minor) or f"1.{minor}"
        headers = _parse_fields(buf[nl + 1:end]) if end > nl + 1 else []
        keep_alive = minor >= 1
        expect = normalize = False
        length: str | None = None
        te: str | None = None
        hosts = 0
        for name, value in headers:
            if name not in _REQ_SPECIAL:
                continue
            if name == "host":
                hosts += 1
            elif name == "content-length":
                digits = _content_length(value)
                if length is not None:
                    if digits != length:
                        raise RemoteProtocolError("conflicting Content-Length headers")
                    normalize = True
                length = digits
                normalize = normalize or digits != value
            elif name == "transfer-encoding":
                if te is not None:
                    raise RemoteProtocolError("multiple Transfer-Encoding headers", 501)
                te = value
                normalize = normalize or value != "chunked"
            elif name == "connection":
                if value == "close" or "close" in _token_set(value):
                    keep_alive = False
            elif minor >= 1 and "100-continue" in _token_set(value):  # expect
                expect = True
        if hosts != 1 and (hosts or minor >= 1):
            raise RemoteProtocolError("missing mandatory Host header" if not hosts else "multiple Host headers")
        if te is not None:
            if te.lower() != "chunked":
                raise RemoteProtocolError("only Transfer-Encoding: chunked is supported", 501)
            if length is not None:
                raise RemoteProtocolError("both Transfer-Encoding and Content-Length")
        if normalize:
            headers = _normalized(headers, length)
        req = ParsedRequest(m[1].decode("ascii"), m[2].decode("ascii"), headers, version, keep_alive, expect)
        if te is not None:
            req.chunked = True
        elif length is not None and (n := int(length)):
            if n > self._max_body:
                raise RemoteProtocolError(f"request body exceeds the limit of {self._max_body} bytes", 413)
            req.content_length = n
        return req

    # -- body ------------------------------------------------------------------------------
    def _body(self) -> ParsedRequest | None:
        state = self._state
        if state == _R_LENGTH:
            buf = self._buf
            if not buf:
                return None
            self.expect_continue = False
            rem = self._remaining
            if len(buf) < rem:
                self._pieces.append(bytes(buf))
                self._remaining = rem - len(buf)
                self._buf = b""
                return None
            self._pieces.append(_bytes(buf, 0, rem))
            self._buf = buf[rem:]
            return self._complete()
        if state == _R_ERROR:
            raise RemoteProtocolError("parser is in an error state")
        return self._chunked()

    def _complete(self) -> ParsedRequest:
        req = self._req
        assert req is not None
        pieces = self._pieces
        req.body = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        self._req, self._pieces, self._state = None, [], _R_HEAD
        return req

    def _chunked(self) -> ParsedRequest | None:
        buf = self._buf
        n = len(buf)
        pos = 0
        state = self._state
        pieces = self._pieces
        while True:
            if state == _R_SIZE:
                i = buf.find(b"\r\n", pos)
                if i < 0:
                    if n - pos > MAX_CHUNK_LINE:
                        raise RemoteProtocolError("chunk-size line too long")
                    break
                m = _REQ_CHUNK_SIZE.fullmatch(buf, pos, i)
                if m is None:
                    raise RemoteProtocolError(f"illegal chunk-size line: {bytes(buf[pos:i])[:40]!r}")
                size = int(m[1], 16)
                pos = i + 2
                if size:
                    self._size += size
                    if self._size > self._max_body:
                        raise RemoteProtocolError(f"request body exceeds the limit of {self._max_body} bytes", 413)
                    self._remaining = size
                    state = _R_CHUNK
                else:
                    state = _R_TRAILER
            elif state == _R_CHUNK:
                if pos >= n:
                    break
                end = pos + self._remaining
                if end > n:
                    pieces.append(bytes(buf[pos:]))
                    self._remaining = end - n
                    pos = n
                    break
                pieces.append(bytes(buf[pos:end]))
                pos = end
                state = _R_CRLF
            elif state == _R_CRLF:
                if n - pos < 2:
                    if pos < n and buf[pos] != 13:
                        raise RemoteProtocolError("missing CRLF after chunk data")
                    break
                if buf[pos] != 13 or buf[pos + 1] != 10:
                    raise RemoteProtocolError("missing CRLF after chunk data")
                pos += 2
                state = _R_SIZE
            else:  # _R_TRAILER: an empty line, or header lines then an empty line
                if buf.startswith(b"\r\n", pos):
                    pos += 2
                elif buf.startswith(b"\n", pos):
                    pos += 1
                else:
                    m = END_OF_HEAD.search(buf, pos + self._scan)
                    if m is None:
                        if n - pos > self._max_head:
                            raise RemoteProtocolError("trailer section too large", 431)
                        self._scan = max(0, n - pos - 2)
                        break
                    if m.start() + 1 - pos > self._max_head:
                        raise RemoteProtocolError("trailer section too large", 431)
                    _parse_fields(buf[pos:m.start() + 1])  # checked, then dropped
                    pos = m.end()
                    self._scan = 0
                self._buf = buf[pos:]
                if pieces:
                    self.expect_continue = False
                return self._complete()
        self._state = state
        if pos:
            self._buf = buf[pos:]
            self.expect_continue = False
        return None
