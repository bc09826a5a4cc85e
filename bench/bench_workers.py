"""`llmgw daemon --workers N`: requests per second through one router process against N on one host,
the same client load, side by side.

    .venv/bin/python bench/bench_workers.py [--workers 2] [--seconds 10] [--conns 64] [--clients 2]
                                            [--rounds 2] [--step-ms 2] [--stream]

One engine, bench/stub_engine.py (almost free: the routers, not the engine, are the limit), as a
static replica. Two daemons run the same config (`--role router`, a SQLite store of its own each):
`llmgw daemon` (one process) and `llmgw daemon --workers N`. The load is a closed loop: --clients
processes (bench/loadgen.py, raw trio sockets), --conns keep-alive connections in all, each sending
its next request when the last one ended, for --seconds; the kernel spreads the connections over
the workers (SO_REUSEPORT). Rounds alternate the two daemons (the machine is shared: compare the
medians). Printed: requests/s, the routers' CPU (all workers together, from /proc) and CPU per
request, and the ratio. Nothing is pinned: on a machine with C cores, the client processes and the
engine take their share of them too, so N workers gain at most what the cores the load leaves free
allow. Bounded: --seconds per measurement on 127.0.0.1; every process is stopped at the end."""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen import Conn, build_request, proc_cpu_seconds
from procs import stop


def _load(port: int, conns: int, seconds: float, stream: bool, out: multiprocessing.Queue) -> None:
    body = json.dumps({"model": "m", "prompt": "Tell me a story", "max_tokens": 20, "stream": stream}).encode()
    raw = build_request("POST", "/v1/completions", body)
    done = [0]
    errors = [0]

    async def one(deadline: float) -> None:
        c = await Conn.open("127.0.0.1", port)
        while trio.current_time() < deadline:
            status, _, _ = await c.request(raw)
            if status == 200:
                done[0] += 1
            else:
                errors[0] += 1
        await c.aclose()

    async def run() -> None:
        deadline = trio.current_time() + seconds
        async with trio.open_nursery() as nursery:
            for _ in range(conns):
                nursery.start_soon(one, deadline)

    trio.run(run)
    out.put((done[0], errors[0]))


def measure(port: int, pids: list[int], a: argparse.Namespace) -> tuple[float, float]:
    """(requests/s, router CPU seconds per second) under the closed-loop load."""
    q: multiprocessing.Queue = multiprocessing.Queue()
    per = [a.conns // a.clients + (1 if i < a.conns % a.clients else 0) for i in range(a.clients)]
    cpu0 = sum(proc_cpu_seconds(p) for p in pids)
    t0 = time.perf_counter()
    loaders = [multiprocessing.Process(target=_load, args=(port, n, a.seconds, a.stream, q)) for n in per]
    for p in loaders:
        p.start()
    results = [q.get(timeout=a.seconds + 60) for _ in loaders]
    for p in loaders:
        p.join(10)
    elapsed = time.perf_counter() - t0
    cpu = sum(proc_cpu_seconds(p) for p in pids) - cpu0
    ok, errors = sum(r[0] for r in results), sum(r[1] for r in results)
    if errors:
        raise SystemExit(f"{errors} requests failed (port {port})")
    return ok / a.seconds, cpu / elapsed


def start(cmd: list[str]) -> tuple[subprocess.Popen[bytes], dict]:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True,
                            env={**os.environ, "PYTHONHASHSEED": "0", "LLMGW_LOG_LEVEL": "warning"})
    assert proc.stdout is not None
    return proc, json.loads(proc.stdout.readline())


def wait_listening(port: int, pids: list[int], timeout: float = 60.0) -> None:
    """Until every worker listens (a worker joins the port once it can route)."""
    inodes: set[str] = set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        listening = set()
        with open("/proc/net/tcp") as f:
            for line in f.readlines()[1:]:
                parts = line.split()
                if parts[3] == "0A" and int(parts[1].split(":")[1], 16) == port:
                    listening.add(parts[9])
        inodes = listening
        if len(inodes) >= len(pids):
            return
        time.sleep(0.1)
    raise SystemExit(f"only {len(inodes)} of {len(pids)} workers listen on {port} after {timeout} s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--conns", type=int, default=64)
    ap.add_argument("--clients", type=int, default=2, help="load processes")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--step-ms", type=float, default=2.0, help="the stub engine's decode step")
    ap.add_argument("--stream", action="store_true", help="streamed requests (20 chunks) instead of whole answers")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    procs: list[subprocess.Popen[bytes]] = []
    try:
        stub, sinfo = start([sys.executable, str(Path(__file__).with_name("stub_engine.py")), "--step-ms",
                             str(a.step_ms)])
        procs.append(stub)
        daemons = []
        for name, extra in (("1 process", []), (f"--workers {a.workers}", ["--workers", str(a.workers)])):
            d = tmp / name.replace(" ", "").replace("-", "")
            d.mkdir(mode=0o700)
            cfg = d / "llmgw.toml"
            cfg.write_text('[server]\nhost = "127.0.0.1"\n[router]\nqueue_size = 4096\nsaturation_load = 100000.0\n'
                           f'[control]\nlisten = "127.0.0.1:0"\nstore = "{d}/router.db"\n'
                           f'[admin]\nsocket = "{d}/admin.sock"\n'
                           f'[[models]]\nname = "m"\nengine = "vllm"\n[[models.replicas]]\nurl = "{sinfo["url"]}"\n')
            p, info = start([sys.executable, "-m", "llmgw", "daemon", "--role", "router", "--config", str(cfg),
                             "--port", "0", "--log-level", "warning", *extra])
            procs.append(p)
            pids = [w["pid"] for w in info.get("workers", [])] or [info["pid"]]
            wait_listening(info["port"], pids)
            daemons.append((name, info["port"], pids))
        for _, port, pids in daemons:  # warm-up
            measure(port, pids, argparse.Namespace(**{**vars(a), "seconds": 2.0}))
        kind = "streamed (20 chunks)" if a.stream else "whole answers (20 tokens)"
        print(f"{os.cpu_count()} CPUs; closed loop, {a.conns} keep-alive connections from {a.clients} client "
              f"processes, {kind}, stub engine step {a.step_ms} ms, {a.seconds:.0f} s per run, {a.rounds} rounds:")
        got: dict[str, list[tuple[float, float]]] = {name: [] for name, _, _ in daemons}
        for r in range(a.rounds):
            for name, port, pids in daemons:
                rps, busy = measure(port, pids, a)
                got[name].append((rps, busy))
                print(f"  round {r + 1}: {name:12s} {rps:8,.0f} req/s, routers' CPU {100 * busy:4.0f}% "
                      f"({1e3 * busy / rps:.3f} ms per request)", flush=True)
        med = {name: (statistics.median(v[0] for v in vals), statistics.median(v[1] for v in vals))
               for name, vals in got.items()}
        (n1, (r1, b1)), (nw, (rw, bw)) = med.items()
        print(f"medians: {n1} {r1:,.0f} req/s (CPU {100 * b1:.0f}%) | {nw} {rw:,.0f} req/s (CPU {100 * bw:.0f}%) "
              f"| x{rw / r1:.2f}")
        print("command: .venv/bin/python bench/bench_workers.py " + " ".join(sys.argv[1:]))
    finally:
        for p in reversed(procs):
            stop(p)


if __name__ == "__main__":
    main()
