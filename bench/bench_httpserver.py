"""Benchmark llmgw.daemon.net.httpserver on loopback.

    .venv/bin/python bench/bench_httpserver.py [--requests 5000] [--conns 32]
                                               [--streams 500] [--chunks 20] [--interval-ms 20]

The server runs in a child process (this file with --serve) and reports its own CPU
time (time.process_time) over a /cpu endpoint, so the figure excludes the client.
The parent drives it with a minimal raw-socket HTTP/1.1 client (httpx would cost
~1 ms CPU per request and become the bottleneck on a 2-core box).  Phases:
  1. small JSON GETs over keep-alive connections (throughput, server CPU/request)
  2. one connection, sequential GETs (latency; a Nagle/delayed-ACK bug shows as ~40 ms)
  3. concurrent SSE streams on fresh connections, first paced by trio.sleep like an
     engine's token gap (the pacing's own timer cost is in the figure), then unpaced
     (server CPU per stream, including accept and request, and per chunk)
Bounded: everything runs under a 55 s deadline on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


# ----------------------------------------------------------------- server (child)
def serve() -> None:
    from llmgw.daemon.net.httpserver import Request, Response, ServerStats, json_response, serve_tcp

    stats = ServerStats()
    active = peak = 0

    async def handler(req: Request) -> Response:
        nonlocal active, peak
        if req.path == "/small":
            return json_response(200, {"object": "list", "data": [{"id": "m", "object": "model"}]})
        if req.path == "/cpu":
            out = {"cpu": time.process_time(), "served": stats.requests_served, "peak_streams": peak,
                   "connections_open": stats.connections_open}
            peak = 0
            return json_response(200, out)
        if req.path == "/stream":
            q = req.query_params()
            n, interval = int(q.get("n", "20")), float(q.get("interval_ms", "0")) / 1000

            async def sse():
                nonlocal active, peak
                active += 1
                peak = max(peak, active)
                try:
                    for i in range(n):
                        if interval:
                            await trio.sleep(interval)  # an engine's inter-token gap
                        yield b'data: {"choices":[{"index":0,"delta":{"content":"tok%d"}}]}\n\n' % i
                    yield b"data: [DONE]\n\n"
                finally:
                    active -= 1

            return Response(200, [("content-type", "text/event-stream"), ("cache-control", "no-cache")], sse())
        return json_response(404, {"error": "not found"})

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(partial(serve_tcp, handler, "127.0.0.1", 0, stats=stats))
            print(port, flush=True)

    trio.run(main)


# ----------------------------------------------------------------- client (parent)
class Conn:
    """Just enough HTTP/1.1 client: Content-Length or chunked responses, keep-alive."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream, self.buf = stream, b""

    async def _fill(self) -> None:
        data = await self.stream.receive_some(65536)
        if not data:
            raise ConnectionError("server closed the connection")
        self.buf += data

    async def request(self, raw: bytes, on_chunk: Callable[[bytes], None] | None = None) -> bytes:
        await self.stream.send_all(raw)
        while (i := self.buf.find(b"\r\n\r\n")) < 0:
            await self._fill()
        head, self.buf = self.buf[:i].lower(), self.buf[i + 4:]
        if not head.startswith(b"http/1.1 200"):
            raise RuntimeError(head[:100])
        if (j := head.find(b"content-length:")) >= 0:
            end = head.find(b"\r\n", j)
            n = int(head[j + 15:end if end > 0 else None])
            while len(self.buf) < n:
                await self._fill()
            body, self.buf = self.buf[:n], self.buf[n:]
            return body
        body = b""  # chunked
        while True:
            while (k := self.buf.find(b"\r\n")) < 0:
                await self._fill()
            size = int(self.buf[:k], 16)
            while len(self.buf) < k + 2 + size + 2:
                await self._fill()
            chunk, self.buf = self.buf[k + 2:k + 2 + size], self.buf[k + 2 + size + 2:]
            if size == 0:
                return body
            if on_chunk:
                on_chunk(chunk)
            body += chunk


async def connect(port: int) -> Conn:
    return Conn(await trio.open_tcp_stream("127.0.0.1", port))


def get(path: str) -> bytes:
    return b"GET %s HTTP/1.1\r\nhost: bench\r\n\r\n" % path.encode()


async def server_cpu(c: Conn) -> dict:
    return json.loads(await c.request(get("/cpu")))


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


async def drive(port: int, a: argparse.Namespace) -> None:
    ctl = await connect(port)
    small = get("/small")

    # -- phase 1: throughput on keep-alive connections
    async def worker(n: int) -> None:
        c = await connect(port)
        for _ in range(n):
            await c.request(small)
        await c.stream.aclose()

    async def run_gets(total: int) -> float:
        per = [total // a.conns + (i < total % a.conns) for i in range(a.conns)]
        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for n in per:
                nursery.start_soon(worker, n)
        return time.perf_counter() - t0

    await run_gets(min(1000, a.requests))  # warm-up
    cpu0, mine = await server_cpu(ctl), time.process_time()
    wall = await run_gets(a.requests)
    cpu1, mine = await server_cpu(ctl), time.process_time() - mine
    cpu = cpu1["cpu"] - cpu0["cpu"]
    print(f"[1] {a.requests} small GETs over {a.conns} keep-alive conns: {a.requests / wall:,.0f} req/s, "
          f"server CPU {cpu * 1e3 / a.requests:.3f} ms/req ({cpu / wall * 100:.0f}% of a core; "
          f"client {mine / wall * 100:.0f}%)")

    # -- phase 2: sequential latency on one connection
    lat = []
    c = await connect(port)
    for _ in range(a.seq):
        t0 = time.perf_counter()
        await c.request(small)
        lat.append(time.perf_counter() - t0)
    await c.stream.aclose()
    print(f"[2] {a.seq} sequential GETs on one connection: p50 {pct(lat, .5) * 1e3:.3f} ms, "
          f"p99 {pct(lat, .99) * 1e3:.3f} ms, max {max(lat) * 1e3:.3f} ms")

    # -- phase 3: concurrent SSE streams, paced like an engine, then unpaced
    for interval in dict.fromkeys((a.interval_ms, 0)):
        await run_streams(port, ctl, a, interval)
    await ctl.stream.aclose()


async def run_streams(port: int, ctl: Conn, a: argparse.Namespace, interval_ms: int) -> None:
    req = get(f"/stream?n={a.chunks}&interval_ms={interval_ms}")
    conns = [await connect(port) for _ in range(a.streams)]
    while (await server_cpu(ctl))["connections_open"] < a.streams + 1:
        await trio.sleep(0.01)  # let the server accept them all before measuring
    first: list[float] = []
    chunks = 0

    async def stream_one(c: Conn) -> None:
        t0 = time.perf_counter()
        seen = False

        def on_chunk(_: bytes) -> None:
            nonlocal chunks, seen
            chunks += 1
            if not seen:
                first.append(time.perf_counter() - t0)
                seen = True

        await c.request(req, on_chunk)

    cpu0, mine = await server_cpu(ctl), time.process_time()
    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for c in conns:
            nursery.start_soon(stream_one, c)
    wall = time.perf_counter() - t0
    cpu1, mine = await server_cpu(ctl), time.process_time() - mine
    for c in conns:
        await c.stream.aclose()
    assert chunks == a.streams * (a.chunks + 1), chunks
    cpu = cpu1["cpu"] - cpu0["cpu"]
    print(f"[3] {a.streams} concurrent SSE streams x {a.chunks}+1 chunks, {interval_ms} ms token gap "
          f"(peak {cpu1['peak_streams']} open at once): wall {wall:.2f} s (pacing alone "
          f"{a.chunks * interval_ms / 1000:.2f} s), {chunks / wall:,.0f} chunks/s; server CPU "
          f"{cpu * 1e3 / a.streams:.3f} ms/stream = {cpu * 1e6 / chunks:.1f} us/chunk "
          f"({cpu / wall * 100:.0f}% of a core; client {mine / wall * 100:.0f}%); "
          f"first chunk p50 {pct(first, .5) * 1e3:.1f} ms, p99 {pct(first, .99) * 1e3:.1f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--conns", type=int, default=32)
    ap.add_argument("--seq", type=int, default=1000)
    ap.add_argument("--streams", type=int, default=500)
    ap.add_argument("--chunks", type=int, default=20)
    ap.add_argument("--interval-ms", type=int, default=20)
    a = ap.parse_args()
    if a.serve:
        return serve()
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    child = subprocess.Popen([sys.executable, __file__, "--serve"], stdout=subprocess.PIPE, env=env)
    try:
        port = int(child.stdout.readline())  # type: ignore[union-attr]
        print(f"server pid {child.pid} on 127.0.0.1:{port}; python {sys.version.split()[0]}, "
              f"{os.cpu_count()} CPUs")

        async def bounded() -> None:
            with trio.fail_after(55):
                await drive(port, a)

        trio.run(bounded)
    finally:
        child.terminate()
        child.wait(5)


if __name__ == "__main__":
    main()
