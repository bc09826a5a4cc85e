"""The server side of HTTP/1.1, sans-I/O: a request parser and a response-head serializer.

Pure: bytes in, requests out, heads out; no sockets, no trio (``llmgw.daemon.net.httpserver``
moves the bytes).  It plays h11's SERVER role at a fraction of the cost: a request whose
head and body come in one read is parsed with one blank-line search, one regex for the
request line and one pass over the header block; a response head is formatted with one
join and checked with one regex.

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

Responses: ``serialize_response_head`` fixes framing headers up exactly as h11 does
(Content-Length for a sized body, ``Transfer-Encoding: chunked`` for an unsized one to
an HTTP/1.1 peer, close-delimited for HTTP/1.0, ``Connection: close`` whenever the
connection will not be kept) and writes the status line without a reason phrase, as h11.
A head that cannot be sent raises :class:`~llmgw.http1.errors.LocalProtocolError`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from llmgw.http1.errors import LocalProtocolError, RemoteProtocolError
from llmgw.http1.fields import END_OF_HEAD, MAX_CHUNK_LINE, TOKEN, parse_fields

__all__ = ["BODY_CHUNKED", "BODY_CLOSE", "BODY_LENGTH", "BODY_NONE", "CONTINUE", "ParsedRequest", "RequestParser",
           "serialize_response_head"]


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


CONTINUE = b"HTTP/1.1 100 \r\n\r\n"  # the interim answer to "Expect: 100-continue"

# body framing of a response, from serialize_response_head
BODY_NONE = 0  # no body at all (HEAD, 204, 304, 2xx to CONNECT)
BODY_LENGTH = 1  # exactly Content-Length bytes
BODY_CHUNKED = 2  # chunked: frame each piece, end with b"0\r\n\r\n"
BODY_CLOSE = 3  # raw bytes, then close the connection (an HTTP/1.0 peer, no length known)

_REQUEST_LINE = re.compile(rb"(" + TOKEN + rb") ([\x21-\x7e]+) HTTP/([0-9])\.([0-9])\r?")
_REQ_CHUNK_SIZE = re.compile(rb"([0-9A-Fa-f]{1,20})[ \t]*(?:;[\t\x20-\x7e\x80-\xff]*)?")
_REQ_SPECIAL = frozenset(("host", "content-length", "transfer-encoding", "connection", "expect"))
_MAX_LENGTH_DIGITS = 20  # as h11: a Content-Length of up to 10**20 - 1 parses (then 413s)
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


def _token_set(value: str) -> set[str]:
    """A comma-separated header value as a set of lowercased, stripped, non-empty tokens."""
    return {t for part in value.lower().split(",") if (t := part.strip(" \t"))}


def _content_length(value: str) -> str:
    """A Content-Length value as h11 normalizes it: its digits ("5, 5" is "5")."""
    if not (value.isdigit() and value.isascii()):
        parts = {p.strip(" \t") for p in value.split(",")}
        if len(parts) != 1:
            raise RemoteProtocolError("conflicting Content-Length values")
        value = parts.pop()
        if not (value.isdigit() and value.isascii()):
            raise RemoteProtocolError(f"invalid Content-Length {value[:40]!r}")
    if len(value) > _MAX_LENGTH_DIGITS:
        raise RemoteProtocolError("Content-Length too large")
    return value


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
                req.body = bytes(buf[pos:pos + n])
                self._buf = buf[pos + n:]
                return req
            self._req, self._state, self._remaining = req, _R_LENGTH, n - (len(buf) - pos)
            self._pieces = [bytes(buf[pos:])] if len(buf) > pos else []
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
            self._pieces.append(bytes(buf[:rem]))
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


_STATUS_LINES = {status: b"HTTP/1.1 %d \r\n" % status for status in range(200, 600)}
_RESPONSE_FIELDS = re.compile(rb"(?:" + TOKEN + rb": (?:[\x21-\x7e]+(?:[ \t]+[\x21-\x7e]+)*)?\r\n)*")
_RESP_SPECIAL = frozenset(("content-length", "transfer-encoding", "connection"))
_TE_CHUNKED = "Transfer-Encoding: chunked\r\n"
_OWS = " \t"


def serialize_response_head(status: int, headers: Iterable[tuple[str, str]], *, method: str = "GET",
                            http_version: str | None = "1.1", keep_alive: bool = True,
                            body_length: int | None = None) -> tuple[bytes, int, int, bool]:
    """A response head's bytes, its framing fixed up as h11 does, and how to send the body.

    ``headers`` go out in order, as given (str, ASCII).  ``method`` and ``http_version``
    are the request's (``http_version=None``: unknown, as for a malformed request);
    ``keep_alive``: the request allows reusing the connection.  ``body_length``: the
    body is that many bytes in hand, so ``content-length`` is added unless present
    (or the status is 204/304).  When the length is unknown the body is chunked for an
    HTTP/1.1 peer (``Transfer-Encoding: chunked`` added, Content-Length dropped) and
    close-delimited for HTTP/1.0; ``Connection: close`` is set whenever the connection
    will not be kept.

    Returns ``(head, framing, length, keep_alive)``: ``framing`` is BODY_NONE (send no
    body: HEAD, 204, 304, 2xx to CONNECT), BODY_LENGTH (exactly ``length`` bytes),
    BODY_CHUNKED or BODY_CLOSE; ``keep_alive`` says whether the connection may carry
    another request after this response.  Raises :class:`LocalProtocolError` for a status
    outside 200-999, or a header that is not a token name and a visible-ASCII value
    (HTAB/SP inside, no surrounding whitespace), or a bad framing header.
    """
    status_line = _STATUS_LINES.get(status)  # type: ignore[call-overload]
    if status_line is None:
        if not isinstance(status, int) or not 200 <= status <= 999:
            raise LocalProtocolError(f"invalid response status {status!r}")
        status = int(status)  # an IntEnum
        status_line = b"HTTP/1.1 %d \r\n" % status
    lines = []
    special: list[tuple[int, str, str]] | None = None  # framing headers: (line index, name, value)
    for name, value in headers:
        lname = name.lower()
        if lname in _RESP_SPECIAL:
            if special is None:
                special = []
            special.append((len(lines), lname, value))
        lines.append(f"{name}: {value}\r\n")
    no_body = status == 204 or status == 304 or (method == "CONNECT" and status < 300)
    if special is None:
        if body_length is not None and not no_body:
            lines.append(f"content-length: {body_length}\r\n")
            framing, length = BODY_LENGTH, body_length
        elif no_body:
            framing, length = BODY_NONE, 0
        elif http_version is not None and http_version >= "1.1":
            lines.append(_TE_CHUNKED)
            framing, length = BODY_CHUNKED, 0
        else:
            framing, length = BODY_CLOSE, 0
            keep_alive = keep_alive and method == "HEAD"
        if not keep_alive:
            lines.append("Connection: close\r\n")
    else:
        framing, length, keep_alive = _fix_framing(lines, special, no_body, body_length, http_version, method,
                                                   keep_alive)
    block = "".join(lines)
    try:
        raw = block.encode("ascii")
    except UnicodeEncodeError:
        raise LocalProtocolError("a response header is not ASCII") from None
    # The regex checks each line; the LF count catches a CRLF smuggled inside a value,
    # which would otherwise pass as two well-formed header lines.
    if raw.count(b"\n") != len(lines) or _RESPONSE_FIELDS.fullmatch(raw) is None:
        raise LocalProtocolError(f"invalid response header in {block[:200]!r}")
    if method == "HEAD" or (method == "CONNECT" and 200 <= status < 300):
        if method == "CONNECT":
            keep_alive = False  # h11: the connection was switched to a tunnel
        framing, length = BODY_NONE, 0
    return b"%b%b\r\n" % (status_line, raw), framing, length, keep_alive


def _fix_framing(lines: list[str], special: list[tuple[int, str, str]], no_body: bool, body_length: int | None,
                 http_version: str | None, method: str, keep_alive: bool) -> tuple[int, int, bool]:
    """serialize_response_head's slow path: the handler set framing or Connection headers.

    Edits ``lines`` in place the way h11's _clean_up_response_headers_for_sending does."""
    length: str | None = None
    te = False
    drop: set[int] = set()
    conn: set[str] = set()
    # h11 normalizes these values as it sends them: "5, 5" goes out as "5", a repeated
    # Content-Length once, "Chunked" as "chunked".  (A value with surrounding whitespace
    # is left alone, for the final check to refuse as h11 does.)
    for i, name, value in special:
        if name == "content-length":
            try:
                digits = _content_length(value)
            except RemoteProtocolError as exc:  # the request parser's check, on our own header here
                raise LocalProtocolError(str(exc)) from None
            if length is not None:
                if digits != length:
                    raise LocalProtocolError("conflicting Content-Length headers")
                drop.add(i)
            else:
                length = digits
                if digits != value and value == value.strip(_OWS):
                    lines[i] = f"{lines[i].partition(':')[0]}: {digits}\r\n"
        elif name == "transfer-encoding":
            if te:
                raise LocalProtocolError("multiple Transfer-Encoding headers")
            if value.lower() != "chunked":
                raise LocalProtocolError("only Transfer-Encoding: chunked is supported")
            te = True
            if value != "chunked":
                lines[i] = f"{lines[i].partition(':')[0]}: chunked\r\n"
        else:
            conn |= _token_set(value)
    if length is None and body_length is not None and not no_body:
        special.append((len(lines), "content-length", str(body_length)))
        lines.append(f"content-length: {body_length}\r\n")
        length = str(body_length)
    need_close = False
    if no_body:
        framing = BODY_NONE
    elif te or length is None:
        drop.update(i for i, name, _ in special if name == "content-length")
        if http_version is None or http_version < "1.1":
            drop.update(i for i, name, _ in special if name == "transfer-encoding")
            framing = BODY_CLOSE
            need_close = method != "HEAD"
        else:
            drop.update(i for i, name, _ in special if name == "transfer-encoding")
            lines.append(_TE_CHUNKED)
            framing = BODY_CHUNKED
    else:
        framing = BODY_LENGTH
    close = not keep_alive or need_close
    if close:
        drop.update(i for i, name, _ in special if name == "connection")
        conn.discard("keep-alive")
        conn.add("close")
        lines.extend(f"Connection: {token}\r\n" for token in sorted(conn))
    if drop:
        lines[:] = [line for i, line in enumerate(lines) if i not in drop]
    return framing, int(length) if framing == BODY_LENGTH else 0, not close and "close" not in conn
