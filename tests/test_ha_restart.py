"""A router restarted while clients use the fleet (issue 23 item 7; docs/ha.md "Behind a load
balancer"), over real processes: two routers on one store, one agent; one router is stopped with
SIGTERM (it drains), waited for, and started again with the same config, while a client runs a
round robin over both routers, a fresh connection per request, retrying once on the other router
when a connection is refused — no request fails, and the restarted router serves again."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from .ha_cluster import Cluster
from .test_router_integration import free_port
from .test_fleet_integration import sim_model
from .test_sim_vllm import wait_for

# ~160 ms a request (8 tokens): with 4 clients at once, some are in flight on a router when it is told to stop
SIM_ARGS = ["--sim-decode-ms-per-token", "20", "--sim-prefill-ms-per-token", "0"]
REQUESTS = 300
HAPROXY_CFG = Path(__file__).resolve().parent.parent / "contrib" / "haproxy" / "llmgw.cfg"


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Any]:
    made: list[Cluster] = []

    def make(models: list[dict[str, Any]], **kw: Any) -> Cluster:
        c = Cluster(tmp_path, models, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def _body(n: int, max_tokens: int = 8, **kw: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": f"request {n}"}], "max_tokens": max_tokens, **kw}


class RoundRobin:
    """Clients of several URLs, `workers` at once: request n goes to urls[n % len], on a fresh
    connection; a refused connection (httpx.ConnectError: nothing was sent) is retried ONCE on the
    next URL. Anything else that is not a 200 is a failure. Runs `at_least` requests, then on until
    `done` is set. retry=False: no retry (a load balancer in front does it)."""

    def __init__(self, urls: list[str], at_least: int, workers: int = 4, retry: bool = True) -> None:
        self.urls, self.at_least, self.retry = urls, at_least, retry
        self.done = threading.Event()
        self.lock = threading.Lock()
        self.next = 0
        self.sent = 0
        self.retried = 0
        self.failures: list[str] = []
        self.served: dict[str, int] = {}  # url -> 200s
        self.threads = [threading.Thread(target=self.run, daemon=True) for _ in range(workers)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def join(self, timeout: float) -> bool:
        for t in self.threads:
            t.join(timeout)
        return not any(t.is_alive() for t in self.threads)

    def take(self) -> int | None:
        with self.lock:
            n = self.next
            if n >= 20 * self.at_least or (n >= self.at_least and self.done.is_set()):
                return None
            self.next += 1
            return n

    def run(self) -> None:
        while (n := self.take()) is not None:
            first = self.urls[n % len(self.urls)]
            other = self.urls[(n + 1) % len(self.urls)]
            url, failure = first, None
            try:
                try:
                    r = httpx.post(f"{first}/v1/chat/completions", json=_body(n), timeout=30)
                except httpx.ConnectError:
                    if not self.retry:
                        raise
                    with self.lock:
                        self.retried += 1
                    url = other
                    r = httpx.post(f"{other}/v1/chat/completions", json=_body(n), timeout=30)
                if r.status_code != 200:
                    failure = f"{n} {url}: {r.status_code} {r.text[:200]}"
            except httpx.HTTPError as e:
                failure = f"{n} {url}: {type(e).__name__} {e}"
            with self.lock:
                self.sent += 1
                if failure is None:
                    self.served[url] = self.served.get(url, 0) + 1
                else:
                    self.failures.append(failure)


def _requests(url: str) -> float:
    """The requests a router has answered (llmgw_requests_total)."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("llmgw_requests_total"))


def _stream(url: str, out: dict[str, Any], started: threading.Event) -> None:
    """A long streamed request (~2 s of tokens): in flight when its router is told to stop."""
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=_body(-1, 100, stream=True), timeout=30) as r:
            out["status"] = r.status_code
            lines = []
            for line in r.iter_lines():
                started.set()
                if line:
                    lines.append(line)
            out["lines"] = lines
    except httpx.HTTPError as e:
        out["error"] = e
    finally:
        started.set()


def restart_under_load(c: Cluster, urls: list[str], victim: int,
                       retry: bool = True) -> tuple[RoundRobin, dict[str, Any]]:
    """Run the round robin over `urls`; meanwhile stop router `victim` with SIGTERM while a long
    streamed request is in flight on it, wait for its exit, start it again and wait until it is
    ready and has served the client again; then let the client finish."""
    client = RoundRobin(urls, REQUESTS, retry=retry)
    client.start()
    wait_for(lambda: client.sent >= 30, timeout=60)
    d = c.router(victim)
    streamed: dict[str, Any] = {}
    started = threading.Event()
    st = threading.Thread(target=_stream, args=(d.url, streamed, started), daemon=True)
    st.start()
    assert started.wait(20)
    t0 = time.monotonic()
    c.signal(victim, signal.SIGTERM)
    assert d.proc.wait(30) == 0
    stopped = time.monotonic()
    assert any("drained in" in line for line in d.err), "".join(d.err[-20:])
    st.join(30)
    sent_at_stop = client.sent
    back = c.start_router(victim)
    assert back.url == d.url  # the same config, the same address
    wait_for(lambda: httpx.get(f"{back.url}/ready", timeout=5).status_code == 200, timeout=60)
    print(f"SIGTERM to exit {stopped - t0:.1f} s; restart to /ready 200 {time.monotonic() - stopped:.1f} s")
    served = _requests(back.url)
    wait_for(lambda: _requests(back.url) >= served + 10 or client.failures, timeout=60)  # it serves the client
    client.done.set()
    assert client.join(120)
    assert client.sent > sent_at_stop
    return client, streamed


def test_a_router_restarted_under_load_costs_a_retrying_client_no_request(cluster: Any) -> None:
    c = cluster([sim_model("m", 2, args=SIM_ARGS)], routers=2, fixed_api_ports=True)
    c.wait_leader()
    c.start_agent("n1")
    for i in (0, 1):
        wait_for(lambda i=i: len(c.routed(i, "m")) == 2, timeout=60)
        wait_for(lambda i=i: httpx.get(f"{c.router(i).url}/ready").status_code == 200)
    urls = [c.router(0).url, c.router(1).url]
    victim = c.wait_leader()  # the harder case: the leader goes, another leads, it comes back
    client, streamed = restart_under_load(c, urls, victim)
    print(f"restart under load: {client.sent} requests, {client.retried} retried on a refused connection, "
          f"served {client.served}, failures {len(client.failures)}")
    assert client.failures == [], client.failures[:10]
    assert client.sent >= REQUESTS and client.retried >= 1  # a connection was refused, and retried
    # the stream in flight when the signal came finished whole
    assert streamed.get("status") == 200 and streamed["lines"][-1] == "data: [DONE]", streamed
    # the restarted router serves again, as a follower or the leader
    assert c.status(victim)["role"] in ("follower", "leader")
    assert httpx.get(f"{urls[victim]}/ready").json()["status"] == "ready"
    assert c.chat(victim, "m").status_code == 200


def haproxy_config(example: str, listen: int, routers: list[int]) -> str:
    """contrib/haproxy/llmgw.cfg with this test's addresses: its frontend on 127.0.0.1:listen, its
    servers the routers on 127.0.0.1 (as many as given); everything else as shipped."""
    out: list[str] = []
    servers_done = False
    for line in example.splitlines():
        words = line.split()
        if words[:1] == ["bind"]:
            line = f"    bind 127.0.0.1:{listen}"
        elif words[:1] == ["server"]:
            if servers_done:
                continue
            servers_done = True
            line = "\n".join(f"    server router{k + 1} 127.0.0.1:{p}" for k, p in enumerate(routers))
        out.append(line)
    assert servers_done, "the example has no server lines"
    return "\n".join(out) + "\n"


@pytest.fixture
def haproxy(tmp_path: Path) -> Iterator[Any]:
    exe = shutil.which("haproxy")
    if exe is None:
        pytest.skip("haproxy is not installed (scripts/test installs it with apt-get when run as root)")
    started: list[subprocess.Popen[bytes]] = []

    def start(routers: list[int]) -> str:
        port = free_port()
        cfg = tmp_path / "haproxy.cfg"
        cfg.write_text(haproxy_config(HAPROXY_CFG.read_text(), port, routers))
        check = subprocess.run([exe, "-c", "-f", str(cfg)], capture_output=True, timeout=30)
        assert check.returncode == 0, check.stderr.decode() + check.stdout.decode()
        with open(tmp_path / "haproxy.log", "wb") as log:
            proc = subprocess.Popen([exe, "-db", "-f", str(cfg)], stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        started.append(proc)

        def listening() -> bool:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return True
            except OSError:
                assert proc.poll() is None, (tmp_path / "haproxy.log").read_text()
                return False

        wait_for(listening, timeout=20)
        return f"http://127.0.0.1:{port}"

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def test_a_router_restarted_behind_haproxy_costs_clients_no_request(cluster: Any, haproxy: Any) -> None:
    """The same restart through HAProxy started from contrib/haproxy/llmgw.cfg: the clients do not
    retry — HAProxy's `retries 1` + `option redispatch` take a refused connection elsewhere, and
    its check of /ready takes the router out as it drains and back once it is ready."""
    c = cluster([sim_model("m", 2, args=SIM_ARGS)], routers=2, fixed_api_ports=True)
    c.wait_leader()
    c.start_agent("n1")
    for i in (0, 1):
        wait_for(lambda i=i: len(c.routed(i, "m")) == 2, timeout=60)
        wait_for(lambda i=i: httpx.get(f"{c.router(i).url}/ready").status_code == 200)
    assert c.api_ports is not None
    front = haproxy(c.api_ports)
    wait_for(lambda: all(_requests(c.router(i).url) > 0 for i in (0, 1)) if
             httpx.post(f"{front}/v1/chat/completions", json=_body(0), timeout=30).status_code == 200 else False,
             timeout=30)  # HAProxy sends to both
    victim = c.wait_leader()
    client, streamed = restart_under_load(c, [front], victim, retry=False)
    print(f"restart behind haproxy: {client.sent} requests, failures {len(client.failures)}")
    assert client.failures == [], client.failures[:10]
    assert client.sent >= REQUESTS
    assert streamed.get("status") == 200 and streamed["lines"][-1] == "data: [DONE]", streamed
    assert httpx.get(f"{c.router(victim).url}/ready").json()["status"] == "ready"
