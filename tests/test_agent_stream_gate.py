"""The agent stream as an untrusted input, over real processes (issue 12, items 1, 2 and 4):

- engine reports with a malformed or foreign URL are refused for that report (the agent is told,
  the engine counts as failed), the router stays up, and the node's session goes on;
- connections that have not said hello are outsiders: their frames are capped small and only so
  many may wait at once, so 50 connections sending 4 MiB frames hold no 200 MB;
- TLS with the router's own CA: an agent pinning it (from `llmgw ctl join-info`) joins, a plain
  one does not."""

from __future__ import annotations

import json
import re
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmgw.config import parse_config

from .raw_agent import RawAgent
from .test_fleet_integration import TOKEN, Fleet, fleet_factory, sim_model  # noqa: F401  (the fixture)
from .test_sim_vllm import wait_for


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def metric(f: Fleet, name: str) -> float:
    assert f.router is not None
    text = httpx.get(f"{f.router.url}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def ctl(f: Fleet, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "llmgw", "ctl", "--socket", str(f.tmp / "admin" / "admin.sock"),
                           *args], capture_output=True, text=True, timeout=30)


def test_bad_and_foreign_report_urls_are_refused_and_the_router_stays_up(fleet_factory: Any, sim_factory: Any) -> None:
    f = fleet_factory([sim_model(count=1)])
    raw = RawAgent(f.control_port, node="x", token=TOKEN, features=["credential", "report_rejected"])
    try:
        assert raw.answer["t"] == "welcome"
        desired = raw.wait_for("desired", 15)
        while not desired["engines"]:
            desired = raw.wait_for("desired", 15)
        rid = desired["engines"][0]["replica"]
        for url, why in [("http://[::1", "malformed host or port"),  # crashed the router's scraper
                         ("ftp://x", "scheme must be http or https"),  # made every request a 500
                         ("http://10.1.2.3:8000", "not the node's own address"),  # someone else's machine
                         ("http://127.0.0.1", "the port is missing")]:
            raw.report(replica=rid, model="m", state="ready", url=url)
            rejected = raw.wait_for("report_rejected")
            assert rejected["replica"] == rid and why in rejected["reason"], rejected
            # the agent is told at once; the plane's view of the replica follows (wait on it)
            wait_for(lambda: why in f.replicas("m")[0]["detail"], 10)
            [r] = f.replicas("m")
            assert r["state"] == "failed" and why in r["detail"] and not r["routable"] and r["url"] is None
        assert f.router.proc.poll() is None
        assert metric(f, "llmgw_agent_reports_rejected_total") == 4
        # The same session goes on: a good URL on the node's own (loopback) address is routed.
        engine = sim_factory(["--engine", "vllm", "m", "--host", "127.0.0.1", "--port", "0", "--sim-zero-cost"])
        raw.report(replica=rid, model="m", state="ready", url=engine.url)
        wait_for(lambda: len(f.ready("m")) == 1 and f.ready("m")[0]["routable"], 10)
        r = f.chat("m")
        assert r.status_code == 200, r.text
        assert f.nodes()["x"]["state"] == "ready" and not raw.closed.is_set()
    finally:
        raw.close()


def test_fifty_big_frames_before_hello_hold_no_memory(fleet_factory: Any) -> None:
    f = fleet_factory([sim_model(count=1)], control={"hello_timeout_s": 2.0, "max_pending_agents": 64})
    f.start_agent("a")
    wait_for(lambda: len(f.ready("m")) == 1, 30)
    assert f.router is not None
    pid = f.router.proc.pid
    base = rss_mb(pid)
    frame = (4 << 20) - 16  # under the 4 MiB max_message_bytes: the cap before hello is what refuses it
    body = b"\x00" * (frame - 1)  # the frame never completes
    socks: list[socket.socket] = []
    try:
        for _ in range(50):
            s = socket.create_connection(("127.0.0.1", f.control_port), timeout=5)
            socks.append(s)
            try:
                s.sendall(frame.to_bytes(4, "big") + body)
            except OSError:  # closed by the router after the length prefix
                pass
        # What the kernel still buffers reaches the router within moments: watch its RSS for a bounded
        # while (failing as soon as it is over the bound).
        grown, deadline = 0.0, time.monotonic() + 3
        while time.monotonic() < deadline and grown < 60:
            grown = max(grown, rss_mb(pid) - base)
            time.sleep(0.05)
        assert grown < 60, f"router RSS grew {grown:.0f} MB for 50 unauthenticated connections"
        wait_for(lambda: metric(f, 'llmgw_agent_connections_closed_before_hello_total{why="oversize"}') == 50, 10)
        # 200 idle connections: beyond max_pending_agents they are closed at once, the rest at the hello timeout
        idle = [socket.create_connection(("127.0.0.1", f.control_port), timeout=5) for _ in range(200)]
        socks += idle
        wait_for(lambda: metric(f, 'llmgw_agent_connections_closed_before_hello_total{why="pending_cap"}') >= 136, 10)
        t0 = time.monotonic()
        for s in idle:
            s.settimeout(10)
            try:
                assert s.recv(1) == b""
            except ConnectionResetError:
                pass
        assert time.monotonic() - t0 < 5
        assert metric(f, "llmgw_agent_connections_pending") == 0
        # the node kept serving throughout, and a new agent joins afterwards
        assert f.nodes()["a"]["state"] == "ready" and f.chat("m").status_code == 200
        f.start_agent("b")
        wait_for(lambda: f.nodes().get("b", {}).get("state") == "ready", 15)
    finally:
        for s in socks:
            s.close()


def test_tls_with_the_routers_own_ca(fleet_factory: Any, tmp_path: Path) -> None:
    if not __import__("shutil").which("openssl"):
        pytest.skip("openssl is not installed")
    # Loopback here, so TLS is asked for; beyond loopback it is the default (test_fleet_identity).
    f = fleet_factory([sim_model(count=1)], control={"tls": True, "tls_dir": str(tmp_path / "ca")})
    keys = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "ca").glob("*.key")}
    assert keys == {"ca.key": 0o600, "server.key": 0o600}
    assert stat.S_IMODE((tmp_path / "ca").stat().st_mode) == 0o700
    info = json.loads(ctl(f, "-o", "json", "join-info").stdout)
    assert info["tls"] and info["ca_pem"].startswith("-----BEGIN CERTIFICATE-----")
    assert info["server_name"] == "llmgw-control" and info["join_token"] == TOKEN
    assert info["router"] == f"127.0.0.1:{f.control_port}"
    # The text form is an [agent] section an agent's config takes as it is.
    text = ctl(f, "join-info").stdout
    cfg = parse_config(text + f'\nnode = "a"\nstate_dir = "{tmp_path / "agent-a"}"\n')
    assert cfg.agent.tls_ca_pem is not None and cfg.agent.tls_ca_pem.strip() == info["ca_pem"].strip()
    assert cfg.agent.tls_server_name == "llmgw-control" and cfg.agent.join_token == TOKEN
    f.start_agent("a", tls_ca_pem=info["ca_pem"], tls_server_name=info["server_name"])
    plain = f.start_agent("b")  # loopback router address, no CA: plain TCP, which the router refuses
    unpinned = f.start_agent("c", tls=True)  # TLS, but trusting only the system's CAs
    wait_for(lambda: len(f.ready("m")) == 1, 30)
    assert f.ready("m")[0]["node"] == "a"
    wait_for(lambda: "not one this agent trusts" in f.log(unpinned), 15)
    assert "llmgw ctl join-info" in f.log(unpinned)
    wait_for(lambda: metric(f, 'llmgw_agent_connections_closed_before_hello_total{why="tls"}') >= 1, 15)
    assert set(f.nodes()) == {"a"}
    assert plain.proc.poll() is None and f.chat("m").status_code == 200
    assert re.search(r"TLS handshake failed", f.log(f.router))
