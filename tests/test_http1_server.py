"""llmgw.http1.server and .response_head: the sans-I/O request parser and response-head serializer.

h11 (which the server used before, and httpx still uses) is the oracle: for valid
requests both parsers must agree, and response heads must match h11's byte for byte.
"""

from __future__ import annotations

from http import HTTPStatus

import h11
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from llmgw.http1.errors import LocalProtocolError, ProtocolError, RemoteProtocolError
from llmgw.http1.response_head import BODY_CHUNKED, BODY_CLOSE, BODY_LENGTH, BODY_NONE, serialize_response_head
from llmgw.http1.server import CONTINUE, ParsedRequest, RequestParser

# ------------------------------------------------------------------------------ helpers


def parse(raw: bytes, cuts: list[int] | None = None, **limits: int) -> list[ParsedRequest]:
    """Feed ``raw`` split at ``cuts``; return every complete request (RemoteProtocolError propagates)."""
    p = RequestParser(**limits)
    out: list[ParsedRequest] = []
    edges = sorted({0, len(raw), *(c for c in cuts or () if 0 < c < len(raw))})
    for a, b in zip(edges, edges[1:]):
        p.feed(raw[a:b])
        while (req := p.next_request()) is not None:
            out.append(req)
    return out


def one(raw: bytes, cuts: list[int] | None = None, **limits: int) -> ParsedRequest:
    reqs = parse(raw, cuts, **limits)
    assert len(reqs) == 1, reqs
    return reqs[0]


def refused(raw: bytes, cuts: list[int] | None = None, **limits: int) -> int:
    """The status a request is refused with."""
    with pytest.raises(RemoteProtocolError) as info:
        parse(raw, cuts, **limits)
    return info.value.status


def as_h11(raw: bytes) -> list[tuple[str, str, str, list[tuple[str, str]], bytes]]:
    """h11's reading of a stream of requests: (method, target, version, headers, body)."""
    out = []
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=65536)
    conn.receive_data(raw)
    while True:
        ev = conn.next_event()
        if ev is h11.NEED_DATA:
            return out
        if type(ev) is h11.Request:
            head = (ev.method.decode(), ev.target.decode(), ev.http_version.decode(),
                    [(n.decode("latin-1"), v.decode("latin-1")) for n, v in ev.headers])
            body = b""
        elif type(ev) is h11.Data:
            body += ev.data
        elif type(ev) is h11.EndOfMessage:
            out.append((*head, body))
            conn.send(h11.Response(status_code=404, headers=[("content-length", "0")]))
            conn.send(h11.EndOfMessage())
            if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                return out  # not keep-alive: h11 reads no further
            conn.start_next_cycle()
        else:
            return out


def summary(req: ParsedRequest) -> tuple[str, str, str, list[tuple[str, str]], bytes]:
    return req.method, req.target, req.http_version, req.headers, req.body


# ------------------------------------------------------------------------------ valid requests

_TCHAR = "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
tokens = st.text(_TCHAR, min_size=1, max_size=12)
field_chars = st.characters(min_codepoint=0x21, max_codepoint=0xFF, exclude_characters="\x7f")
field_values = st.lists(st.text(field_chars, min_size=1, max_size=10), max_size=3).map(" ".join) | st.sampled_from(
    ["", "a\tb", "x  y"])
plain_names = tokens.filter(lambda n: n.lower() not in {
    "host", "content-length", "transfer-encoding", "connection", "expect", "upgrade"})


@st.composite
def requests(draw: st.DrawFn, lf_only: bool | None = None) -> tuple[bytes, dict]:
    """A valid request and what it must parse to."""
    method = draw(st.sampled_from(["GET", "POST", "PUT", "DELETE", "OPTIONS", "PATCH"]) | tokens)
    target = draw(st.sampled_from(["/", "*", "/v1/chat/completions", "/p?a=1&b=%20"])
                  | st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=20))
    minor = draw(st.sampled_from([0, 1, 1, 1]))
    eol = "\n" if (lf_only if lf_only is not None else draw(st.booleans()) and draw(st.booleans())) else "\r\n"
    fields = draw(st.lists(st.tuples(plain_names, field_values), max_size=6))
    if minor == 1 or draw(st.booleans()):
        fields.insert(draw(st.integers(0, len(fields))), ("Host", draw(st.sampled_from(["x", "127.0.0.1:8000"]))))
    close = draw(st.sampled_from([None, "close", "keep-alive", "Upgrade, Close", "foo"]))
    if close is not None:
        fields.append(("Connection", close))
    body = draw(st.binary(max_size=300))
    framing = draw(st.sampled_from(["length", "chunked", "none"] if not body else ["length", "chunked"]))
    raw_body = b""
    if framing == "length":
        fields.append((draw(st.sampled_from(["Content-Length", "content-length"])), str(len(body))))
        raw_body = body
    elif framing == "chunked":
        fields.append(("Transfer-Encoding", draw(st.sampled_from(["chunked", "Chunked"]))))
        cuts = sorted(set(draw(st.lists(st.integers(1, max(1, len(body) - 1)), max_size=4)))) if body else []
        pieces = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)]) if body[a:b]]
        for piece in pieces:
            ext = draw(st.sampled_from(["", ";x=1", ";name", " "]))
            raw_body += b"%x%s\r\n%s\r\n" % (len(piece), ext.encode(), piece)
        raw_body += b"0\r\n"
        if draw(st.booleans()):
            raw_body += b"Trailer-Field: v\r\n"
        raw_body += b"\r\n"
    head = f"{method} {target} HTTP/1.{minor}{eol}" + "".join(f"{n}:{draw(st.sampled_from(['', ' ', chr(9)]))}"
                                                             f"{v}{eol}" for n, v in fields) + eol
    keep_alive = minor == 1 and not (close and "close" in close.lower())
    expected = {"method": method, "target": target, "http_version": f"1.{minor}", "keep_alive": keep_alive,
                "headers": [(n.lower(), v.lower() if n == "Transfer-Encoding" else v.strip(" \t")) for n, v in fields],
                "body": body}  # h11 passed Transfer-Encoding on lowercased, and so do we
    return head.encode("latin-1") + raw_body, expected


def check(req: ParsedRequest, expected: dict) -> None:
    assert {k: getattr(req, k) for k in expected} == expected


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(requests(), st.data())
def test_any_valid_request_split_anywhere_parses_the_same(case: tuple[bytes, dict], data: st.DataObject) -> None:
    raw, expected = case
    check(one(raw), expected)
    cuts = data.draw(st.lists(st.integers(0, len(raw)), max_size=12))
    check(one(raw, cuts), expected)
    check(one(raw, list(range(len(raw)))), expected)  # a byte at a time


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(requests(), min_size=1, max_size=4), st.data())
def test_pipelined_requests_parse_like_h11(cases: list[tuple[bytes, dict]], data: st.DataObject) -> None:
    # The connection closes after a request that is not keep-alive: later ones are not read.
    stream = []
    for raw, expected in cases:
        stream.append((raw, expected))
        if not expected["keep_alive"]:
            break
    raw = b"".join(r for r, _ in stream)
    cuts = data.draw(st.lists(st.integers(0, len(raw)), max_size=10))
    reqs = parse(raw, cuts)
    assert len(reqs) == len(stream)
    for req, (_, expected) in zip(reqs, stream):
        check(req, expected)
    assert [summary(r) for r in reqs] == as_h11(raw)


def test_typical_request() -> None:
    raw = (b"POST /v1/completions?x=1 HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
           b"Content-Length: 2\r\nAuthorization: Bearer k\r\n\r\n{}")
    req = one(raw)
    assert (req.method, req.target, req.http_version, req.body) == ("POST", "/v1/completions?x=1", "1.1", b"{}")
    assert req.headers == [("host", "gw"), ("content-type", "application/json"), ("content-length", "2"),
                           ("authorization", "Bearer k")]
    assert req.keep_alive and not req.expect_continue and req.content_length == 2 and not req.chunked


def test_obs_fold_is_joined_and_values_are_latin1() -> None:
    req = one(b"GET / HTTP/1.1\r\nHost: x\r\nX-A: one\r\n  two\r\nX-B: caf\xe9\r\n\r\n")
    assert req.headers[1:] == [("x-a", "one two"), ("x-b", "caf\u00e9")]


def test_keep_alive_rules() -> None:
    def keep(version: str, *fields: str) -> bool:
        head = f"GET / HTTP/{version}\r\nHost: x\r\n" + "".join(f"{f}\r\n" for f in fields) + "\r\n"
        return one(head.encode()).keep_alive

    assert keep("1.1") and keep("1.1", "Connection: keep-alive") and keep("1.1", "Connection: closed")
    assert not keep("1.1", "Connection: close") and not keep("1.1", "Connection: Upgrade, CLOSE")
    assert not keep("1.1", "Connection: upgrade", "Connection: close")
    assert not keep("1.0") and not keep("1.0", "Connection: keep-alive")  # as h11: no HTTP/1.0 keep-alive


def test_pipelined_bytes_stay_buffered() -> None:
    p = RequestParser()
    p.feed(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\nGET /b HTTP/1.1\r\nHo")
    assert p.next_request().target == "/a"  # type: ignore[union-attr]
    assert p.buffered == len(b"GET /b HTTP/1.1\r\nHo")
    assert p.next_request() is None
    p.feed(b"st: x\r\n\r\n")
    assert p.next_request().target == "/b"  # type: ignore[union-attr]
    assert p.buffered == 0 and p.next_request() is None


# ------------------------------------------------------------------------------ Expect: 100-continue

def test_expect_continue_only_while_the_body_is_awaited() -> None:
    p = RequestParser()
    p.feed(b"POST / HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n")
    assert p.next_request() is None and p.expect_continue
    p.expect_continue = False  # the server sent CONTINUE
    p.feed(b"hel")
    assert p.next_request() is None and not p.expect_continue
    p.feed(b"lo")
    req = p.next_request()
    assert req is not None and req.body == b"hello" and req.expect_continue

    p = RequestParser()  # body sent along anyway: nothing to wait for
    p.feed(b"POST / HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\nhe")
    assert p.next_request() is None and not p.expect_continue

    for head in (b"POST / HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 0\r\n\r\n",
                 b"POST / HTTP/1.0\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n"):
        p = RequestParser()
        p.feed(head)
        p.next_request()
        assert not p.expect_continue

    p = RequestParser()
    p.feed(b"POST / HTTP/1.1\r\nHost: x\r\nExpect: 100-Continue\r\nTransfer-Encoding: chunked\r\n\r\n")
    assert p.next_request() is None and p.expect_continue
    p.feed(b"3\r\nabc\r\n0\r\n\r\n")
    assert p.next_request().body == b"abc" and not p.expect_continue  # type: ignore[union-attr]


# ------------------------------------------------------------------------------ chunked bodies

def test_chunked_body_with_extensions_and_trailers() -> None:
    raw = (b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
           b"5;ext=\"v\"\r\nhello\r\n1 \r\n \r\n0000000000000000000a\r\n0123456789\r\n0\r\nX-T: 1\r\n\tfolded\r\n\r\n")
    req = one(raw)
    assert req.body == b"hello 0123456789" and req.chunked and req.content_length == 0
    assert one(raw, list(range(len(raw)))).body == req.body


@pytest.mark.parametrize("body", [
    b"5\r\nhelloX\r\n0\r\n\r\n",  # no CRLF after the data
    b"5\nhello\r\n0\r\n\r\n",  # bare LF in the framing
    b"g\r\n",  # not hex
    b"\r\n",  # empty size
    b"-1\r\n",
    b"1;\x01\r\n",  # control character in an extension
    b"123456789012345678901\r\n",  # 21 hex digits
    b"0\r\nbad trailer\r\n\r\n",
])
def test_bad_chunked_framing_is_400(body: bytes) -> None:
    head = b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    assert refused(head + body) == 400
    assert refused(head + body, list(range(len(head), len(head) + len(body)))) == 400


def test_chunked_limits() -> None:
    head = b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    assert one(head + b"400\r\n" + b"x" * 1024 + b"\r\n0\r\n\r\n", max_body_bytes=1024).body == b"x" * 1024
    # refused when the size line announces too much, before the data comes
    assert refused(head + b"200\r\n" + b"x" * 512 + b"\r\n201\r\n", max_body_bytes=1024) == 413
    assert refused(head + b"1" * 9000) == 400  # a size line that never ends
    assert refused(head + b"0\r\n" + b"X-T: v\r\n" * 200, max_head_bytes=1024) == 431


# ------------------------------------------------------------------------------ refusals

@pytest.mark.parametrize("raw, status", [
    (b"\x00\x01 not http at all\r\n\r\n", 400),
    (b"BAD\r\n\r\n", 400),
    (b"\r\nGET / HTTP/1.1\r\nHost: x\r\n\r\n", 400),  # as h11: no empty line before the request
    (b"GET  / HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    (b"GET / HTTP/1.1 \r\nHost: x\r\n\r\n", 400),
    (b"GET /\xe9 HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    (b"GET / http/1.1\r\nHost: x\r\n\r\n", 400),
    (b"GE\x01T / HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\r\nHost: x\r\n\r\n", 400),
    (b"GET / HTTP/2.0\r\nHost: x\r\n\r\n", 505),
    (b"GET / HTTP/0.9\r\nHost: x\r\n\r\n", 505),
    (b"GET / HTTP/1.1\r\n\r\n", 400),  # no Host
    (b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400),
    (b"GET / HTTP/1.0\r\nHost: a\r\nHost: a\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nHost : x\r\n\r\n", 400),  # space before the colon
    (b"GET / HTTP/1.1\r\nHost: x\r\n Folded: at start\r\n\r\n", 200),  # continues Host (obs-fold)
    (b"GET / HTTP/1.1\r\n Host: x\r\n\r\n", 400),  # a continuation line first
    (b"GET / HTTP/1.1\r\nHost: x\r\nNo colon\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nHost: x\r\nX: a\x00b\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nHost: x\r\nX: a\rb\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nHost: x\r\nX: a\x01b\r\n\r\n", 400),  # stricter than h11: no controls
    (b"GET / HTTP/1.1\r\nHost: x\r\nX: a\x7fb\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nHost: x\r\nX(y): 1\r\n\r\n", 400),
    (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", 400),
    (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1e3\r\n\r\n", 400),
    (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: \xb2\r\n\r\n", 400),  # a latin-1 digit
    (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1, 2\r\n\r\n", 400),
    (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", 400),
    (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 123456789012345678901\r\n\r\n", 400),
    (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999999999999\r\n\r\n", 413),
    (b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", 501),
    (b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n", 501),
    (b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n", 400),
])
def test_refusals(raw: bytes, status: int) -> None:
    if status == 200:
        one(raw)
        return
    assert refused(raw) == status
    assert refused(raw, list(range(len(raw)))) == status


def test_content_length_forms_h11_accepts() -> None:
    assert one(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3, 3\r\n\r\nabc").body == b"abc"
    assert one(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\ncontent-length: 3\r\n\r\nabc").body == b"abc"
    assert one(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 003\r\n\r\nabc").body == b"abc"


def test_head_limit() -> None:
    big = b"GET / HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 2000 + b"\r\n\r\n"
    assert refused(big, max_head_bytes=1024) == 431  # complete
    assert refused(big[:1500], max_head_bytes=1024) == 431  # still coming
    assert refused(big, list(range(0, len(big), 100)), max_head_bytes=1024) == 431
    assert one(big, max_head_bytes=len(big)).headers[1][1] == "a" * 2000


def test_body_limit_is_checked_before_the_body_arrives() -> None:
    p = RequestParser(max_body_bytes=10)
    p.feed(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 11\r\n\r\n")
    with pytest.raises(RemoteProtocolError) as info:
        p.next_request()
    assert info.value.status == 413
    with pytest.raises(RemoteProtocolError):  # unusable afterwards
        p.next_request()
    assert one(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n0123456789", max_body_bytes=10)


def test_garbage_is_refused_early() -> None:
    p = RequestParser()
    p.feed(b" GET")  # h11's heuristic: no request line starts with a space or control
    with pytest.raises(RemoteProtocolError):
        p.next_request()


def test_errors_name_who_broke_the_protocol() -> None:
    # The client sent a malformed request: remote, with the status to answer (400 by default).
    with pytest.raises(RemoteProtocolError) as remote:
        parse(b"GET / HTTP/1.1\r\nHost: x\r\nBad Header: x\r\n\r\n")
    assert remote.value.status == 400 and not isinstance(remote.value, LocalProtocolError)
    # We were about to send a bad header or framing header: local.
    for bad in ([("x", "a\r\nInjected: 1")], [("Content-Length", "x")], [("Transfer-Encoding", "gzip")]):
        with pytest.raises(LocalProtocolError) as local:
            serialize_response_head(200, bad, body_length=1)
        assert not isinstance(local.value, RemoteProtocolError)
    with pytest.raises(LocalProtocolError):
        serialize_response_head(99, [])
    for exc in (remote.value, local.value):  # one base for "either", still a ValueError
        assert isinstance(exc, ProtocolError) and isinstance(exc, ValueError)


@settings(max_examples=500)
@given(st.binary(max_size=300), st.lists(st.integers(0, 300), max_size=8))
@example(b"GET / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffffffff\r\n", [])
def test_garbage_never_raises_anything_but_protocol_error(raw: bytes, cuts: list[int]) -> None:
    try:
        reqs = parse(raw, cuts)
    except RemoteProtocolError as exc:
        assert exc.status in (400, 413, 431, 501, 505)
    else:
        for req in reqs:
            assert isinstance(req.body, bytes)


@settings(max_examples=500, suppress_health_check=[HealthCheck.too_slow])
@given(requests(lf_only=False), st.data())
def test_mutated_requests_are_refused_or_parsed_like_h11(case: tuple[bytes, dict], data: st.DataObject) -> None:
    raw, _ = case
    i = data.draw(st.integers(0, len(raw)))
    junk = data.draw(st.binary(min_size=1, max_size=3) | st.sampled_from([b" ", b"\r", b"\n", b":", b"\x00", b"\t"]))
    mutated = raw[:i] + junk + raw[i + data.draw(st.integers(0, 2)):]
    try:
        reqs = parse(mutated)
    except RemoteProtocolError:
        return
    # What we accept, h11 accepts the same way (we are only ever stricter), apart from
    # optional whitespace before a chunk extension's ";" (RFC 9112 BWS).
    if b" ;" in mutated or b"\t;" in mutated:
        return
    try:
        theirs = as_h11(mutated)
    except h11.RemoteProtocolError as exc:
        pytest.fail(f"h11 refuses what we accept: {exc}; {[summary(r) for r in reqs]}")
    assert [summary(r) for r in reqs] == theirs[:len(reqs)]


# ------------------------------------------------------------------------------ response heads


def h11_response(status: int, headers: list[tuple[str, str]], method: str, version: str, close: bool,
                 body_length: int | None) -> tuple[bytes, str]:
    """What the h11-based server wrote for a response, and its framing and keep-alive."""
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(f"{method} / HTTP/{version}\r\nHost: x\r\n{'Connection: close' + chr(13) + chr(10) if close else ''}"
                      f"\r\n".encode())
    assert type(conn.next_event()) is h11.Request and type(conn.next_event()) is h11.EndOfMessage
    if body_length is not None and status not in (204, 304) and not any(
            n.lower() == "content-length" for n, _ in headers):
        headers = [*headers, ("content-length", str(body_length))]
    reason = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else ""
    head = conn.send(h11.Response(status_code=status, headers=headers, reason=reason))
    framing = type(conn._writer).__name__  # ContentLengthWriter, ChunkedWriter, Http10Writer
    return head, framing


def ours_vs_h11(status: int, headers: list[tuple[str, str]], method: str = "GET", version: str = "1.1",
                close: bool = False, body_length: int | None = None) -> tuple[bytes, int, int, bool]:
    try:
        expected, _ = h11_response(status, headers, method, version, close, body_length)
    except (h11.LocalProtocolError, UnicodeEncodeError):  # h11 encodes str headers as ASCII
        with pytest.raises(LocalProtocolError):
            serialize_response_head(status, headers, method=method, http_version=version, keep_alive=not close,
                                    body_length=body_length)
        return b"", -1, 0, False
    out = serialize_response_head(status, headers, method=method, http_version=version,
                                  keep_alive=not close and version == "1.1", body_length=body_length)
    assert out[0] == expected
    return out


def test_response_heads_match_h11() -> None:
    sse = [("content-type", "text/event-stream"), ("x-request-id", "abc")]
    assert ours_vs_h11(200, sse) == (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nx-request-id: abc\r\nTransfer-Encoding: chunked\r\n\r\n",
        BODY_CHUNKED, 0, True)
    assert ours_vs_h11(200, sse, version="1.0")[1:] == (BODY_CLOSE, 0, False)
    assert ours_vs_h11(200, sse, method="HEAD", version="1.0")[1:] == (BODY_NONE, 0, False)
    assert ours_vs_h11(404, [("content-type", "application/json")], body_length=7) == (
        b"HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\ncontent-length: 7\r\n\r\n", BODY_LENGTH, 7, True)
    assert ours_vs_h11(200, [], body_length=0, close=True) == (
        b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nConnection: close\r\n\r\n", BODY_LENGTH, 0, False)
    assert ours_vs_h11(204, [], body_length=0)[1:] == (BODY_NONE, 0, True)
    assert ours_vs_h11(304, [("etag", '"x"')])[1:] == (BODY_NONE, 0, True)
    assert ours_vs_h11(200, [], method="HEAD", body_length=5)[1:] == (BODY_NONE, 0, True)
    assert ours_vs_h11(200, [("Content-Length", "4")])[1:] == (BODY_LENGTH, 4, True)
    assert ours_vs_h11(200, [("Content-Length", "4, 4"), ("content-length", "4")])[1:] == (BODY_LENGTH, 4, True)
    assert ours_vs_h11(200, [("Content-Length", "004")])[1:] == (BODY_LENGTH, 4, True)
    assert ours_vs_h11(200, [("Transfer-Encoding", "chunked"), ("Content-Length", "9")], body_length=3)[1:] == (
        BODY_CHUNKED, 0, True)
    assert ours_vs_h11(200, [("Transfer-Encoding", "Chunked")], version="1.0")[1:] == (BODY_CLOSE, 0, False)
    assert ours_vs_h11(200, [("Connection", "close")], body_length=1)[1:] == (BODY_LENGTH, 1, False)
    assert ours_vs_h11(200, [("Connection", "keep-alive, Foo")], body_length=1, close=True)[1:] == (
        BODY_LENGTH, 1, False)
    assert ours_vs_h11(200, [("Connection", "keep-alive")], version="1.0")[1:] == (BODY_CLOSE, 0, False)
    for bad in ([("x", "a\r\nInjected: 1")], [("x", " leading")], [("x", "trailing ")], [("bad name", "v")],
                [("x", "caf\u00e9")], [("x", "nul\x00")], [("Transfer-Encoding", "gzip")],
                [("Content-Length", "1"), ("Content-Length", "2")], [("Content-Length", "x")]):
        ours_vs_h11(200, bad, body_length=1)
        with pytest.raises(LocalProtocolError):
            serialize_response_head(200, bad, body_length=1)
    for status in (100, 199, 1000, "200"):
        with pytest.raises(LocalProtocolError):
            serialize_response_head(status, [])  # type: ignore[arg-type]
    assert serialize_response_head(999, [], body_length=0)[0].startswith(b"HTTP/1.1 999 \r\n")  # no standard phrase: none


def test_status_lines_carry_the_standard_reason_phrase() -> None:
    for status, line in ((200, b"200 OK"), (413, b"413 " + HTTPStatus(413).phrase.encode()), (429, b"429 Too Many Requests"),
                         (502, b"502 Bad Gateway"), (503, b"503 Service Unavailable"), (599, b"599 ")):
        assert serialize_response_head(status, [], body_length=0)[0].startswith(b"HTTP/1.1 " + line + b"\r\n")
    assert CONTINUE == b"HTTP/1.1 100 Continue\r\n\r\n"


def test_response_head_for_an_unknown_version_is_length_delimited() -> None:
    # A malformed request (http_version=None): as h11, assume the worst of the peer.
    head, framing, _, keep = serialize_response_head(400, [("content-type", "application/json")],
                                                     http_version=None, keep_alive=False, body_length=2)
    assert head == b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: 2\r\nConnection: close\r\n\r\n"
    assert framing == BODY_LENGTH and not keep
    assert serialize_response_head(500, [], http_version=None)[1:] == (BODY_CLOSE, 0, False)


_RESP_NAMES = st.sampled_from(["Content-Type", "x-request-id", "Cache-Control", "Content-Length", "content-length",
                               "Transfer-Encoding", "Connection", "connection", "X-Y"])
_RESP_VALUES = st.sampled_from(["text/plain", "no-cache", "0", "5", "5, 5", "12", "chunked", "CHUNKED", "close",
                                "keep-alive", "Keep-Alive, foo", "upgrade", "", "a b", "x\tz", "gzip", "bad\x01"])


@settings(max_examples=600)
@given(st.sampled_from([200, 201, 204, 304, 404, 500, 599]), st.lists(st.tuples(_RESP_NAMES, _RESP_VALUES), max_size=5),
       st.sampled_from(["GET", "HEAD", "POST"]), st.sampled_from(["1.0", "1.1"]), st.booleans(),
       st.none() | st.integers(0, 20))
def test_any_response_head_matches_h11(status: int, headers: list[tuple[str, str]], method: str, version: str,
                                       close: bool, body_length: int | None) -> None:
    if any("\x01" in v for _, v in headers):  # we refuse controls in values; h11 lets them through
        with pytest.raises(LocalProtocolError):
            serialize_response_head(status, headers, method=method, http_version=version, body_length=body_length)
        return
    try:
        _, writer = h11_response(status, headers, method, version, close, body_length)
    except h11.LocalProtocolError:
        writer = ""
    head, framing, length, keep = ours_vs_h11(status, headers, method, version, close, body_length)
    if not head:
        return
    # the framing h11 would use for the body (HEAD: none, whatever the headers say)
    if method == "HEAD" or status in (204, 304):
        assert framing == BODY_NONE
    else:
        assert {"ContentLengthWriter": BODY_LENGTH, "ChunkedWriter": BODY_CHUNKED,
                "Http10Writer": BODY_CLOSE}[writer] == framing
    # keep-alive as h11 decides it, once the response is complete
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(f"{method} / HTTP/{version}\r\nHost: x\r\n{'Connection: close' + chr(13) + chr(10) if close else ''}"
                      f"\r\n".encode())
    conn.next_event()
    conn.next_event()
    if body_length is not None and status not in (204, 304) and not any(
            n.lower() == "content-length" for n, _ in headers):
        headers = [*headers, ("content-length", str(body_length))]
    conn.send(h11.Response(status_code=status, headers=headers))
    if framing == BODY_LENGTH and length:
        conn.send(h11.Data(data=b"x" * length))
    conn.send(h11.EndOfMessage())
    assert keep == (conn.our_state is h11.DONE and conn.their_state is h11.DONE)
