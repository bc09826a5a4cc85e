"""File descriptors over real processes: a router started with a soft = hard limit of 1,024 keeps
serving while a client holds 2,000 idle connections (the connection cap derived from the fd
limit closes the longest-idle to make room), and when accept() does hit the fd limit (a cap set
above it) it pauses and logs once instead of every 100 ms, and serves again."""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from .stub_engine import StubEngine
from .test_router_edge import metric_value
from .test_router_integration import write_config
from .test_sim_vllm import wait_for

IDLE = 2000
LIMIT = 1024


class LimitedDaemon:
    """`llmgw daemon --role router` with RLIMIT_NOFILE soft = hard = ``nofile``."""

    def __init__(self, config: Path, nofile: int) -> None:
        def limit() -> None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        self.proc = subprocess.Popen([sys.executable, "-m", "llmgw", "daemon", "--role", "router", "--config",
                                      str(config), "--port", "0", "--log-level", "info"],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                     preexec_fn=limit)
        self.err: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            self.stop()
            raise RuntimeError("router did not start: " + "".join(self.err)[-3000:])
        self.info = json.loads(line)
        self.url = self.info["url"]

    def _pump(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.err.append(line.decode(errors="replace"))

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


@pytest.fixture
def room_for_idle_connections() -> Iterator[None]:
    """This test process holds IDLE sockets itself: raise its own soft limit for that."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = IDLE + 512
    if hard != resource.RLIM_INFINITY and hard < need:
        pytest.skip(f"the hard fd limit {hard} is below the {need} this test needs")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, need), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.fixture
def procs() -> Iterator[list[Any]]:
    started: list[Any] = []
    yield started
    for p in reversed(started):
        p.stop()


def open_idle(port: int, n: int) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.setblocking(True)
        s.connect(("127.0.0.1", port))  # completes in the kernel's backlog, accepted or not
        socks.append(s)
    return socks


def served(d: LimitedDaemon) -> bool:
    r = httpx.post(f"{d.url}/v1/completions", json={"model": "m", "prompt": "x"}, timeout=10)
    return r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1


def start(procs: list[Any], tmp: Path, server: str = "") -> LimitedDaemon:
    engine = StubEngine()
    procs.append(engine)
    d = LimitedDaemon(write_config(tmp, [{"name": "m", "replicas": [{"url": engine.url}]}], server=server), LIMIT)
    procs.append(d)
    return d


def test_2000_idle_connections_at_a_1024_fd_limit_do_not_stop_service(
        procs: list[Any], tmp_path: Path, room_for_idle_connections: None) -> None:
    d = start(procs, tmp_path)
    wait_for(lambda: "file descriptors: limit 1024" in (log := "".join(d.err)) and "at most 384 connections" in log)
    idle = open_idle(d.info["port"], IDLE)
    try:
        for _ in range(20):
            assert served(d)
        assert d.fds() < LIMIT
        assert metric_value(d, "llmgw_http_connections_max") == 384  # type: ignore[arg-type]
        wait_for(lambda: metric_value(d, "llmgw_http_connections_evicted_total") >= IDLE - 384)  # type: ignore[arg-type]
        assert metric_value(d, "llmgw_http_connections_open") <= 384  # type: ignore[arg-type]
        assert metric_value(d, "llmgw_http_accept_errors_total") == 0  # type: ignore[arg-type]
    finally:
        for s in idle:
            s.close()
    assert "Traceback" not in "".join(d.err)


def test_accept_failing_at_the_fd_limit_pauses_logs_once_and_recovers(
        procs: list[Any], tmp_path: Path, room_for_idle_connections: None) -> None:
    # A cap above what the limit allows: accept() itself meets EMFILE.
    d = start(procs, tmp_path, server="max_connections = 5000")
    wait_for(lambda: "server.max_connections = 5000 is more than" in "".join(d.err))  # stderr is read by a thread
    idle = open_idle(d.info["port"], IDLE)
    try:
        wait_for(lambda: metric_value(d, "llmgw_http_accept_errors_total") >= 1)  # type: ignore[arg-type]
        for _ in range(20):
            assert served(d)  # each failed accept closes the longest-idle connection: room again
        assert d.fds() <= LIMIT
    finally:
        for s in idle:
            s.close()
    wait_for(lambda: served(d))
    lines = [line for line in d.err if "accept on" in line]
    assert 1 <= len(lines) <= 2, lines  # not one every 100 ms
    assert "Traceback" not in "".join(d.err)
