"""The router's HTTP edge against what clients and engines may send: odd request ids, JSON
nested without end, engines' odd headers. Each is a clean answer (a 400, or the request served
with the odd part replaced), never a 500 with a traceback. Real processes: a router daemon in
front of a stub engine (tests/stub_engine.py)."""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from .stub_engine import COMPLETION, StubEngine, handler_of
from .test_router_integration import Daemon, write_config

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def procs() -> Iterator[list[Any]]:
    started: list[Any] = []
    yield started
    for p in reversed(started):
        p.stop()


def start(procs: list[Any], tmp: Path, engine: StubEngine, server: str = "", router: str = "") -> Daemon:
    procs.append(engine)
    d = Daemon(write_config(tmp, [{"name": "m", "replicas": [{"url": engine.url}]}], server=server, router=router))
    procs.append(d)
    return d


def no_traceback(d: Daemon) -> None:
    log = "".join(d.err)
    assert "Traceback" not in log and '"level": "error"' not in log, log[-3000:]


def test_a_request_id_that_cannot_be_a_header_is_replaced(procs: list[Any], tmp_path: Path) -> None:
    engine = StubEngine()
    d = start(procs, tmp_path, engine)
    for bad in ("é".encode(), b"x" * 129, b"a b"):
        r = httpx.post(f"{d.url}/v1/chat/completions", json=CHAT, headers={"x-request-id": bad})
        assert r.status_code == 200, r.text
        rid = r.headers["x-request-id"]
        assert re.fullmatch(r"[0-9a-f]{32}", rid)
        assert engine.last_headers("/v1/chat/completions")["x-request-id"] == rid
    r = httpx.post(f"{d.url}/v1/chat/completions", json=CHAT, headers={"x-request-id": "client-id-1"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "client-id-1"
    no_traceback(d)


@pytest.mark.parametrize("depth", [100_000, 500, 129])
def test_json_nested_too_deep_is_a_400_naming_the_problem(procs: list[Any], tmp_path: Path, depth: int) -> None:
    d = start(procs, tmp_path, StubEngine())
    for nest in (b"[" * depth + b"]" * depth, b'{"a":' * depth + b"1" + b"}" * depth):
        body = b'{"model": "m", "messages": [], "response_format": ' + nest + b"}"
        r = httpx.post(f"{d.url}/v1/chat/completions", content=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert "nested too deeply" in err["message"] and err["type"] == "invalid_request_error"
    # as deep as a real tool schema goes, and many brackets side by side: served
    schema = b'{"a":' * 100 + b"1" + b"}" * 100
    wide = b"[" + b",".join([b"[]"] * 5000) + b"]"
    for extra in (schema, wide):
        r = httpx.post(f"{d.url}/v1/chat/completions", content=b'{"model": "m", "messages": [], "x": ' + extra + b"}")
        assert r.status_code == 200, r.text
    no_traceback(d)


def test_an_integer_too_long_to_read_is_a_400(procs: list[Any], tmp_path: Path) -> None:
    d = start(procs, tmp_path, StubEngine())
    r = httpx.post(f"{d.url}/v1/completions", content=b'{"model": "m", "prompt": [' + b"1" * 5000 + b"]}")
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    no_traceback(d)


def test_an_engine_content_type_that_cannot_be_a_header_is_replaced(procs: list[Any], tmp_path: Path) -> None:
    def odd(ct: bytes) -> bytes:
        return (b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\nconnection: close\r\ncontent-type: %b\r\n\r\n%b"
                % (len(COMPLETION), ct, COMPLETION))

    cts = {"/v1/completions": odd(b"application/json; charset=\xc3\xa9"),
           "/v1/chat/completions": odd(b"text/plain; x=" + b"y" * 300)}
    d = start(procs, tmp_path, StubEngine(handler_of(cts)))
    for path in cts:
        body = CHAT if "chat" in path else {"model": "m", "prompt": "x"}
        r = httpx.post(f"{d.url}{path}", json=body)
        assert r.status_code == 200 and r.headers["content-type"] == "application/json"
        assert r.json()["usage"]["completion_tokens"] == 1
    # a valid one passes as the engine sent it
    plain = StubEngine(handler_of({"/v1/completions": odd(b"application/json; charset=utf-8")}))
    procs.append(plain)
    (tmp_path / "2").mkdir()
    d2 = start(procs, tmp_path / "2", plain)
    r = httpx.post(f"{d2.url}/v1/completions", json={"model": "m", "prompt": "x"})
    assert r.headers["content-type"] == "application/json; charset=utf-8"
    no_traceback(d)


def free_port() -> int:
    with socket.socket() as probe:  # nothing listens there once closed
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_errors_to_clients_name_no_internal_address(procs: list[Any], tmp_path: Path) -> None:
    port = free_port()
    five = StubEngine(handler_of({"/v1/completions": b"HTTP/1.1 503 X\r\ncontent-length: 0\r\n\r\n"}))
    procs.append(five)
    d = Daemon(write_config(tmp_path, [{"name": "m", "replicas": [{"url": f"http://127.0.0.1:{port}"}]},
                                       {"name": "f", "replicas": [{"url": five.url}]}]), log_level="info")
    procs.append(d)
    r = httpx.post(f"{d.url}/v1/completions", json={"model": "m", "prompt": "x"}, headers={"x-request-id": "r-1"})
    assert r.status_code == 502
    msg = r.json()["error"]["message"]
    assert msg == "No replica could serve the request: replica m/0: connection failed"
    r = httpx.post(f"{d.url}/v1/completions", json={"model": "f", "prompt": "x"})
    assert r.status_code == 502 and r.json()["error"]["message"].endswith("replica f/0: answered 503")
    assert "127.0.0.1" not in r.text
    # the log keeps the address, tied to the answer by the request id
    line = next(json.loads(x) for x in d.err if '"r-1"' in x)
    assert f"127.0.0.1:{port}" in line["msg"] and line["endpoint"] == "m/0"


def test_metrics_need_the_api_key_when_keys_are_set(procs: list[Any], tmp_path: Path) -> None:
    d = start(procs, tmp_path, StubEngine(), server='api_keys = ["k1"]')
    r = httpx.get(f"{d.url}/metrics")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(f"{d.url}/metrics", headers={"authorization": "Bearer k1"})
    assert r.status_code == 200 and "llmgw_requests_total" in r.text
    assert httpx.get(f"{d.url}/health").status_code == 200  # load balancers' probe stays open


# -- an engine's answer that breaks off -----------------------------------------------------------
def raw_post(port: int, body: bytes, version: str = "1.1") -> tuple[bytes, str]:
    """POST /v1/completions on a fresh connection; (every byte received, how it ended: "eof" or
    "reset")."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"POST /v1/completions HTTP/{version}\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        out = b""
        while True:
            try:
                data = s.recv(65536)
            except ConnectionResetError:
                return out, "reset"
            if not data:
                return out, "eof"
            out += data


def metric_value(d: Daemon, name: str, **labels: str) -> float:
    for line in httpx.get(f"{d.url}/metrics").text.splitlines():
        key, _, value = line.rpartition(" ")
        if key.split("{")[0] == name and all(f'{k}="{v}"' in key for k, v in labels.items()):
            return float(value)
    return 0.0


TRUNCATED = {
    "short of its length": b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\ncontent-type: application/json\r\n\r\n"
                           b'{"partial":',
    "no body at all": b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\ncontent-type: application/json\r\n\r\n",
    "chunked without its end": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-type: application/json"
                               b'\r\n\r\nb\r\n{"partial":\r\n',
}


@pytest.mark.parametrize("how", TRUNCATED)
def test_a_truncated_engine_answer_is_never_a_complete_200(procs: list[Any], tmp_path: Path, how: str) -> None:
    d = start(procs, tmp_path, StubEngine(handler_of({"/v1/completions": TRUNCATED[how]})))
    out, end = raw_post(d.info["port"], b'{"model": "m", "prompt": "x"}')
    head, _, body = out.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower()
    assert not body.endswith(b"0\r\n\r\n") and end == "eof"  # closed without the last chunk
    if how != "no body at all":
        assert body == b'b\r\n{"partial":\r\n'
    with pytest.raises(httpx.RemoteProtocolError):  # what a client library makes of it
        httpx.post(f"{d.url}/v1/completions", json={"model": "m", "prompt": "x"})
    # counted: an upstream failure of the replica, and the requests as failed (once each)
    assert metric_value(d, "llmgw_upstream_errors_total", endpoint="m/0", kind="reset") == 2
    assert metric_value(d, "llmgw_requests_total", model="m", outcome="upstream_failed") == 2
    assert metric_value(d, "llmgw_requests_total", model="m", outcome="ok") == 0
    no_traceback(d)


def test_a_truncated_answer_to_http10_is_a_reset(procs: list[Any], tmp_path: Path) -> None:
    d = start(procs, tmp_path, StubEngine(handler_of({"/v1/completions": TRUNCATED["short of its length"]})))
    out, end = raw_post(d.info["port"], b'{"model": "m", "prompt": "x"}', version="1.0")
    assert end == "reset"  # a close-delimited body has no other way to say it is cut short
    no_traceback(d)


def test_a_stream_that_breaks_off_gets_an_error_event_then_no_end(procs: list[Any], tmp_path: Path) -> None:
    sse = (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-type: text/event-stream\r\n\r\n"
           b"10\r\ndata: {\"a\": 1}\n\n\r\n")
    d = start(procs, tmp_path, StubEngine(handler_of({"/v1/completions": sse})))
    out, end = raw_post(d.info["port"], b'{"model": "m", "prompt": "x", "stream": true}')
    assert out.startswith(b"HTTP/1.1 200") and end == "eof" and not out.endswith(b"0\r\n\r\n")
    assert b'data: {"a": 1}' in out
    event = json.loads(out.split(b"data: ")[-1].split(b"\n\n")[0])
    assert event["error"]["message"] == ("upstream failed mid-stream: replica m/0: "
                                         "connection closed before the response was complete")
    # the router's one envelope: a string code (it was the number 502)
    assert event["error"]["type"] == "bad_gateway" and event["error"]["code"] == "upstream_failed"
    assert event["error"]["param"] is None
    assert "127.0.0.1" not in out.decode()
    no_traceback(d)


def test_an_https_replica_url_is_a_502_not_a_500(procs: list[Any], tmp_path: Path) -> None:
    # The pool speaks plain http only: an https:// replica (which the config accepts) fails like
    # a refused connection, and the breaker and the retry handle it.
    d = Daemon(write_config(tmp_path, [{"name": "m", "replicas": [{"url": f"https://127.0.0.1:{free_port()}"}]}]))
    procs.append(d)
    r = httpx.post(f"{d.url}/v1/completions", json={"model": "m", "prompt": "x"})
    assert r.status_code == 502 and r.json()["error"]["message"].endswith("replica m/0: connection failed")
    no_traceback(d)


def test_a_model_name_that_cannot_be_a_header_is_encoded_in_x_llmgw_endpoint(procs: list[Any], tmp_path: Path) -> None:
    engine = StubEngine()
    procs.append(engine)
    d = Daemon(write_config(tmp_path, [{"name": "mödel", "replicas": [{"url": engine.url}]}]))
    procs.append(d)
    r = httpx.post(f"{d.url}/v1/completions", json={"model": "mödel", "prompt": "x"})
    assert r.status_code == 200 and r.headers["x-llmgw-endpoint"] == "m%C3%B6del/0"
    no_traceback(d)
