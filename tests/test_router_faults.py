"""Faults blamed where they belong, over real processes: a poison request (one the engines answer
500: the simulator's tokenizer raises on a lone surrogate, as real engines have such bugs) does
not open the breakers of the replicas it visits, and a hung engine does not hold a request for
the whole first-byte ceiling while another replica is idle."""

from __future__ import annotations

import socket
import threading
from pathlib import Path
from typing import Any

import httpx

from .test_router_integration import Daemon, procs, sim, write_config  # noqa: F401 (fixture)
from .test_sim_vllm import metric

POISON = b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 4}'
NORMAL = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


def test_poison_requests_leave_every_breaker_closed(procs: list[Any], tmp_path: Path) -> None:
    sims = [sim(procs, "--sim-zero-cost") for _ in range(3)]
    d = Daemon(write_config(tmp_path, [{"name": "m", "replicas": [{"url": s.url} for s in sims]}],
                            router="[router.breaker]\nfailure_threshold = 3\ncooldown_s = 30"))
    procs.append(d)
    with httpx.Client(timeout=20) as c:
        for _ in range(6):  # three were enough to open every breaker
            r = c.post(f"{d.url}/v1/chat/completions", content=POISON,
                       headers={"content-type": "application/json"})
            assert r.status_code == 500  # the engine's own error, not a 502 of ours
            assert r.json()["error"]["type"] == "server_error"
        for i in range(3):
            assert metric(d.url, "llmgw_endpoint_breaker_state", endpoint=f"m/{i}") == 0.0
        assert metric(d.url, "llmgw_poison_requests_total", model="m") == 6.0
        ok = [c.post(f"{d.url}/v1/chat/completions", json=NORMAL).status_code for _ in range(20)]
    assert ok == [200] * 20


class HungEngine:
    """Accepts connections and reads requests, and never answers."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.conns: list[socket.socket] = []
        self.closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(c)

    def stop(self) -> None:
        self.closed.set()
        self.sock.close()
        for c in self.conns:
            c.close()


def test_a_hung_engine_does_not_hold_a_request_while_another_replica_is_idle(
        procs: list[Any], tmp_path: Path) -> None:
    hung = HungEngine()
    procs.append(hung)
    good = sim(procs, "--sim-zero-cost")
    # the hung engine is in the preferred pool, so it is tried first
    d = Daemon(write_config(
        tmp_path, [{"name": "m", "replicas": [{"url": hung.url, "pool": "main"},
                                              {"url": good.url, "pool": "spare"}]}],
        pools=[{"name": "main", "priority": 0}, {"name": "spare", "priority": 1}],
        router="first_byte_fast_s = 0.5\nfirst_byte_timeout_s = 600"))
    procs.append(d)
    with httpx.Client(timeout=30) as c:
        r = c.post(f"{d.url}/v1/chat/completions", json=NORMAL)
    assert r.status_code == 200 and r.headers["x-llmgw-endpoint"] == "m/1"
    assert metric(d.url, "llmgw_upstream_errors_total", endpoint="m/0", kind="timeout") == 1.0
