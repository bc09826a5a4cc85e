"""The router over real sockets, in front of real `llmgw sim` processes, with the `openai` SDK as
the client: streaming, cancellation reaching the engine, engine failures, the breaker, pool spill,
admission and the error envelope."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from .conftest import SimProc, check_daemon_log, start_sim
from .test_sim_vllm import metric, wait_for

SLOW = ["--sim-decode-ms-per-token", "20", "--sim-prefill-ms-per-token", "0"]


class Daemon:
    def __init__(self, config: Path, timeout: float = 30.0, role: str = "router", log_level: str = "warning",
                 extra: tuple[str, ...] = (), prefix: tuple[str, ...] = ()) -> None:
        """`prefix`: a command that runs the daemon and execs it (`ip netns exec NS`: tests/netns.py)."""
        self.proc = subprocess.Popen([*prefix, sys.executable, "-m", "llmgw", "daemon", "--role", role,
                                      "--config", str(config), "--port", "0", "--log-level", log_level, *extra],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        self.label = f"daemon --role {role}"
        self.err: list[str] = []
        self._checked = False
        self._pumped = threading.Thread(target=self._pump, daemon=True)
        self._pumped.start()
        got: list[bytes] = []
        t = threading.Thread(target=lambda: got.append(self.proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        t.start()
        t.join(timeout)
        if not got or not got[0]:
            self.stop()
            raise RuntimeError("router did not start: " + "".join(self.err)[-3000:])
        self.info = json.loads(got[0])
        self.url = self.info.get("url", "")

    def _pump(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.err.append(line.decode(errors="replace"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        if not self._checked:
            self._checked = True
            self._pumped.join(5)  # the log's last lines, written just before the exit
            check_daemon_log(self.label, self.err)


def write_config(tmp: Path, models: list[dict[str, Any]], pools: list[dict[str, Any]] | None = None,
                 router: str = "", server: str = "") -> Path:
    lines = ["[server]", 'host = "127.0.0.1"', server, "[router]", "scrape_interval_s = 0.2", router,
             "[control]", f"store = {json.dumps(str(tmp / 'router.db'))}",
             "[admin]", f"socket = {json.dumps(str(tmp / 'admin' / 'admin.sock'))}"]
    for p in pools or []:
        lines += ["[[pools]]"] + [f"{k} = {json.dumps(v)}" for k, v in p.items()]
    for m in models:
        lines += ["[[models]]", f'name = "{m["name"]}"', f'engine = "{m.get("engine", "vllm")}"']
        for r in m["replicas"]:
            lines += ["[[models.replicas]]"] + [f"{k} = {json.dumps(v)}" for k, v in r.items()]
    path = tmp / "llmgw.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def procs() -> Iterator[list[Any]]:
    started: list[Any] = []
    yield started
    for p in reversed(started):
        p.stop()


def sim(procs: list[Any], *extra: str) -> SimProc:
    s = start_sim(["--engine", "vllm", "m", "--host", "127.0.0.1", "--port", "0", *extra])
    procs.append(s)
    return s


def router(procs: list[Any], tmp: Path, sims: list[SimProc], **kw: Any) -> Daemon:
    reps = kw.pop("replicas", None) or [{"url": s.url} for s in sims]
    d = Daemon(write_config(tmp, [{"name": "m", "replicas": reps}], **kw))
    procs.append(d)
    return d


def test_openai_sdk_through_the_router(procs: list[Any], tmp_path: Path) -> None:
    sims = [sim(procs, "--sim-zero-cost") for _ in range(2)]
    d = router(procs, tmp_path, sims)
    client = openai.OpenAI(base_url=f"{d.url}/v1", api_key="x")
    chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    assert chat.usage.completion_tokens == 5
    stream = list(client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4, stream=True, stream_options={"include_usage": True}))
    assert stream[-1].usage.completion_tokens == 4
    comp = list(client.completions.create(model="m", prompt="abc", max_tokens=3, stream=True))
    assert comp[-1].choices[0].finish_reason == "length"
    ids = [m.id for m in client.models.list().data]
    assert ids == ["m"]
    r = httpx.post(f"{d.url}/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1},
                   headers={"x-request-id": "req-123"})
    assert r.headers["x-request-id"] == "req-123" and r.headers["x-llmgw-endpoint"].startswith("m/")


def test_errors_in_openai_envelope(procs: list[Any], tmp_path: Path) -> None:
    s = sim(procs, "--sim-zero-cost")
    d = router(procs, tmp_path, [s], server="api_keys = [\"k1\"]\nmax_body_bytes = 2000")
    auth = {"authorization": "Bearer k1"}
    r = httpx.post(f"{d.url}/v1/chat/completions", json={"model": "m", "messages": []})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key" and "x-request-id" in r.headers
    r = httpx.post(f"{d.url}/v1/chat/completions", json={"model": "nope", "messages": []}, headers=auth)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = httpx.post(f"{d.url}/v1/chat/completions", content=b"{bad", headers=auth)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{d.url}/v1/chat/completions", json={"messages": []}, headers=auth)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    r = httpx.post(f"{d.url}/v1/chat/completions", content=b"x" * 5000, headers=auth)
    assert r.status_code == 413
    # Unknown fields pass through to the engine untouched.
    r = httpx.post(f"{d.url}/v1/completions", headers=auth,
                   json={"model": "m", "prompt": "x", "max_tokens": 1, "brand_new_field": {"a": 1}})
    assert r.status_code == 200
    # The engine's own 4xx comes back as the engine said it, and is no breaker failure.
    r = httpx.post(f"{d.url}/v1/completions", headers=auth, json={"model": "m", "prompt": "x", "max_tokens": -1})
    assert r.status_code == 400 and "error" in r.json()


def test_client_disconnect_cancels_the_engine_request(procs: list[Any], tmp_path: Path) -> None:
    s = sim(procs, *SLOW)
    d = router(procs, tmp_path, [s])
    host, port = "127.0.0.1", d.info["port"]
    body = json.dumps({"model": "m", "prompt": "x", "max_tokens": 2000, "ignore_eos": True, "stream": True}).encode()
    sock = socket.create_connection((host, port))
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
                 f"Content-Type: application/json\r\n\r\n".encode() + body)
    assert sock.recv(100).startswith(b"HTTP/1.1 200")
    wait_for(lambda: metric(s.url, "vllm:num_requests_running") == 1)
    sock.close()
    wait_for(lambda: metric(s.url, "vllm:num_requests_running") == 0)
    assert metric(s.url, "vllm:request_success_total", finished_reason="abort") == 1


def test_engine_killed_mid_stream_gives_a_clean_error(procs: list[Any], tmp_path: Path) -> None:
    a = sim(procs, *SLOW)
    b = sim(procs, *SLOW)  # both slow: the stream is still running wherever it lands
    d = router(procs, tmp_path, [a, b])
    client = openai.OpenAI(base_url=f"{d.url}/v1", api_key="x", max_retries=0)
    stream = client.completions.create(model="m", prompt="x", max_tokens=500, stream=True,
                                       extra_body={"ignore_eos": True})
    first = next(iter(stream))
    assert first.choices
    wait_for(lambda: metric(a.url, "vllm:num_requests_running") + metric(b.url, "vllm:num_requests_running") == 1)
    victim = a if metric(a.url, "vllm:num_requests_running") == 1 else b
    os.killpg(victim.proc.pid, signal.SIGKILL)
    with pytest.raises(openai.APIError):
        for _ in stream:
            pass
    # The router keeps serving: the surviving replica answers.
    out = client.completions.create(model="m", prompt="x", max_tokens=2)
    assert out.usage.completion_tokens == 2


def free_port() -> int:
    with socket.socket() as probe:  # nothing listens there (yet)
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_failed_connect_is_retried_on_another_replica(procs: list[Any], tmp_path: Path) -> None:
    victim = sim(procs, "--sim-zero-cost")
    good = sim(procs, "--sim-zero-cost")
    d = router(procs, tmp_path, [victim, good], replicas=[{"url": victim.url, "weight": 100.0}, {"url": good.url}],
               router="stale_after_s = 60\n[router.breaker]\nfailure_threshold = 1\ncooldown_s = 30")
    wait_for(lambda: metric(d.url, "llmgw_endpoint_stale", endpoint="m/0") == 0.0)
    victim.stop()  # its last scrape still says idle, and batch weighs its weight of 100: it is picked
    for _ in range(4):
        r = httpx.post(f"{d.url}/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1},
                       headers={"x-llmgw-strategy": "batch"})
        assert r.status_code == 200 and r.headers["x-llmgw-endpoint"] == "m/1"
    assert metric(d.url, "llmgw_endpoint_breaker_state", endpoint="m/0") == 2.0
    assert metric(d.url, "llmgw_upstream_errors_total", endpoint="m/0") == 1  # then the open breaker skips it


def test_breaker_opens_and_recovers_with_half_open_probes(procs: list[Any], tmp_path: Path) -> None:
    port = free_port()
    d = Daemon(write_config(tmp_path, [{"name": "m", "replicas": [{"url": f"http://127.0.0.1:{port}"}]}],
                            router="[router.breaker]\nfailure_threshold = 2\ncooldown_s = 0.3\nmax_cooldown_s = 0.6"))
    procs.append(d)
    for _ in range(2):
        r = httpx.post(f"{d.url}/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1})
        assert r.status_code == 502
    assert metric(d.url, "llmgw_endpoint_breaker_state", endpoint="m/0") == 2.0
    revived = sim(procs, "--sim-zero-cost", "--port", str(port))
    assert revived.info["port"] == port

    def recovered() -> bool:
        httpx.post(f"{d.url}/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1})
        return metric(d.url, "llmgw_endpoint_breaker_state", endpoint="m/0") == 0.0

    wait_for(recovered, timeout=15)


def test_all_replicas_down_gives_502_not_a_hang(procs: list[Any], tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    d = Daemon(write_config(tmp_path, [{"name": "m", "replicas": [{"url": dead}]}],
                            router="[router.breaker]\nfailure_threshold = 1\ncooldown_s = 30"))
    procs.append(d)
    for _ in range(3):  # an open breaker still lets the replica closest to recovery be tried
        r = httpx.post(f"{d.url}/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1})
        assert r.status_code == 502 and r.json()["error"]["type"] == "bad_gateway"


def test_saturated_pool_spills_to_the_next_by_priority(procs: list[Any], tmp_path: Path) -> None:
    primary = sim(procs, *SLOW)
    burst = sim(procs, *SLOW)
    d = Daemon(write_config(
        tmp_path, [{"name": "m", "replicas": [{"url": primary.url, "pool": "primary"},
                                                 {"url": burst.url, "pool": "burst"}]}],
        pools=[{"name": "primary", "priority": 0, "max_inflight_per_replica": 1},
               {"name": "burst", "priority": 10}]))
    procs.append(d)
    body = {"model": "m", "prompt": "x", "max_tokens": 30, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as c, c.stream("POST", f"{d.url}/v1/completions", json=body) as first:
        assert first.headers["x-llmgw-endpoint"] == "m/0"
        second = c.post(f"{d.url}/v1/completions", json={**body, "stream": False})
        assert second.status_code == 200 and second.headers["x-llmgw-endpoint"] == "m/1"
        first.read()


def test_admission_429_with_retry_after_when_everything_is_saturated(procs: list[Any], tmp_path: Path) -> None:
    s = sim(procs, *SLOW)
    d = Daemon(write_config(tmp_path, [{"name": "m", "replicas": [{"url": s.url, "pool": "p"}]}],
                            pools=[{"name": "p", "max_inflight_per_replica": 1}],
                            router="queue_size = 1\nqueue_timeout_s = 0.3"))
    procs.append(d)
    body = {"model": "m", "prompt": "x", "max_tokens": 100, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as c, c.stream("POST", f"{d.url}/v1/completions", json=body) as held:
        assert held.status_code == 200
        r = c.post(f"{d.url}/v1/completions", json={**body, "stream": False})  # waits 0.3 s in the queue
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["type"] == "rate_limit"
    r = httpx.post(f"{d.url}/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1})
    assert r.status_code == 200


class GarbageEngine:
    """An 'engine' that answers every request with bytes that are not HTTP."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)
                conn.sendall(b"\x00\x01garbage that is not HTTP\r\n\r\n")

    def stop(self) -> None:
        self.sock.close()


def test_engine_answering_garbage_is_retried_elsewhere_and_reported(procs: list[Any], tmp_path: Path) -> None:
    bad = GarbageEngine()
    procs.append(bad)
    good = sim(procs, "--sim-zero-cost")
    d = router(procs, tmp_path, [good], replicas=[{"url": bad.url}, {"url": good.url}])
    for _ in range(4):
        r = httpx.post(f"{d.url}/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1},
                       headers={"x-llmgw-strategy": "batch"})
        assert r.status_code == 200 and r.headers["x-llmgw-endpoint"] == "m/1"
    (tmp_path / "alone").mkdir()
    alone = Daemon(write_config(tmp_path / "alone", [{"name": "m", "replicas": [{"url": bad.url}]}]))
    procs.append(alone)
    r = httpx.post(f"{alone.url}/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1})
    assert r.status_code == 502 and r.json()["error"]["type"] == "bad_gateway"
    assert httpx.get(f"{alone.url}/health").status_code == 200


def test_a_pool_cap_is_never_exceeded_even_when_every_pool_is_saturated(procs: list[Any], tmp_path: Path) -> None:
    s = sim(procs, "--sim-decode-ms-per-token", "5", "--sim-prefill-ms-per-token", "0")
    d = Daemon(write_config(tmp_path, [{"name": "m", "replicas": [{"url": s.url, "pool": "p"}]}],
                            pools=[{"name": "p", "max_inflight_per_replica": 1}],
                            router="queue_size = 8\nqueue_timeout_s = 20"))
    procs.append(d)
    results: list[int] = []
    peak = [0.0]
    body = {"model": "m", "prompt": "x", "max_tokens": 20, "ignore_eos": True}

    def client() -> None:
        results.append(httpx.post(f"{d.url}/v1/completions", json=body, timeout=30).status_code)

    threads = [threading.Thread(target=client) for _ in range(4)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        peak[0] = max(peak[0], metric(s.url, "vllm:num_requests_running") + metric(s.url, "vllm:num_requests_waiting"))
    for t in threads:
        t.join()
    assert results == [200, 200, 200, 200]  # each waited its turn in the admission queue
    assert peak[0] <= 1  # the engine never saw two at once


def test_embeddings_through_the_router(procs: list[Any], tmp_path: Path) -> None:
    s = sim(procs, "--sim-zero-cost", "--runner", "pooling")
    d = router(procs, tmp_path, [s])
    client = openai.OpenAI(base_url=f"{d.url}/v1", api_key="x")
    out = client.embeddings.create(model="m", input=["hello world", "hello world", "other"])
    vecs = [e.embedding for e in out.data]
    assert len(vecs) == 3 and len(vecs[0]) == 384 and vecs[0] == vecs[1] != vecs[2]
    assert abs(sum(x * x for x in vecs[0]) - 1.0) < 1e-3 and out.usage.prompt_tokens > 0
    r = httpx.post(f"{d.url}/v1/embeddings", json={"model": "m"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
