"""Simulator throughput: one `llmgw sim` process with the time model at zero, pinned to one core,
must not be what limits a router benchmark (targets: >= 1,000 short requests/s and 500 concurrent
streams on one core). Prints requests/s and the simulator's CPU per request and per streamed token.

    .venv/bin/python bench/bench_sim.py [--engine vllm|llamacpp] [--requests 5000] [--streams 500]

Bounded: a fixed number of requests on 127.0.0.1; the simulator is stopped at the end."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen import Conn, build_request, proc_cpu_seconds  # noqa: E402


def start_sim(engine: str, core: int | None) -> tuple[subprocess.Popen[bytes], int]:
    args = ["sim-model"] if engine == "vllm" else ["-m", "sim.gguf", "-np", "512", "-c", "524288"]
    cmd = [sys.executable, "-m", "llmgw", "sim", "--engine", engine, "--host", "127.0.0.1", "--port", "0",
           "--sim-zero-cost", *args]
    if engine == "vllm":
        cmd += ["--max-num-seqs", "1024", "--sim-kv-blocks", "65536"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, start_new_session=True,
                            env={**os.environ, "PYTHONHASHSEED": "0"})
    assert proc.stdout is not None
    info = json.loads(proc.stdout.readline())
    if core is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(proc.pid, {core})
    return proc, info["port"]


async def short_requests(port: int, n: int, conns: int, engine: str) -> float:
    path = "/v1/completions"
    body = json.dumps({"model": "sim-model", "prompt": "Say hi", "max_tokens": 1}).encode()
    raw = build_request("POST", path, body)
    per = n // conns
    start = trio.current_time()

    async def worker() -> None:
        c = await Conn.open("127.0.0.1", port)
        for _ in range(per):
            status, _, _ = await c.request(raw)
            assert status == 200, status
        await c.aclose()

    async with trio.open_nursery() as nursery:
        for _ in range(conns):
            nursery.start_soon(worker)
    return trio.current_time() - start


async def streams(port: int, n: int, tokens: int) -> tuple[float, int]:
    body = json.dumps({"model": "sim-model", "prompt": "Tell me a story", "max_tokens": tokens,
                       "ignore_eos": True, "stream": True}).encode()
    raw = build_request("POST", "/v1/completions", body)
    conns = [await Conn.open("127.0.0.1", port) for _ in range(n)]
    chunks = 0
    start = trio.current_time()

    async def one(c: Conn) -> None:
        nonlocal chunks
        status, data, _ = await c.request(raw)
        assert status == 200 and data.endswith(b"data: [DONE]\n\n"), data[-60:]
        chunks += data.count(b"data: ") - 1

    async with trio.open_nursery() as nursery:
        for c in conns:
            nursery.start_soon(one, c)
    elapsed = trio.current_time() - start
    for c in conns:
        await c.aclose()
    return elapsed, chunks


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=["vllm", "llamacpp"], default="vllm")
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--conns", type=int, default=32)
    ap.add_argument("--streams", type=int, default=500)
    ap.add_argument("--tokens", type=int, default=20)
    ap.add_argument("--core", type=int, default=0, help="pin the simulator to this CPU (-1: no pinning)")
    a = ap.parse_args()
    proc, port = start_sim(a.engine, None if a.core < 0 else a.core)
    try:
        trio.run(short_requests, port, 200, 8, a.engine)  # warm-up
        cpu0 = proc_cpu_seconds(proc.pid)
        elapsed = trio.run(short_requests, port, a.requests, a.conns, a.engine)
        cpu1 = proc_cpu_seconds(proc.pid)
        n = (a.requests // a.conns) * a.conns
        print(f"short requests: {n} in {elapsed:.2f}s = {n / elapsed:,.0f} req/s; "
              f"sim CPU {1e3 * (cpu1 - cpu0) / n:.3f} ms/request ({a.conns} keep-alive connections)")
        s_elapsed, chunks = trio.run(streams, port, a.streams, a.tokens)
        cpu2 = proc_cpu_seconds(proc.pid)
        print(f"streams: {a.streams} concurrent x {a.tokens} tokens in {s_elapsed:.2f}s; {chunks} token chunks; "
              f"sim CPU {1e3 * (cpu2 - cpu1) / a.streams:.3f} ms/stream, "
              f"{1e6 * (cpu2 - cpu1) / max(chunks, 1):.1f} µs/streamed token")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)


if __name__ == "__main__":
    main()
