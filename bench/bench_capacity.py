"""Router capacity on one core: streamed requests/s when the router, not its load, is the limit.

    .venv/bin/python bench/bench_capacity.py [--conns 64,256,512] [--seconds 6] [--ab-inline]

`bench_router.py` measures CPU per request at the load its Python load generator and two
`llmgw sim` engines can make from the other core, where the router idles ~40% of the time and
pays a wake-up from idle for nearly every chunk. Here the load side is lean enough to saturate
the router: wrk (C) as the client and bench/stub_engine.py as the engine (a decode loop that
sends one token event per running stream every --step-ms, each its own send; 20 tokens and
[DONE] per request, like the simulator's zero-cost stream). The router is pinned to CPU 0,
wrk and the stub to CPU 1. For each concurrency: throughput through the router, the router's
CPU use and its CPU per request, and the same load straight to the stub (the load side's own
ceiling: while it is well above the routed throughput, the router is the limit).

Needs wrk (Debian: apt-get install wrk); says so and exits otherwise. Bounded: --seconds per
measurement on 127.0.0.1; every process is stopped at the end."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen import proc_cpu_seconds
from procs import spawn, stop

_LUA = """wrk.method = "POST"
wrk.body = '{"model": "m", "prompt": "Tell me a story", "max_tokens": 20, "stream": true}'
wrk.headers["Content-Type"] = "application/json"
"""


def wrk(url: str, conns: int, seconds: float, script: Path) -> float:
    """Requests/s that completed (non-2xx responses fail the run)."""
    out = subprocess.run(["taskset", "-c", "1", "wrk", "-t1", f"-c{conns}", f"-d{max(1, round(seconds))}s", "-s", str(script), url],
                         capture_output=True, text=True, check=True).stdout
    if "Non-2xx" in out:
        raise SystemExit(f"wrk saw errors:\n{out}")
    return float(next(line for line in out.splitlines() if "Requests/sec" in line).split()[1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conns", default="64,256,512")
    ap.add_argument("--seconds", type=int, default=6)
    ap.add_argument("--step-ms", type=float, default=2.0)
    ap.add_argument("--ab-inline", action="store_true", help="also a router with LLMGW_INLINE_IO=0")
    a = ap.parse_args()
    if shutil.which("wrk") is None:
        print("bench_capacity: needs wrk (Debian: apt-get install wrk)")
        return
    tmp = Path(tempfile.mkdtemp())
    script = tmp / "post.lua"
    script.write_text(_LUA)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        stub, sinfo = spawn([sys.executable, str(Path(__file__).with_name("stub_engine.py")), "--step-ms",
                             str(a.step_ms)], cpu=1)
        procs.append(stub)
        routers = []
        for i, env in enumerate(({}, {"LLMGW_INLINE_IO": "0"}) if a.ab_inline else ({},)):
            cfg = tmp / f"r{i}.toml"
            cfg.write_text('[server]\nhost = "127.0.0.1"\n[router]\nqueue_size = 4096\nsaturation_load = 100000.0\n'
                           f'[control]\nlisten = "127.0.0.1:0"\nstore = ":memory:"\n[admin]\nsocket = "{tmp}/a{i}.sock"\n'
                           f'[[models]]\nname = "m"\nengine = "vllm"\n[[models.replicas]]\nurl = "{sinfo["url"]}"\n')
            rp, rinfo = spawn([sys.executable, "-m", "llmgw", "daemon", "--role", "router", "--config", str(cfg),
                               "--port", "0", "--log-level", "warning"], cpu=0, env=env)
            procs.append(rp)
            routers.append(("inline I/O off" if env else "as shipped", rp, rinfo["port"]))
        for _, _, port in routers:  # warm-up
            wrk(f"http://127.0.0.1:{port}/v1/completions", 64, 2, script)
        print(f"streamed requests (20 tokens + [DONE], engine step {a.step_ms} ms), wrk for {a.seconds} s each:")
        for conns in (int(c) for c in a.conns.split(",")):
            direct = wrk(f"{sinfo['url']}/v1/completions", conns, a.seconds, script)
            for name, rp, port in routers:
                c0, t0 = proc_cpu_seconds(rp.pid), time.perf_counter()
                rps = wrk(f"http://127.0.0.1:{port}/v1/completions", conns, a.seconds, script)
                busy = (proc_cpu_seconds(rp.pid) - c0) / (time.perf_counter() - t0)
                print(f"  {conns:4d} connections, router {name}: {rps:7,.0f} req/s, router CPU {100 * busy:3.0f}%, "
                      f"{1e3 * busy / rps:.3f} ms per request -> {rps / busy:,.0f} req/s per core | "
                      f"straight to the stub: {direct:7,.0f} req/s", flush=True)
    finally:
        for p in procs:
            stop(p)


if __name__ == "__main__":
    sys.exit(main())
