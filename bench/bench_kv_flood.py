"""A client's latency through the router while one node floods it with kv_events (issue 21 #16).

    .venv/bin/python bench/bench_kv_flood.py [--requests 100] [--blocks 4000] [--warmup-s 3]

Starts a router and one agent running a simulated vLLM with KV events (real processes, loopback),
measures --requests sequential chat requests (p50/p95/max), then connects a hand-driven agent
("x") that sends kv_events of --blocks blocks each for a replica it does not run, as fast as the
socket takes them, waits --warmup-s (a node's burst is spent), and measures again. Prints what the
router counted (messages refused, dropped for the budget). Compare runs with and without the
per-node event budget by running it against another checkout (PYTHONPATH=that/checkout)."""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parent))
from procs import spawn, stop  # noqa: E402

TOKEN = "bench-join-token-0123456789"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def frame(seq: int, t: str, **fields: object) -> bytes:
    body = msgpack.packb({"v": 1, "t": t, "seq": seq, **fields}, use_bin_type=True)
    return len(body).to_bytes(4, "big") + body


def flood(port: int, blocks: int, stop_at: Any, sent: Any) -> None:
    """In a process of its own: a thread here would take the GIL from the measuring client."""
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(frame(1, "hello", token=TOKEN, node="x", agent_id="flood", versions=[1], labels={},
                    facts={"cpus": 1, "memory_mb": 1000}, engines=[], features=["kv_events"]))
    def drain() -> None:  # the router's welcome and heartbeats; the thread ends with the socket
        try:
            while s.recv(65536):
                pass
        except OSError:
            pass

    threading.Thread(target=drain, daemon=True).start()
    added = [[None, i] for i in range(blocks)]
    seq = 1
    while not stop_at.is_set():
        seq += 1
        s.sendall(frame(seq, "kv_events", replica="m/flood", event_seq=seq, reset=False, added=added, removed=[]))
        sent.value += 1
    s.close()


def latencies(url: str, n: int) -> list[float]:
    body = {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 2}
    out = []
    with httpx.Client(timeout=30) as c:
        for _ in range(n):
            t0 = time.perf_counter()
            r = c.post(f"{url}/v1/chat/completions", json=body)
            out.append(time.perf_counter() - t0)
            assert r.status_code == 200, r.text
    return out


def summary(xs: list[float]) -> str:
    xs = sorted(xs)
    return (f"p50 {1000 * statistics.median(xs):.1f} ms  p95 {1000 * xs[int(0.95 * (len(xs) - 1))]:.1f} ms  "
            f"max {1000 * xs[-1]:.1f} ms")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--blocks", type=int, default=4000)
    p.add_argument("--warmup-s", type=float, default=3.0)
    ns = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-kv-flood-"))
    cport = free_port()
    (tmp / "router.toml").write_text(f"""
[server]
host = "127.0.0.1"
[router]
scrape_interval_s = 0.2
[control]
listen = "127.0.0.1:{cport}"
join_token = "{TOKEN}"
settle_s = 0.5
store = {json.dumps(str(tmp / "router.db"))}
[admin]
socket = {json.dumps(str(tmp / "admin" / "admin.sock"))}
[[models]]
name = "m"
engine = "vllm"
[models.deploy]
count = 1
simulate = true
kv_events = true
args = ["--sim-zero-cost"]
""")
    (tmp / "agent.toml").write_text(f"""
[agent]
node = "a"
router = "127.0.0.1:{cport}"
join_token = "{TOKEN}"
state_dir = {json.dumps(str(tmp / "agent"))}
""")
    py = sys.executable
    router, info = spawn([py, "-m", "llmgw", "daemon", "--role", "router", "--config", str(tmp / "router.toml"),
                          "--port", "0"])
    agent, _ = spawn([py, "-m", "llmgw", "daemon", "--role", "agent", "--config", str(tmp / "agent.toml")])
    url = info["url"]
    try:
        deadline = time.monotonic() + 60
        while httpx.get(f"{url}/ready").status_code != 200:
            assert time.monotonic() < deadline, "no replica ready"
            time.sleep(0.1)
        latencies(url, 10)
        quiet = latencies(url, ns.requests)
        stop_at, sent = multiprocessing.Event(), multiprocessing.Value("q", 0, lock=False)
        t = multiprocessing.Process(target=flood, args=(cport, ns.blocks, stop_at, sent), daemon=True)
        t.start()
        time.sleep(ns.warmup_s)
        t0, s0 = time.monotonic(), sent.value
        loud = latencies(url, ns.requests)
        rate = (sent.value - s0) / (time.monotonic() - t0)
        stop_at.set()
        t.join(5)
        if t.is_alive():
            t.kill()
        metrics = httpx.get(f"{url}/metrics").text

        def metric(name: str) -> str:
            m = re.search(rf"^{re.escape(name)} (\S+)$", metrics, re.MULTILINE)
            return m.group(1) if m else "-"

        print(f"llmgw from {os.path.dirname(os.path.dirname(__import__('llmgw').__file__))}")
        print(f"quiet:  {summary(quiet)}")
        print(f"flood:  {summary(loud)}  ({rate:.0f} kv_events messages/s of {ns.blocks} blocks sent meanwhile)")
        refused = metric('llmgw_kv_events_refused_total{reason="unknown_replica"}')
        print(f"router: refused {refused}, dropped for the budget {metric('llmgw_kv_events_dropped_total')} "
              f"of {sent.value} messages sent")
    finally:
        stop(agent)
        stop(router)


if __name__ == "__main__":
    main()
