"""Router overhead: added latency against hitting the engine directly, and router CPU per streamed
request, measured in one run against zero-cost simulator replicas.

    .venv/bin/python bench/bench_router.py [--rate 200] [--seconds 10] [--replicas 2]

1. Added latency (open loop at --rate streamed requests/s, 20 chunks each): the same schedule is
   sent once straight to a replica and once through the router; the difference of their latency
   percentiles is the router's cost. Run with keep-alive connections (a pool of reused
   connections, where Nagle + delayed ACK would add ~40 ms) and with a new connection per request.
2. CPU: the router process's CPU time (from /proc) per streamed request at partial load (the
   load side cannot keep the router busy; its capacity at saturation is bench_capacity.py's),
   in a closed loop with 32 concurrent clients, once on keep-alive connections and once with a new client connection
   per request (the router's upstream connections stay pooled in both). The router is pinned to
   CPU 0, everything else to CPU 1. --cpu-only skips part 1; --cpu-rounds repeats part 2 (the box
   is shared: compare medians); --ab-inline adds a router with its inline I/O dispatch off
   (LLMGW_INLINE_IO=0, see llmgw/daemon/net/inline_epoll.py), alternated round by round with the
   shipped one; --ab-code DIR the same with another tree's llmgw (before/after a change). --api-key K gives the CPU routers a static key, sent by every request (the cost of
   authentication).
Bounded: a fixed number of requests on 127.0.0.1; every process is stopped at the end."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen import Conn, Latencies, build_request, proc_cpu_seconds
from procs import spawn, stop


def body(model: str) -> bytes:
    return json.dumps({"model": model, "prompt": "Tell me a story", "max_tokens": 20, "ignore_eos": True,
                       "stream": True}).encode()


async def open_loop(port: int, rate: float, n: int, keepalive: bool, model: str = "m") -> Latencies:
    raw = build_request("POST", "/v1/completions", body(model))
    lat = Latencies()
    pool: list[Conn] = []
    start = trio.current_time()

    async def one(i: int) -> None:
        await trio.sleep_until(start + i / rate)
        t0 = time.perf_counter()
        c = pool.pop() if keepalive and pool else await Conn.open("127.0.0.1", port)
        status, data, _ = await c.request(raw)
        lat.values.append(time.perf_counter() - t0)
        assert status == 200 and data.endswith(b"data: [DONE]\n\n")
        if keepalive:
            pool.append(c)
        else:
            await c.aclose()

    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(one, i)
    for c in pool:
        await c.aclose()
    return lat


async def closed_loop(port: int, n: int, conns: int, keepalive: bool = True, key: str | None = None) -> float:
    raw = build_request("POST", "/v1/completions", body("m"),
                        headers=None if key is None else {"Authorization": f"Bearer {key}"})
    t0 = trio.current_time()

    async def worker() -> None:
        c = await Conn.open("127.0.0.1", port)
        for i in range(n // conns):
            if not keepalive and i:
                await c.aclose()
                c = await Conn.open("127.0.0.1", port)
            status, data, _ = await c.request(raw)
            assert status == 200 and data.endswith(b"data: [DONE]\n\n")
        await c.aclose()

    async with trio.open_nursery() as nursery:
        for _ in range(conns):
            nursery.start_soon(worker)
    return trio.current_time() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=200.0)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--cpu-requests", type=int, default=3000)
    ap.add_argument("--cpu-rounds", type=int, default=1)
    ap.add_argument("--cpu-only", action="store_true", help="skip the added-latency part")
    ap.add_argument("--engine", choices=("sim", "stub"), default="sim",
                    help="the replicas: zero-cost `llmgw sim` (default) or bench/stub_engine.py (1 ms decode steps, "
                         "~20x cheaper: less contention on the shared core in the direct runs)")
    ap.add_argument("--latency-one-core", action="store_true",
                    help="added latency with the router on the engine's and client's core (no spare core to hide its cost)")
    ap.add_argument("--config-extra", default="", metavar="TOML",
                    help="appended to the CPU routers' config (e.g. '[tenants]\\nstream_usage = false')")
    ap.add_argument("--api-key", default=None,
                    help="the CPU routers have this static key ([server] api_keys) and every CPU request sends it")
    ap.add_argument("--ab-code", default=None, metavar="DIR",
                    help="also measure a router running the llmgw package found in DIR (PYTHONPATH=DIR: e.g. a copy of "
                         "an older commit), alternated round by round with this tree's")
    ap.add_argument("--ab-inline", action="store_true",
                    help="also measure a router with inline I/O dispatch off (LLMGW_INLINE_IO=0), alternated")
    a = ap.parse_args()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        sims = []
        for _ in range(a.replicas):
            engine = ([sys.executable, str(Path(__file__).with_name("stub_engine.py")), "--step-ms", "1"]
                      if a.engine == "stub" else
                      [sys.executable, "-m", "llmgw", "sim", "--engine", "vllm", "m", "--host", "127.0.0.1", "--port", "0",
                       "--sim-zero-cost", "--max-num-seqs", "1024", "--sim-kv-blocks", "65536"])
            p, info = spawn(engine, cpu=1)
            procs.append(p)
            sims.append(info)
        cfg = Path(tempfile.mkdtemp()) / "bench.toml"
        reps = "\n".join(f'[[models.replicas]]\nurl = "{s["url"]}"' for s in sims)
        # "m1" is the first replica alone: added latency compares the same replica with and
        # without the router in front; "m" spreads over all replicas for the CPU measurement.
        keys = "" if a.api_key is None else f"api_keys = [{json.dumps(a.api_key)}]\n"
        head = '[server]\nhost = "127.0.0.1"\n[router]\nqueue_size = 4096\nsaturation_load = 100000.0\n'
        # Two daemons at once: each its own control port, admin socket and no store.
        head += '[control]\nlisten = "127.0.0.1:0"\nstore = ":memory:"\n[admin]\nsocket = "{sock}"\n'
        cfg.write_text(f'{head.format(sock=cfg.with_name("a.sock"))}[[models]]\nname = "m"\nengine = "vllm"\n{reps}\n')
        one = cfg.with_name("one.toml")  # the first replica alone, for the added-latency comparison
        one.write_text(f'{head.format(sock=cfg.with_name("b.sock"))}[[models]]\nname = "m"\nengine = "vllm"\n[[models.replicas]]\nurl = "{sims[0]["url"]}"\n')
        lp, linfo = spawn([sys.executable, "-m", "llmgw", "daemon", "--role", "router", "--config", str(one), "--port", "0",
                           "--log-level", "warning"], cpu=1 if a.latency_one_core else 0)
        procs.append(lp)
        # The CPU routers: llmgw as shipped, and with --ab-inline the same code with its
        # inline I/O dispatch off (LLMGW_INLINE_IO=0), measured in alternated rounds.
        cpu_routers = []
        variants: list[dict[str, str]] = [{}]
        if a.ab_inline:
            variants.append({"LLMGW_INLINE_IO": "0"})
        if a.ab_code:
            # PYTHONSAFEPATH: `python -m` must not put the working directory (this tree) first
            variants.append({"PYTHONPATH": str(Path(a.ab_code).resolve()), "PYTHONSAFEPATH": "1"})
        for env in variants:
            cfg_i = cfg.with_name(f"cpu{len(cpu_routers)}.toml")
            cfg_i.write_text(cfg.read_text().replace(str(cfg.with_name("a.sock")),
                                                     str(cfg.with_name(f"c{len(cpu_routers)}.sock")))
                             .replace('host = "127.0.0.1"\n', f'host = "127.0.0.1"\n{keys}', 1)
                             + a.config_extra.replace("\\n", "\n") + "\n")
            rp, rinfo = spawn([sys.executable, "-m", "llmgw", "daemon", "--role", "router", "--config", str(cfg_i),
                               "--port", "0", "--log-level", "warning"], cpu=0, env=env)
            procs.append(rp)
            name = "inline I/O off" if "LLMGW_INLINE_IO" in env else f"code of {a.ab_code}" if env else "as shipped"
            cpu_routers.append((name, rp, rinfo["port"]))
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, {1})
        n = int(a.rate * a.seconds)
        if not a.cpu_only:
            print(f"added latency, {n} streamed requests (20 chunks) at {a.rate:.0f}/s, open loop:")
        for keepalive in (() if a.cpu_only else (True, False)):
            trio.run(open_loop, sims[0]["port"], a.rate, min(n, 200), keepalive)  # warm-up
            trio.run(open_loop, linfo["port"], a.rate, min(n, 200), keepalive)
            direct = trio.run(open_loop, sims[0]["port"], a.rate, n, keepalive)
            routed = trio.run(open_loop, linfo["port"], a.rate, n, keepalive)
            label = "keep-alive     " if keepalive else "new connection "
            print(f"  {label} direct p50 {1e3 * direct.pct(50):6.2f} ms p99 {1e3 * direct.pct(99):6.2f} ms | "
                  f"router p50 {1e3 * routed.pct(50):6.2f} ms p99 {1e3 * routed.pct(99):6.2f} ms | "
                  f"added p50 {1e3 * (routed.pct(50) - direct.pct(50)):+.2f} ms "
                  f"p99 {1e3 * (routed.pct(99) - direct.pct(99)):+.2f} ms")
        cpu: dict[tuple[str, bool], list[float]] = {}
        for _, rp, port in cpu_routers:
            trio.run(closed_loop, port, 640, 32, True, a.api_key)  # warm-up (upstream connections, code paths)
        for _ in range(a.cpu_rounds):
            for keepalive in (True, False):
                for name, rp, port in cpu_routers:
                    cpu0 = proc_cpu_seconds(rp.pid)
                    elapsed = trio.run(closed_loop, port, a.cpu_requests, 32, keepalive, a.api_key)
                    per = (proc_cpu_seconds(rp.pid) - cpu0) / a.cpu_requests
                    cpu.setdefault((name, keepalive), []).append(per)
                    label = "keep-alive    " if keepalive else "new connection"
                    # Not capacity: at this load the router idles between chunks and pays a
                    # wake-up from idle for most of them (bench_capacity.py saturates it).
                    print(f"router CPU ({name}), {label}: {1e3 * per:.3f} ms per streamed request (20 chunks) "
                          f"at {a.cpu_requests / elapsed:,.0f} req/s, router {100 * per * a.cpu_requests / elapsed:.0f}% "
                          f"busy", flush=True)
        if a.cpu_rounds > 1 or len(cpu_routers) > 1:
            print(f"medians of {a.cpu_rounds} rounds:")
            for (name, keepalive), v in cpu.items():
                label = "keep-alive    " if keepalive else "new connection"
                print(f"  router CPU ({name}), {label}: {1e3 * statistics.median(v):.3f} ms per streamed request")
    finally:
        for p in procs:
            stop(p)


if __name__ == "__main__":
    main()
