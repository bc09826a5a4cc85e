"""A router stopped with SIGTERM drains (docs/ha.md "Behind a load balancer"), over real processes:
new connections are refused at once, /ready answers 503 "draining" on a connection still open, an
idle keep-alive connection is closed, and the requests in flight — streamed or not — finish, each
answered with "connection: close" where its head was not out yet; then the process exits."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from .test_router_integration import Daemon, procs, sim, write_config  # noqa: F401 — procs is a fixture
from .test_sim_vllm import wait_for

SLOW = ("--sim-decode-ms-per-token", "100", "--sim-prefill-ms-per-token", "0")


def _running(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:num_requests_running"))


def _logged(d: Daemon, words: str) -> bool:
    return any(words in line for line in d.err)


def _raw(port: int, data: bytes = b"") -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    if data:
        s.sendall(data)
    return s


def _read_response(s: socket.socket) -> bytes:
    """One response's head and (content-length) body; the connection is left as it is."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(65536)
        assert chunk, buf
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    while len(body) < length:
        chunk = s.recv(65536)
        assert chunk
        body += chunk
    return head + b"\r\n\r\n" + body


def test_sigterm_lets_requests_in_flight_finish_and_refuses_new_connections(procs: list[Any], tmp_path: Path) -> None:
    engine = sim(procs, *SLOW)
    d = Daemon(write_config(tmp_path, [{"name": "m", "replicas": [{"url": engine.url}]}]), log_level="info")
    procs.append(d)
    wait_for(lambda: httpx.get(f"{d.url}/ready").status_code == 200)
    port = d.info["port"]
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20}
    results: dict[str, Any] = {}

    def streamed() -> None:  # ~2 s of tokens
        with httpx.stream("POST", f"{d.url}/v1/chat/completions", json={**body, "stream": True}, timeout=30) as r:
            results["stream_status"] = r.status_code
            results["stream"] = [x for x in r.iter_lines() if x]

    def plain() -> None:
        r = httpx.post(f"{d.url}/v1/chat/completions", json=body, timeout=30)
        results["plain"] = r

    threads = [threading.Thread(target=streamed), threading.Thread(target=plain)]
    for t in threads:
        t.start()
    wait_for(lambda: _running(engine.url) == 2)  # both are at the engine
    idle = _raw(port, b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")  # a keep-alive connection, then idle
    assert b" 200 " in _read_response(idle).split(b"\r\n")[0]
    half = _raw(port, b"GET /ready HTTP/1.1\r\n")  # a request being read when the signal comes
    t0 = time.monotonic()
    d.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: _logged(d, "draining:"), timeout=10)
    assert _logged(d, "draining: 2 request(s) in flight")
    # a new connection is refused: a client or a load balancer goes to another router
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    # the idle keep-alive connection is closed (EOF), not kept to the end of the grace
    idle.settimeout(10)
    assert idle.recv(100) == b""
    idle.close()
    # the request still being read is answered: not ready (draining), and the connection closes after it
    half.sendall(b"host: x\r\n\r\n")
    resp = _read_response(half)
    head = resp.split(b"\r\n\r\n")[0].lower()
    assert head.startswith(b"http/1.1 503") and b"connection: close" in head, resp
    assert json.loads(resp.split(b"\r\n\r\n", 1)[1])["status"] == "draining"
    half.settimeout(10)
    assert half.recv(100) == b""
    half.close()
    for t in threads:
        t.join(30)
    # both requests in flight completed, whole
    assert results["stream_status"] == 200
    assert results["stream"][-1] == "data: [DONE]"
    events = [json.loads(x[6:]) for x in results["stream"] if x.startswith("data: {")]
    assert any(e["choices"] and e["choices"][0].get("finish_reason") == "length" for e in events)
    plain_r = results["plain"]
    assert plain_r.status_code == 200 and plain_r.json()["usage"]["completion_tokens"] == 20
    assert plain_r.headers.get("connection") == "close"  # its head was not out yet
    # ... and then the process exits by itself, well within the grace (30 s by default)
    assert d.proc.wait(20) == 0
    assert time.monotonic() - t0 < 20
    assert _logged(d, "drained in")


def test_a_second_signal_cuts_at_once(procs: list[Any], tmp_path: Path) -> None:
    engine = sim(procs, "--sim-decode-ms-per-token", "1000", "--sim-prefill-ms-per-token", "0")
    d = Daemon(write_config(tmp_path, [{"name": "m", "replicas": [{"url": engine.url}]}]), log_level="info")
    procs.append(d)
    wait_for(lambda: httpx.get(f"{d.url}/ready").status_code == 200)
    out: list[Any] = []

    def slow() -> None:  # 60 s of tokens: only a cut ends it early
        try:
            out.append(httpx.post(f"{d.url}/v1/chat/completions", timeout=60, json={
                "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 60}))
        except httpx.HTTPError as e:
            out.append(e)

    t = threading.Thread(target=slow)
    t.start()
    wait_for(lambda: _running(engine.url) == 1)
    d.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: _logged(d, "draining: 1 request(s)"), timeout=10)
    assert d.proc.poll() is None  # draining: it waits for the request
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(15) == 0
    t.join(15)
    assert out and isinstance(out[0], httpx.HTTPError)
    assert _logged(d, "a second signal: stopping now")


def test_a_zero_grace_cuts_at_once(procs: list[Any], tmp_path: Path) -> None:
    engine = sim(procs, "--sim-decode-ms-per-token", "1000", "--sim-prefill-ms-per-token", "0")
    d = Daemon(write_config(tmp_path, [{"name": "m", "replicas": [{"url": engine.url}]}],
                            server="shutdown_grace_s = 0"), log_level="info")
    procs.append(d)
    wait_for(lambda: httpx.get(f"{d.url}/ready").status_code == 200)
    out: list[Any] = []

    def slow() -> None:
        try:
            out.append(httpx.post(f"{d.url}/v1/chat/completions", timeout=60, json={
                "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 60}))
        except httpx.HTTPError as e:
            out.append(e)

    t = threading.Thread(target=slow)
    t.start()
    wait_for(lambda: _running(engine.url) == 1)
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(15) == 0
    t.join(15)
    assert out and isinstance(out[0], httpx.HTTPError)
    assert not _logged(d, "draining:")
