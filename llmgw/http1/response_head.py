"""The server side of HTTP/1.1, sans-I/O: the response-head serializer.

``serialize_response_head`` fixes framing headers up exactly as h11 does (Content-Length
for a sized body, ``Transfer-Encoding: chunked`` for an unsized one to an HTTP/1.1 peer,
close-delimited for HTTP/1.0, ``Connection: close`` whenever the connection will not be
kept) and writes the status line with its standard reason phrase (``HTTP/1.1 404 Not Found``; none
for a code without one, as RFC 9112 allows); it says how to send the
body (``BODY_*``).  A head that cannot be sent raises
:class:`~llmgw.http1.errors.LocalProtocolError`.  It is formatted with one join and
checked with one regex.  The request side is :mod:`llmgw.http1.server`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from http import HTTPStatus

from llmgw.http1.errors import LocalProtocolError, RemoteProtocolError
from llmgw.http1.fields import TOKEN, _content_length, _token_set

__all__ = ["BODY_CHUNKED", "BODY_CLOSE", "BODY_LENGTH", "BODY_NONE", "serialize_response_head"]

# body framing of a response, from serialize_response_head
BODY_NONE = 0  # no body at all (HEAD, 204, 304, 2xx to CONNECT)
BODY_LENGTH = 1  # exactly Content-Length bytes
BODY_CHUNKED = 2  # chunked: frame each piece, end with b"0\r\n\r\n"
BODY_CLOSE = 3  # raw bytes, then close the connection (an HTTP/1.0 peer, no length known)

_PHRASES = {int(s): s.phrase.encode("ascii") for s in HTTPStatus}


def _status_line(status: int) -> bytes:
    """``HTTP/1.1 404 Not Found``: the reason phrase is for people reading the exchange (curl -v,
    logs); clients ignore it, and a code without a standard phrase gets none."""
    return b"HTTP/1.1 %d %b\r\n" % (status, _PHRASES.get(status, b""))


_STATUS_LINES = {status: _status_line(status) for status in range(200, 600)}
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
        status_line = _status_line(status)
    lines: list[str] = []
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
    size = int(length) if framing == BODY_LENGTH else 0  # type: ignore[arg-type]  # set with BODY_LENGTH
    return framing, size, not close and "close" not in conn
