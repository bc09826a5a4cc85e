"""Every client request on the OpenAI port moves ``llmgw_requests_total`` by exactly one, in the
series that says what the client saw: one request of each kind (ok, an engine's 400, 404 unknown
model, 404 route, 405, 401, 413, 429, 502, 503) through a real router daemon in front of stub
engines, /metrics read before and after each. /health and /metrics are not counted."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from .stub_engine import StubEngine, answer, normal
from .test_router_integration import Daemon, write_config

KEY = {"authorization": "Bearer k1"}
ENGINE_400 = json.dumps({"error": {"message": "max_tokens is too large", "type": "BadRequestError",
                                   "param": None, "code": 400}}).encode()


def engine_m(conn: socket.socket, method: str, path: str, body: bytes) -> None:
    """A healthy engine that answers 400 to a prompt "bad" and 500 to a prompt "boom"."""
    if path == "/v1/completions" and b'"bad"' in body:
        conn.sendall(answer(400, ENGINE_400))
    elif path == "/v1/completions" and b'"boom"' in body:
        conn.sendall(answer(500, b'{"error": "engine crashed"}'))
    else:
        normal(conn, method, path, body)


def engine_busy(conn: socket.socket, method: str, path: str, body: bytes) -> None:
    """An engine whose metrics say it is far past saturation."""
    if path == "/metrics":
        conn.sendall(answer(200, b"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 500\n"
                                 b"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 500\n",
                            [("content-type", "text/plain")]))
    elif path == "/v1/models":
        conn.sendall(answer(200, b'{"object":"list","data":[{"id":"busy","object":"model"}]}'))
    else:
        normal(conn, method, path, body)


def series(d: Daemon) -> dict[tuple[str, str, str], float]:
    """llmgw_requests_total by (model, outcome, code)."""
    out = {}
    for line in httpx.get(f"{d.url}/metrics", headers=KEY).text.splitlines():
        if line.startswith("llmgw_requests_total{"):
            key, _, value = line.rpartition(" ")
            labels = dict(kv.split("=", 1) for kv in key[len("llmgw_requests_total{"):-1].split(","))
            out[(labels["model"].strip('"'), labels["outcome"].strip('"'), labels["code"].strip('"'))] = float(value)
    return out


def moved(d: Daemon, before: dict[tuple[str, str, str], float]) -> dict[tuple[str, str, str], float]:
    """What changed since ``before`` (waiting, bounded, for the count a response's end books)."""
    deadline = time.monotonic() + 10
    while True:
        now = series(d)
        diff = {k: v - before.get(k, 0.0) for k, v in now.items() if v != before.get(k, 0.0)}
        if diff or time.monotonic() > deadline:
            return diff
        time.sleep(0.01)


@pytest.fixture
def router(tmp_path: Path) -> Iterator[Daemon]:
    started: list[Any] = [StubEngine(engine_m), StubEngine(engine_busy)]
    try:
        cfg = write_config(tmp_path, [{"name": "m", "replicas": [{"url": started[0].url}]},
                                      {"name": "busy", "replicas": [{"url": started[1].url}]},
                                      {"name": "down", "replicas": []}],  # none yet: the startup 503,
                           server='api_keys = ["k1"]\nmax_body_bytes = 4096', router="queue_size = 0")
        d = Daemon(cfg)
        started.append(d)
        # wait until the busy engine's load is known (else it is only stale: a 503, not a 429)
        deadline = time.monotonic() + 20
        while 'llmgw_endpoint_waiting{endpoint="busy/0",model="busy"} 500.0' not in \
                httpx.get(f"{d.url}/metrics", headers=KEY).text:
            assert time.monotonic() < deadline, "the busy engine was never scraped"
            time.sleep(0.05)
        # The first request refreshes the replica's view (admission reads the view the last
        # decision left): served; from the second on, the saturated replica refuses.
        post(d, "/v1/completions", {"model": "busy", "prompt": "x"})
        yield d
    finally:
        for p in reversed(started):
            p.stop()


def post(d: Daemon, path: str, body: dict[str, Any] | bytes, headers: dict[str, str] = KEY) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{d.url}{path}", content=content, headers={**headers, "content-type": "application/json"},
                      timeout=30)


def raw(d: Daemon, data: bytes) -> httpx.Response:
    """Bytes no HTTP client would send; the answer read back as an httpx.Response."""
    with socket.create_connection(("127.0.0.1", d.info["port"]), timeout=10) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    head, _, body = out.partition(b"\r\n\r\n")
    return httpx.Response(int(head.split(b" ")[1]), content=body)


CASES: list[tuple[str, Callable[[Daemon], httpx.Response], int, tuple[str, str, str]]] = [
    ("ok", lambda d: post(d, "/v1/completions", {"model": "m", "prompt": "hi"}), 200, ("m", "ok", "200")),
    ("engine 400", lambda d: post(d, "/v1/completions", {"model": "m", "prompt": "bad"}), 400,
     ("m", "engine_error", "400")),
    ("404 unknown model", lambda d: post(d, "/v1/completions", {"model": "nope", "prompt": "x"}), 404,
     ("-", "rejected", "404")),
    ("404 route", lambda d: post(d, "/v1/nothing", {"model": "m"}), 404, ("-", "rejected", "404")),
    ("405", lambda d: httpx.get(f"{d.url}/v1/completions", headers=KEY), 405, ("-", "rejected", "405")),
    ("401", lambda d: post(d, "/v1/completions", {"model": "m", "prompt": "x"}, headers={}), 401,
     ("-", "rejected", "401")),
    ("413", lambda d: post(d, "/v1/completions", b'{"model": "m", "prompt": "' + b"x" * 8000 + b'"}'), 413,
     ("-", "rejected", "413")),
    ("431", lambda d: post(d, "/v1/completions", {"model": "m", "prompt": "x"}, headers={**KEY, "x-big": "a" * 70000}),
     431, ("-", "rejected", "431")),
    ("400 malformed HTTP", lambda d: raw(d, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: zz\r\n\r\n"),
     400, ("-", "rejected", "400")),
    ("400 from the router", lambda d: post(d, "/v1/completions", b"{not json"), 400, ("-", "rejected", "400")),
    ("429", lambda d: post(d, "/v1/completions", {"model": "busy", "prompt": "x"}), 429, ("busy", "rejected", "429")),
    ("502", lambda d: post(d, "/v1/completions", {"model": "m", "prompt": "boom"}), 502, ("m", "failed", "502")),
    ("503", lambda d: post(d, "/v1/completions", {"model": "down", "prompt": "x"}), 503, ("down", "failed", "503")),
    ("model list", lambda d: httpx.get(f"{d.url}/v1/models", headers=KEY), 200, ("-", "ok", "200")),
]


def test_each_request_is_counted_once_in_the_series_of_what_the_client_saw(router: Daemon) -> None:
    d = router
    for name, send, status, key in CASES:
        before = series(d)
        r = send(d)
        assert r.status_code == status, (name, r.text)
        err = r.json().get("error") if status >= 400 and key[1] != "engine_error" else None
        if err is not None:  # router-made: one envelope, string code or null, a type, a param
            assert isinstance(err["message"], str) and isinstance(err["type"], str), (name, err)
            assert err["code"] is None or isinstance(err["code"], str), (name, err)
            assert "param" in err, (name, err)
        assert moved(d, before) == {key: 1.0}, name
    before = series(d)
    assert httpx.get(f"{d.url}/health").status_code == 200
    assert httpx.get(f"{d.url}/metrics").status_code == 401  # not a client request either
    assert series(d) == before


def test_an_engine_4xx_does_not_count_against_its_breaker(router: Daemon) -> None:
    d = router
    for _ in range(8):  # more than failure_threshold
        assert post(d, "/v1/completions", {"model": "m", "prompt": "bad"}).status_code == 400
    text = httpx.get(f"{d.url}/metrics", headers=KEY).text
    assert 'llmgw_endpoint_breaker_state{endpoint="m/0",model="m"} 0.0' in text
    assert post(d, "/v1/completions", {"model": "m", "prompt": "hi"}).status_code == 200


# -- a bug in the request path: the server answers 500; the request is still counted once --------
BUG_CFG = """
[[models]]
name = "m"
engine = "vllm"
[[models.replicas]]
url = "http://127.0.0.1:1"
"""


def test_a_request_the_router_fails_on_a_bug_is_counted_once_as_a_500() -> None:
    from llmgw.config import parse_config
    from llmgw.daemon.net.httpserver import Request
    from llmgw.daemon.router.proxy import Router

    async def main() -> None:
        router = Router(parse_config(BUG_CFG), pool=None, seed=1)  # type: ignore[arg-type]
        counts = router.core.counters.requests
        req = Request("POST", "/v1/completions", "/v1/completions", "", [("content-type", "application/json")],
                      b'{"model": "m", "prompt": "x"}', None)

        async def broken_attempt(*args: Any) -> None:
            raise RuntimeError("a bug")

        router._attempt = broken_attempt  # type: ignore[method-assign]
        with pytest.raises(RuntimeError):
            await router.handle(req)
        assert {k: v[0] for k, v in counts.items()} == {("m", "failed", 500): 1}

        def broken_plan(*args: Any, **kw: Any) -> None:
            raise RuntimeError("another bug")

        router.core.plan = broken_plan  # type: ignore[method-assign]
        with pytest.raises(RuntimeError):
            await router.handle(req)
        assert {k: v[0] for k, v in counts.items()} == {("m", "failed", 500): 1, ("-", "failed", 500): 1}

    trio.run(main)
