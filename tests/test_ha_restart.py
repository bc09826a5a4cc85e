"""A router restarted while clients use the fleet (issue 23 item 7; docs/ha.md "Behind a load
balancer"), over real processes: two routers on one store, one agent; one router is stopped with
SIGTERM (it drains), waited for, and started again with the same config, while a client runs a
round robin over both routers, a fresh connection per request, retrying once on the other router
when a connection is refused — no request fails, and the restarted router serves again."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from .ha_cluster import Cluster
from .test_fleet_integration import sim_model
from .test_sim_vllm import wait_for

# ~160 ms a request (8 tokens): with 4 clients at once, some are in flight on a router when it is told to stop
SIM_ARGS = ["--sim-decode-ms-per-token", "20", "--sim-prefill-ms-per-token", "0"]
REQUESTS = 300


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
    `done` is set."""

    def __init__(self, urls: list[str], at_least: int, workers: int = 4) -> None:
        self.urls, self.at_least = urls, at_least
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


def restart_under_load(c: Cluster, urls: list[str], victim: int) -> tuple[RoundRobin, dict[str, Any]]:
    """Run the round robin over `urls`; meanwhile stop router `victim` with SIGTERM while a long
    streamed request is in flight on it, wait for its exit, start it again and wait until it is
    ready and has served the client again; then let the client finish."""
    client = RoundRobin(urls, REQUESTS)
    client.start()
    wait_for(lambda: client.sent >= 30, timeout=60)
    d = c.router(victim)
    streamed: dict[str, Any] = {}
    started = threading.Event()
    st = threading.Thread(target=_stream, args=(d.url, streamed, started), daemon=True)
    st.start()
    assert started.wait(20)
    c.signal(victim, signal.SIGTERM)
    assert d.proc.wait(30) == 0
    assert any("drained in" in line for line in d.err), "".join(d.err[-20:])
    st.join(30)
    sent_at_stop = client.sent
    back = c.start_router(victim)
    assert back.url == d.url  # the same config, the same address
    wait_for(lambda: httpx.get(f"{back.url}/ready", timeout=5).status_code == 200, timeout=60)
    served = client.served.get(back.url, 0)
    wait_for(lambda: client.served.get(back.url, 0) >= served + 10 or client.failures, timeout=60)
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
