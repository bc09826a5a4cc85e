"""llmgw.http1.client: the sans-I/O HTTP/1.1 response parser and request serializer."""

from __future__ import annotations

from dataclasses import dataclass, field

import h11
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from llmgw.http1.client import Data, End, Head, ResponseParser, serialize_request
from llmgw.http1.errors import LocalProtocolError, ProtocolError, RemoteProtocolError

# ------------------------------------------------------------------------------ helpers


def parse(raw: bytes, pieces: list[int] | None = None, *, eof: bool = False, head_request: bool = False,
          ) -> tuple[ResponseParser, list[object]]:
    """Feed ``raw`` split at ``pieces`` offsets; return the parser and normalized events
    (Head, the whole body as one Data, End)."""
    p = ResponseParser(head_request=head_request)
    events: list[object] = []
    cuts = sorted({0, len(raw), *(pieces or [])})
    for a, b in zip(cuts, cuts[1:]):
        events += p.feed(raw[a:b])
    if eof:
        events += p.feed_eof()
    return p, normalize(events)


def normalize(events: list[object]) -> list[object]:
    out: list[object] = []
    for ev in events:
        if isinstance(ev, Data):
            assert ev.data, "empty Data events are never emitted"
            if out and isinstance(out[-1], Data):
                out[-1] = Data(out[-1].data + ev.data)
                continue
            ev = Data(ev.data)
        out.append(ev)
    return out


@dataclass
class Spec:
    """A valid response and the events it must parse to."""
    raw: bytes
    head: Head
    body: bytes
    trailers: list[tuple[str, str]] = field(default_factory=list)
    keep_alive: bool = True
    until_close: bool = False
    head_request: bool = False

    def expected(self) -> list[object]:
        out: list[object] = [self.head]
        if self.body:
            out.append(Data(self.body))
        out.append(End(self.trailers))
        return out


TOKEN_CHARS = "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
names = st.text(TOKEN_CHARS, min_size=1, max_size=12).filter(
    lambda n: n.lower() not in ("content-length", "transfer-encoding", "connection"))
# field values: visible latin-1 and inner spaces/tabs; no leading/trailing whitespace
values = st.text(st.characters(codec="latin-1", exclude_characters="\r\n\x7f",
                               exclude_categories=("Cc",)), max_size=20).map(lambda s: s.strip(" \t"))
header_lists = st.lists(st.tuples(names, values), max_size=6)


@st.composite
def responses(draw: st.DrawFn, lf_only: bool | None = None, http10: bool | None = None) -> Spec:
    nl = b"\n" if (draw(st.booleans()) if lf_only is None else lf_only) and draw(st.booleans()) else b"\r\n"
    v10 = draw(st.booleans()) if http10 is None else http10
    status = draw(st.sampled_from([200, 200, 201, 204, 206, 299, 304, 400, 404, 429, 500, 503, 599]))
    reason = draw(st.sampled_from(["OK", "", "Not Found", "Weird Reason  x"]))
    headers = draw(header_lists)
    head_request = draw(st.booleans()) and draw(st.booleans())
    framing = draw(st.sampled_from(["length", "chunked", "close"]))
    if v10 and framing == "chunked":
        framing = "length"
    body = draw(st.binary(max_size=300))
    conn = draw(st.sampled_from([None, "close", "keep-alive", "Keep-Alive, foo"]))
    out_headers = list(headers)
    if conn is not None:
        out_headers.insert(draw(st.integers(0, len(out_headers))), ("Connection", conn))
    no_body = head_request or status in (204, 304)
    trailers: list[tuple[str, str]] = []
    if framing == "length":
        out_headers.append(("Content-Length", str(len(body))))
    elif framing == "chunked":
        out_headers.append(("Transfer-Encoding", draw(st.sampled_from(["chunked", "Chunked", "gzip, chunked"]))))
    if no_body:
        body_raw = b""
        wire_body = b""
        framing = "none"
    elif framing == "chunked":
        cuts = sorted(set(draw(st.lists(st.integers(0, len(body)), max_size=6))) | {0, len(body)})
        parts = [body[a:b] for a, b in zip(cuts, cuts[1:]) if b > a]
        wire = b""
        for part in parts:
            size = draw(st.sampled_from(["%x", "%X", "%04x"])) % len(part)
            ext = draw(st.sampled_from(["", ";a=b", "; name=\"q;v\"", ";x"]))
            wire += f"{size}{ext}".encode() + nl + part + b"\r\n"
        wire += b"0" + draw(st.sampled_from([b"", b";end"])) + nl
        trailers = draw(st.lists(st.tuples(names, values), max_size=3))
        for k, v in trailers:
            wire += f"{k}: {v}".encode("latin-1") + nl
        wire += nl
        body_raw, wire_body = body, wire
    else:
        body_raw, wire_body = body, body
    interim = b""
    if draw(st.booleans()) and draw(st.booleans()):
        interim = b"HTTP/1.1 100 Continue" + nl + nl + b"HTTP/1.1 103 Early Hints" + nl + b"Link: </a>" + nl + nl
    status_line = f"HTTP/1.{0 if v10 else 1} {status}" + (f" {reason}" if reason else "")
    head_raw = status_line.encode() + nl + b"".join(
        f"{k}:{draw(st.sampled_from(['', ' ', '  ', chr(9)]))}{v}".encode("latin-1") + nl for k, v in out_headers) + nl
    tokens = {t.strip().lower() for t in (conn or "").split(",")}
    until_close = framing == "close"
    keep_alive = not until_close and ("keep-alive" in tokens if v10 else "close" not in tokens)
    head = Head(status, [(k.lower(), v) for k, v in out_headers], reason, "1.0" if v10 else "1.1")
    return Spec(interim + head_raw + wire_body, head, b"" if no_body else body_raw,
                [(k.lower(), v) for k, v in trailers], keep_alive, until_close, head_request)


def check(spec: Spec, cuts: list[int] | None) -> None:
    p, events = parse(spec.raw, cuts, eof=spec.until_close, head_request=spec.head_request)
    assert events == spec.expected()
    assert p.done
    assert p.keep_alive is spec.keep_alive


# ------------------------------------------------------------------------------ properties


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(responses(), st.data())
def test_any_split_gives_the_same_events(spec: Spec, data: st.DataObject) -> None:
    check(spec, None)
    cuts = data.draw(st.lists(st.integers(0, len(spec.raw)), max_size=20))
    check(spec, cuts)


@settings(max_examples=60)
@given(responses())
def test_byte_by_byte(spec: Spec) -> None:
    check(spec, list(range(len(spec.raw))))


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(responses(lf_only=False, http10=False))
def test_agrees_with_h11(spec: Spec) -> None:
    assume(b"gzip, chunked" not in spec.raw)  # h11 refuses other transfer codings
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="HEAD" if spec.head_request else "GET", target="/", headers=[("Host", "x")]))
    conn.send(h11.EndOfMessage())
    conn.receive_data(spec.raw)
    if spec.until_close:
        conn.receive_data(b"")
    got: list[object] = []
    while True:
        ev = conn.next_event()
        if ev is h11.NEED_DATA or type(ev) is h11.ConnectionClosed:
            break
        if type(ev) is h11.Response:
            got.append(Head(ev.status_code, [(k.decode(), v.decode("latin-1")) for k, v in ev.headers],
                            ev.reason.decode("latin-1"), ev.http_version.decode()))
        elif type(ev) is h11.Data:
            got.append(Data(bytes(ev.data)))
        elif type(ev) is h11.EndOfMessage:
            got.append(End([(k.decode(), v.decode("latin-1")) for k, v in ev.headers]))
            break
    def folded(events: list[object]) -> list[object]:  # h11 lowercases these two values
        for ev in events:
            if isinstance(ev, Head):
                ev.headers = [(k, v.lower() if k in ("transfer-encoding", "connection") else v)
                              for k, v in ev.headers]
        return events
    assert folded(normalize(got)) == folded(spec.expected())
    if not spec.until_close:
        assert (conn.their_state is h11.DONE) is spec.keep_alive


garbage_prefixes = st.sampled_from([b"", b"HTTP/1.1 ", b"HTTP/1.1 200 OK\r\n", b"HTTP/1.1 200 OK\r\nA: b\r\n",
                                    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n",
                                    b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\n"])


@settings(max_examples=500)
@given(garbage_prefixes, st.binary(max_size=200), st.lists(st.integers(0, 250), max_size=8), st.booleans())
def test_garbage_only_raises_protocol_error(prefix: bytes, junk: bytes, cuts: list[int], eof: bool) -> None:
    raw = prefix + junk
    p = ResponseParser()
    try:
        for a, b in zip([0, *sorted(cuts)], [*sorted(cuts), len(raw)]):
            p.feed(raw[a:b])
        if eof:
            p.feed_eof()
    except RemoteProtocolError:
        with pytest.raises(RemoteProtocolError):
            p.feed(b"more")  # stays failed


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(responses(), st.data())
def test_mutated_responses_only_raise_protocol_error(spec: Spec, data: st.DataObject) -> None:
    raw = bytearray(spec.raw)
    for _ in range(data.draw(st.integers(1, 4))):
        if not raw:
            break
        i = data.draw(st.integers(0, len(raw) - 1))
        op = data.draw(st.sampled_from(["flip", "insert", "delete"]))
        if op == "flip":
            raw[i] = data.draw(st.integers(0, 255))
        elif op == "insert":
            raw[i:i] = data.draw(st.binary(min_size=1, max_size=4))
        else:
            del raw[i]
    cuts = data.draw(st.lists(st.integers(0, len(raw)), max_size=6))
    try:
        parse(bytes(raw), cuts, eof=data.draw(st.booleans()), head_request=spec.head_request)
    except RemoteProtocolError:
        pass


# ------------------------------------------------------------------------------ examples


def test_chunked_many_chunks_in_one_feed_is_one_data_event() -> None:
    raw = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
           + b"".join(b"%x\r\n%b\r\n" % (len(c), c) for c in (b"data: a\n\n", b"data: bb\n\n", b"x" * 300))
           + b"0\r\n\r\n")
    p = ResponseParser()
    events = p.feed(raw)
    assert [type(e) for e in events] == [Head, Data, End]
    assert events[1].data == b"data: a\n\ndata: bb\n\n" + b"x" * 300  # type: ignore[union-attr]
    assert p.keep_alive and p.done


def test_large_chunk_across_reads() -> None:
    body = bytes(range(256)) * 300  # 76800 bytes: beyond the table of common size lines
    raw = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunk_of(body) + chunk_of(b"end") + b"0\r\n\r\n"
    for step in (1000, 65536, len(raw)):
        p, events = parse(raw, list(range(0, len(raw), step)))
        assert events[1:] == [Data(body + b"end"), End()] and p.keep_alive


def chunk_of(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


def test_feed_body_fast_path_and_trailers() -> None:
    p = ResponseParser()
    assert p.feed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n") == [
        Head(200, [("transfer-encoding", "chunked")], "OK")]
    assert p.feed_body(b"5;ext=1\r\nhel") == b"hel"
    assert p.feed_body(b"lo\r") == b"lo"
    assert p.feed_body(b"\n0\r\nX-Checksum: ab\r\n  cd\r\n") == b""
    assert not p.done
    assert p.feed_body(b"\r\n") == b"" and p.done
    assert p.trailers == [("x-checksum", "ab cd")]
    assert p.keep_alive


def test_head_fields() -> None:
    p = ResponseParser()
    [head, end] = p.feed(b"HTTP/1.1 404 Not  Found \r\nContent-Type:  text/plain \r\nX-A: 1\r\nx-a: 2\r\n"
                         b"Content-Length: 0\r\n\r\n")
    assert head == Head(404, [("content-type", "text/plain"), ("x-a", "1"), ("x-a", "2"), ("content-length", "0")],
                        "Not  Found", "1.1")
    assert isinstance(head, Head) and head.header("x-a") == "1" and head.header("nope") is None
    assert end == End()


def test_obs_fold_and_bare_lf() -> None:
    _, events = parse(b"HTTP/1.1 200 OK\nX-Long: a\n b\n\tc\nContent-Length: 2\n\nhi")
    assert events == [Head(200, [("x-long", "a b c"), ("content-length", "2")], "OK"), Data(b"hi"), End()]


@pytest.mark.parametrize("status", [204, 304])
def test_no_body_statuses_ignore_framing(status: int) -> None:
    p, events = parse(b"HTTP/1.1 %d X\r\nContent-Length: 10\r\n\r\n" % status)
    assert events == [Head(status, [("content-length", "10")], "X"), End()]
    assert p.keep_alive


def test_head_request_has_no_body() -> None:
    p, events = parse(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", head_request=True)
    assert [type(e) for e in events] == [Head, End] and p.keep_alive


def test_interim_responses_are_skipped_and_101_is_an_error() -> None:
    _, events = parse(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nx")
    assert events == [Head(200, [("content-length", "1")], "OK"), Data(b"x"), End()]
    with pytest.raises(RemoteProtocolError, match="101"):
        ResponseParser().feed(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\n")


def test_until_close_body() -> None:
    p = ResponseParser()
    assert p.feed(b"HTTP/1.1 200 OK\r\n\r\nabc") == [Head(200, [], "OK"), Data(b"abc")]
    assert p.until_close and not p.done
    assert p.feed(b"def") == [Data(b"def")]
    assert p.feed_eof() == [End()]
    assert p.done and not p.keep_alive
    # an unknown final transfer coding is also delimited by close
    p = ResponseParser()
    p.feed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, gzip\r\n\r\n")
    assert p.until_close


def test_keep_alive_rules() -> None:
    def ka(raw: bytes) -> bool:
        p, _ = parse(raw)
        assert p.done
        return p.keep_alive
    assert ka(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
    assert not ka(b"HTTP/1.1 200 OK\r\nConnection: Close\r\nContent-Length: 0\r\n\r\n")
    assert not ka(b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n")
    assert ka(b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 0\r\n\r\n")
    # bytes after the end of the response: the connection is out of sync
    assert not ka(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nxHTTP/1.1")
    p, _ = parse(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nx")
    assert p.feed(b"junk") == [] and not p.keep_alive


def test_content_length_duplicates() -> None:
    _, events = parse(b"HTTP/1.1 200 OK\r\nContent-Length: 2, 2\r\nContent-Length: 2\r\n\r\nab")
    assert events[1:] == [Data(b"ab"), End()]
    with pytest.raises(RemoteProtocolError, match="conflicting"):
        parse(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nab")


@pytest.mark.parametrize("raw", [
    b"HTTP/2 200 OK\r\n\r\n",
    b"HTTP/1.1 20 OK\r\n\r\n",
    b"HTTP/1.1 099 OK\r\n\r\n",
    b"hello world\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nBad Header: x\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nNoColon\r\n\r\n",
    b"HTTP/1.1 200 OK\r\n folded-first: x\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nX: a\x00b\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: 0x10\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0x5\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n+5\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1_0\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1000000000000000\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabXY",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\nbad trailer\r\n\r\n",
])
def test_malformed(raw: bytes) -> None:
    with pytest.raises(RemoteProtocolError):
        parse(raw)


def test_garbage_is_detected_early() -> None:
    with pytest.raises(RemoteProtocolError):
        ResponseParser().feed(b"<html>")
    with pytest.raises(RemoteProtocolError):
        ResponseParser().feed(b"HTTPX")


def test_limits() -> None:
    p = ResponseParser(max_head_bytes=100)
    with pytest.raises(RemoteProtocolError, match="too large"):
        p.feed(b"HTTP/1.1 200 OK\r\n" + b"X: y\r\n" * 30)
    p = ResponseParser()
    p.feed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    with pytest.raises(RemoteProtocolError, match="too long"):
        p.feed(b"5;" + b"x" * 10000)


def test_eof_errors() -> None:
    with pytest.raises(RemoteProtocolError, match="before any response"):
        ResponseParser().feed_eof()
    p = ResponseParser()
    p.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nab")
    with pytest.raises(RemoteProtocolError, match="middle"):
        p.feed_eof()
    p, _ = parse(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
    assert p.feed_eof() == [] and not p.keep_alive


def test_feed_body_before_head() -> None:
    with pytest.raises(RuntimeError):
        ResponseParser().feed_body(b"x")


# ------------------------------------------------------------------------------ requests


def test_serialize_request() -> None:
    raw = serialize_request("POST", "/v1/completions", [("Content-Type", "application/json")], b'{"a":1}',
                            host="10.0.0.1:8000")
    assert raw == (b"POST /v1/completions HTTP/1.1\r\nContent-Type: application/json\r\nhost: 10.0.0.1:8000\r\n"
                   b"content-length: 7\r\n\r\n{\"a\":1}")
    assert serialize_request("GET", "/metrics", [("Host", "h")], host="x") == b"GET /metrics HTTP/1.1\r\nHost: h\r\n\r\n"
    assert serialize_request("POST", "/x") == b"POST /x HTTP/1.1\r\ncontent-length: 0\r\n\r\n"
    assert serialize_request("PUT", "/x", [("content-length", "3")], bytearray(b"abc")).endswith(b"\r\n\r\nabc")


@pytest.mark.parametrize("method,target,headers", [
    ("GET", "/a b", []),
    ("GET", "/", [("X", "a\r\nInjected: 1")]),
    ("GET", "/", [("X\r\nY", "a")]),
    ("GET", "/", [("Bad Name", "a")]),
    ("GET", "/", [("", "a")]),
    ("GET", "/", [("X", "\x00")]),
    ("G T", "/", []),
    ("GET", "/\u20ac", []),
    ("POST", "/", [("Transfer-Encoding", "chunked")]),
])
def test_serialize_rejects_framing_breakers(method: str, target: str, headers: list[tuple[str, str]]) -> None:
    with pytest.raises(LocalProtocolError):
        serialize_request(method, target, headers, b"x")


def test_errors_name_who_broke_the_protocol() -> None:
    # The upstream sent garbage: remote.  We were about to send a bad header: local.
    with pytest.raises(RemoteProtocolError) as remote:
        ResponseParser().feed(b"HTTP/1.1 200 OK\r\nBad Header: x\r\n\r\n")
    assert not isinstance(remote.value, LocalProtocolError)
    with pytest.raises(LocalProtocolError) as local:
        serialize_request("GET", "/", [("X", "a\r\nInjected: 1")])
    assert not isinstance(local.value, RemoteProtocolError)
    for exc in (remote.value, local.value):  # one base for "either", still a ValueError
        assert isinstance(exc, ProtocolError) and isinstance(exc, ValueError)


@settings(max_examples=200)
@given(st.sampled_from(["GET", "POST", "DELETE", "PUT"]), st.text("abcxyz/%?=&-_.~0123456789", min_size=0, max_size=20),
       header_lists, st.binary(max_size=100))
@example("GET", "", [], b"")
def test_serialized_requests_parse_back_with_h11(method: str, path: str, headers: list[tuple[str, str]],
                                                 body: bytes) -> None:
    assume(all(k.lower() != "host" for k, _ in headers))
    raw = serialize_request(method, "/" + path, headers, body, host="example:1")
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(raw)
    req = conn.next_event()
    assert type(req) is h11.Request
    assert req.method.decode() == method and req.target.decode() == "/" + path
    sent = [(k.lower(), v) for k, v in headers] + [("host", "example:1")]
    if body or method in ("POST", "PUT"):
        sent.append(("content-length", str(len(body))))
    assert [(k.decode(), v.decode("latin-1")) for k, v in req.headers] == sent
    got = b""
    while type(ev := conn.next_event()) is h11.Data:
        got += ev.data
    assert type(ev) is h11.EndOfMessage and got == body
