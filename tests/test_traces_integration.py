"""Traces over real processes: a router in front of `llmgw sim` engines, requests over real
sockets, the trace read back from the admin API and `llmgw ctl trace`.

The phases of a trace are contiguous, so they add up to the trace's total exactly; the total is
the router's view of the request (from its plan to the last byte relayed). The client's latency
(measured around a raw socket: no client library overhead) holds the router's and the loopback
hops around it: on an idle machine they differ by well under 1 ms. The tolerance: of 10
requests, the closest must be within 1 ms (one undisturbed request is enough to show the
phases account for the whole latency, even on a loaded 2-core CI runner), and every one within
50 ms (a scheduler stall on such a runner), with the client's never below the router's."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

import httpx

from llmgw.cli.ctl.main import main as ctl_main

from .test_router_integration import Daemon, free_port, procs, sim, write_config  # noqa: F401
from .test_sim_vllm import metric, wait_for


def _admin(tmp: Path) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(tmp / "admin" / "admin.sock")), base_url="http://x")


def _trace(tmp: Path, rid: str) -> dict[str, Any]:
    with _admin(tmp) as c:
        r = c.get(f"/api/v1/traces/{rid}")
        assert r.status_code == 200, r.text
        return r.json()


def _raw_request(port: int, body: bytes, rid: str) -> tuple[float, bytes]:
    """(client-measured latency in ms, the response) for one request on a fresh connection."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        msg = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               f"x-request-id: {rid}\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
        buf = b""
        t0 = time.perf_counter()
        s.sendall(msg)
        while not buf.endswith(b"0\r\n\r\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
        t1 = time.perf_counter()
    return (t1 - t0) * 1e3, buf


def test_phases_add_up_to_the_client_measured_latency(procs: list[Any], tmp_path: Path) -> None:
    s = sim(procs, "--sim-decode-ms-per-token", "2", "--sim-prefill-ms-per-token", "0")
    d = Daemon(write_config(tmp_path, [{"name": "m", "replicas": [{"url": s.url}]}]))
    procs.append(d)
    body = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 8, "stream": True}).encode()
    _raw_request(d.info["port"], body, "warm-up")  # the first request pays for imports and a new connection
    diffs = []
    for i in range(10):
        client_ms, resp = _raw_request(d.info["port"], body, f"trace-{i}")
        assert resp.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in resp
        t = _trace(tmp_path, f"trace-{i}")
        assert t["outcome"] == "ok" and t["status"] == 200 and t["stream"] and t["model"] == "m"
        names = [p["name"] for p in t["phases"]]
        assert names == ["prepare", "decide", "connect", "head", "first_byte", "body"], names
        # contiguous: each starts where the one before ended, and together they are the total
        for a, b in zip(t["phases"], t["phases"][1:], strict=False):
            assert abs(a["start_ms"] + a["duration_ms"] - b["start_ms"]) < 0.002
        assert abs(sum(p["duration_ms"] for p in t["phases"]) - t["total_ms"]) < 0.01
        assert client_ms + 0.05 >= t["total_ms"], (client_ms, t["total_ms"])
        diffs.append(client_ms - t["total_ms"])
        (att,) = t["attempts"]
        assert att["replica"] == "m/0" and att["outcome"] == "ok" and att["decision"] == 0 and att["bytes_in"] > 0
        assert att["sent_ms"] <= att["connected_ms"] <= att["head_ms"] <= att["first_byte_ms"] <= att["ended_ms"]
        assert t["bytes_out"] == len(body) and t["bytes_in"] == att["bytes_in"]
    assert min(diffs) <= 1.0, diffs
    assert max(diffs) <= 50.0, diffs


def test_a_retried_request_shows_both_attempts_and_why(procs: list[Any], tmp_path: Path, capsys: Any) -> None:
    victim = sim(procs, "--sim-zero-cost")
    good = sim(procs, "--sim-zero-cost")
    d = Daemon(write_config(tmp_path, [{"name": "m", "replicas": [{"url": victim.url, "weight": 100.0},
                                                                   {"url": good.url}]}],
                            router="stale_after_s = 60"))
    procs.append(d)
    wait_for(lambda: metric(d.url, "llmgw_endpoint_stale", endpoint="m/0") == 0.0)
    victim.stop()  # its last scrape says idle, and batch weighs its weight of 100: it is tried first
    r = httpx.post(f"{d.url}/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1},
                   headers={"x-llmgw-strategy": "batch", "x-request-id": "retried-1"})
    assert r.status_code == 200 and r.headers["x-llmgw-endpoint"] == "m/1"
    t = _trace(tmp_path, "retried-1")
    first, second = t["attempts"]
    assert (first["n"], first["replica"], first["outcome"], first["retried"]) == (1, "m/0", "connect", True)
    assert "m/0" in first["error"] and first["head_ms"] is None and first["decision"] == 0
    assert (second["n"], second["replica"], second["outcome"], second["status"]) == (2, "m/1", "ok", 200)
    assert second["decision"] == 1 and t["retries"] == 1
    decides = [p for p in t["phases"] if p["name"] == "decide"]
    assert len(decides) == 2 and decides[1]["note"].startswith("retry after attempt 1: connect")
    assert [p["attempt"] for p in t["phases"] if p["name"] == "connect"] == [1, 2]
    assert abs(sum(p["duration_ms"] for p in t["phases"]) - t["total_ms"]) < 0.01
    # the rationale of each attempt is its decision in the decision ring
    with _admin(tmp_path) as c:
        ds = c.get("/api/v1/decisions/retried-1").json()["decisions"]
        assert [x["chosen"] for x in ds] == ["m/0", "m/1"]
        listing = c.get("/api/v1/traces", params={"model": "m", "limit": 5}).json()
        assert listing[0]["id"] == "retried-1" and listing[0]["attempts"] == 2
        assert c.get("/api/v1/traces/no-such-request").status_code == 404
    # ... and as the operator reads it
    sock = str(tmp_path / "admin" / "admin.sock")
    assert ctl_main(["trace", "retried-1", "--socket", sock]) == 0
    out = capsys.readouterr().out
    assert "#1 m/0: connect" in out and "retried elsewhere" in out and "#2 m/1: ok 200" in out
    assert "retry after attempt 1" in out and "llmgw ctl explain retried-1" in out


def test_finished_traces_go_to_a_rotated_jsonl_file(procs: list[Any], tmp_path: Path) -> None:
    s = sim(procs, "--sim-zero-cost")
    path = tmp_path / "traces.jsonl"
    d = Daemon(write_config(tmp_path, [{"name": "m", "replicas": [{"url": s.url}]}],
                            router=f"[router.traces]\nfile = {json.dumps(str(path))}\nmax_file_mb = 0.004\n"
                                   "files_kept = 1\nsample = 0.5"))
    procs.append(d)
    with httpx.Client() as c:
        for i in range(40):
            r = c.post(f"{d.url}/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1},
                       headers={"x-request-id": f"file-{i}"})
            assert r.status_code == 200

    def ids() -> list[str]:
        out = []
        for p in (tmp_path / "traces.jsonl.1", path):
            if p.exists():
                out += [json.loads(line)["id"] for line in p.read_text().splitlines()]
        return out

    wait_for(lambda: "file-39" in ids())  # flushed once a second
    assert (tmp_path / "traces.jsonl.1").exists() and not (tmp_path / "traces.jsonl.2").exists()
    assert path.stat().st_mode & 0o077 == 0
    got = ids()
    assert got == [f"file-{i}" for i in range(1, 40, 2)][-len(got):]  # every 2nd, oldest rotated away
    assert path.stat().st_size <= 4200
