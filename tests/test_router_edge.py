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
