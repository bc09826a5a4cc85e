"""CPU cost of the router's upstream client (llmgw.daemon.net.upstream) against httpx.

    .venv/bin/python bench/bench_upstream.py [--small 2000] [--streams 1000] [--tokens 20]
                                             [--concurrency 32] [--rounds 1]

Starts one zero-cost vLLM simulator subprocess (`--sim-zero-cost --max-num-seqs 1024`),
then, in this single trio process, measures this process's own CPU time
(getrusage(RUSAGE_SELF), user + sys) per request for
  (a) short non-streaming completions (max_tokens 1) over keep-alive connections;
  (b) streamed completions of --tokens tokens (`"stream": true`, 21 SSE events + [DONE]);
both with --concurrency concurrent workers, for UpstreamPool and for httpx.AsyncClient;
and (b) once more through ``UpstreamResponse.relay(sink)`` (the router's path: the pool's
relay task hands each read to a sink, here one that takes everything) instead of iterating.
The simulator's CPU is not counted.  A third streamed row, "floor", is a bare loop on
one keep-alive socket per worker (send the request bytes, wait_readable + recv until the
chunked terminator, no HTTP parsing): what trio and the kernel alone cost on this box
right now, the lower bound for any trio client that reads each chunk as it arrives.  Target for ours: <= 150 us CPU per streamed
20-token request.  Each phase is warmed up first; --rounds repeats the measurement
(the box is shared, so take the best of several rounds).
"""

from __future__ import annotations

import argparse
import json
import resource
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from llmgw.daemon.net.upstream import UpstreamPool  # noqa: E402
from tests.conftest import start_sim  # noqa: E402

HEADERS = [("content-type", "application/json")]


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def run(total: int, concurrency: int, one: Callable[[], Awaitable[int]]) -> tuple[float, float, int]:
    """Run `one` `total` times on `concurrency` workers: (cpu s, wall s, sum of its results)."""
    left = total
    acc = 0

    async def worker() -> None:
        nonlocal left, acc
        while left > 0:
            left -= 1
            r = await one()
            acc += r

    c0, t0 = cpu(), time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(worker)
    return cpu() - c0, time.perf_counter() - t0, acc


def report(label: str, n: int, cpu_s: float, wall: float, extra: str = "") -> None:
    print(f"  {label:<34} {cpu_s / n * 1e6:8.1f} us CPU/req   {n / wall:8.0f} req/s{extra}", flush=True)


async def bench(url: str, a: argparse.Namespace) -> None:
    small = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
    stream = json.dumps({"prompt": "x", "max_tokens": a.tokens, "ignore_eos": True, "stream": True}).encode()
    results: dict[str, list[float]] = {}

    def keep(label: str, n: int, c: float) -> None:
        results.setdefault(label, []).append(c / n * 1e6)

    async with UpstreamPool(max_idle_per_host=2 * a.concurrency) as pool:
        async def ours_small() -> int:
            r = await pool.request(url, "POST", "/v1/completions", HEADERS, small)
            assert r.status == 200, r.body
            return 0

        async def ours_stream() -> int:
            pieces = 0
            async with pool.stream(url, "POST", "/v1/completions", HEADERS, stream) as resp:
                assert resp.status == 200
                last = b""
                async for piece in resp.iter_body():
                    pieces += 1
                    last = piece
            assert last.endswith(b"data: [DONE]\n\n"), last[-60:]
            return pieces

        class CountingSink:
            """A client that takes everything at once (what relay() writes into)."""
            def __init__(self) -> None:
                self.sends, self.last = 0, b""

            def send_nowait(self, data: bytes, end: bool = False) -> bool:
                self.sends += 1
                self.last = data
                return True

            def flush_nowait(self) -> None:
                pass

            async def drain(self) -> None:
                pass

        async def ours_relay() -> int:
            sink = CountingSink()
            async with pool.stream(url, "POST", "/v1/completions", HEADERS, stream) as resp:
                assert resp.status == 200
                await resp.relay(sink)
            assert sink.last.endswith(b"data: [DONE]\n\n"), sink.last[-60:]
            return sink.sends

        key = ("127.0.0.1", int(url.rsplit(":", 1)[1]))
        raw_req = (b"POST /v1/completions HTTP/1.1\r\nhost: %s:%d\r\ncontent-type: application/json\r\n"
                   b"content-length: %d\r\n\r\n%b" % (key[0].encode(), key[1], len(stream), stream))
        floor_socks: list[socket.socket] = []

        async def floor_stream() -> int:
            s = floor_socks.pop() if floor_socks else socket.create_connection(key)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.setblocking(False)
            s.send(raw_req)
            reads = 0
            tail = b""
            while True:
                try:
                    data = s.recv(65536)
                except BlockingIOError:
                    await trio.lowlevel.wait_readable(s)
                    continue
                assert data
                reads += 1
                tail = (tail + data)[-7:]  # the terminator may come in a read of its own
                if tail == b"\r\n0\r\n\r\n":
                    floor_socks.append(s)
                    return reads

        import httpx
        async with httpx.AsyncClient(base_url=url, timeout=None, limits=httpx.Limits(
                max_connections=2 * a.concurrency, max_keepalive_connections=2 * a.concurrency)) as client:
            async def httpx_small() -> int:
                r = await client.post("/v1/completions", content=small, headers=HEADERS)
                assert r.status_code == 200, r.text
                return 0

            async def httpx_stream() -> int:
                pieces = 0
                async with client.stream("POST", "/v1/completions", content=stream, headers=HEADERS) as r:
                    assert r.status_code == 200
                    last = b""
                    async for piece in r.aiter_bytes():
                        pieces += 1
                        last = piece
                assert last.endswith(b"data: [DONE]\n\n"), last[-60:]
                return pieces

            for rnd in range(a.rounds):
                print(f"round {rnd + 1}/{a.rounds}: {a.concurrency} concurrent, single trio process, own CPU",
                      flush=True)
                for label, fn, n in (("(a) ours   short non-streaming", ours_small, a.small),
                                     ("(a) httpx  short non-streaming", httpx_small, a.small),
                                     ("(b) ours   streamed", ours_stream, a.streams),
                                     ("(b) ours   relay(sink)", ours_relay, a.streams),
                                     ("(b) httpx  streamed", httpx_stream, a.streams),
                                     ("(b) floor  bare socket loop", floor_stream, a.streams)):
                    await run(max(100, n // 10), a.concurrency, fn)  # warm-up: connections, caches
                    c, wall, pieces = await run(n, a.concurrency, fn)
                    keep(label, n, c)
                    extra = (f"   ({pieces / n:.1f} reads/stream, {c / pieces * 1e6:.1f} us/read)"
                             if pieces else "")
                    report(label, n, c, wall, extra)
            print(f"pool stats: {pool.stats}")
            for fs in floor_socks:
                fs.close()
    print(f"best of {a.rounds} round(s), us CPU per request:")
    for label, xs in results.items():
        print(f"  {label:<34} {min(xs):8.1f}")
    ours, theirs = min(results["(b) ours   streamed"]), min(results["(b) httpx  streamed"])
    floor = min(results["(b) floor  bare socket loop"])
    verdict = "OK" if ours <= 150 else "OVER"
    print(f"streamed {a.tokens}-token request: ours {ours:.1f} us vs httpx {theirs:.1f} us "
          f"({theirs / ours:.1f}x less); bare-socket floor {floor:.1f} us; target <= 150 us: {verdict}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", type=int, default=2000)
    ap.add_argument("--streams", type=int, default=1000)
    ap.add_argument("--tokens", type=int, default=20)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=1)
    a = ap.parse_args()
    sim = start_sim(["--engine", "vllm", "sim-model", "--host", "127.0.0.1", "--port", "0", "--sim-zero-cost",
                     "--max-num-seqs", "1024"])
    try:
        print(f"simulator at {sim.url} (pid {sim.proc.pid})", flush=True)
        trio.run(bench, sim.url, a)
    finally:
        sim.stop()


if __name__ == "__main__":
    main()
