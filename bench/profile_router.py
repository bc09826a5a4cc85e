"""Where a request's CPU goes in the router: a py-spy profile of a running router under wrk,
attributed to components, printed as µs per request (the budget in docs/router.md).

    .venv/bin/pip install py-spy   # (the bench extra)
    .venv/bin/python bench/profile_router.py [--conns 32] [--realistic] [--replicas 2] [--seconds 10]

The router serves bench/stub_engine.py replicas (zero cost) with its default strategy; wrk drives
it (--conns 32: saturation; --conns 2 with --step-ms 2: partial load, the router idles between
chunks). The router's process CPU over the sampled window divided by the requests wrk completed
is the cost per request; py-spy's samples (the router's main thread, --rate Hz) split it by the
innermost frame of llmgw's own code (or of the library it is in: trio, logging, prometheus_client)
by the table COMPONENTS below. --top N also prints the N hottest functions. --raw FILE keeps the
samples (py-spy's collapsed stacks, for a flame graph). Bounded; every process is stopped."""

from __future__ import annotations

import argparse
import collections
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_peers import chat_body, llmgw_config, lua_script, start_stubs, wrk
from loadgen import proc_cpu_seconds
from procs import spawn, stop

# (path fragment, component): the first that matches the innermost attributable frame wins.
COMPONENTS: list[tuple[str, str]] = [
    ("llmgw/http1/server.py", "parse: HTTP request"),
    ("llmgw/http1/fields.py", "parse: HTTP request"),
    ("llmgw/route/request_head.py", "parse: request body"),
    ("llmgw/route/openai_req.py", "parse: request body"),
    ("llmgw/route/prefix_", "prefix: tier 1 (hash, tree)"),
    ("llmgw/route/kv_scorer.py", "prefix: tier 2 (KV blocks)"),
    ("llmgw/route/tier2.py", "prefix: tier 2 (KV blocks)"),
    ("llmgw/kv/", "prefix: tier 2 (KV blocks)"),
    ("llmgw/daemon/router/kv_index.py", "prefix: tier 2 (KV blocks)"),
    ("llmgw/route/trace", "trace"),
    ("llmgw/daemon/router/trace_log.py", "trace"),
    ("llmgw/daemon/router/otel_export.py", "trace"),
    ("llmgw/route/counters.py", "metrics"),
    ("llmgw/daemon/router/metrics.py", "metrics"),
    ("prometheus_client/", "metrics"),
    ("llmgw/tenants/", "tenancy (keys, quotas, usage)"),
    ("llmgw/daemon/router/tenancy.py", "tenancy (keys, quotas, usage)"),
    ("llmgw/daemon/router/usage_tap.py", "tenancy (keys, quotas, usage)"),
    ("llmgw/route/scheduler.py", "decide: filter, score, pick, rationale"),
    ("llmgw/route/scorers.py", "decide: filter, score, pick, rationale"),
    ("llmgw/route/filters.py", "decide: filter, score, pick, rationale"),
    ("llmgw/route/pickers.py", "decide: filter, score, pick, rationale"),
    ("llmgw/route/strategies.py", "decide: filter, score, pick, rationale"),
    ("llmgw/route/", "decide: plan, admission, queue, breaker, finish"),
    ("llmgw/http1/client.py", "relay: upstream request and response"),
    ("llmgw/daemon/net/upstream", "relay: upstream request and response"),
    ("llmgw/http1/response_head.py", "relay: to the client"),
    ("llmgw/http1/sinks.py", "relay: to the client"),
    ("llmgw/daemon/net/http_conn.py", "relay: to the client"),
    ("llmgw/daemon/net/inline_epoll.py", "event loop (trio, inline I/O)"),
    ("llmgw/daemon/net/httpserver.py", "HTTP server (connections, framing)"),
    ("llmgw/daemon/router/proxy.py", "request path glue (proxy.py)"),
    ("llmgw/daemon/router/registry.py", "background (scrapes, health)"),
    ("llmgw/daemon/", "background (control, agents, store)"),
    ("logging/", "log"),
    ("llmgw/daemon/logs.py", "log"),
    ("trio/", "event loop (trio, inline I/O)"),
]
_LIBS = ("trio/", "logging/", "prometheus_client/")


def component(stack: list[str]) -> str:
    """The innermost frame of llmgw's code or of an attributed library, by COMPONENTS; a
    standard-library frame (json, re, hmac ...) counts for the llmgw frame that called it."""
    for frame in reversed(stack):
        path = frame[frame.find("(") + 1:].rsplit(":", 1)[0] if "(" in frame else ""
        if "llmgw/" in path or any(lib in path for lib in _LIBS):
            for frag, comp in COMPONENTS:
                if frag in path:
                    return comp
            return "other llmgw"
    return "other (interpreter, threads)"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conns", type=int, default=32)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--step-ms", type=float, default=0.0)
    ap.add_argument("--seconds", type=int, default=10)
    ap.add_argument("--rate", type=int, default=250, help="py-spy's samples per second")
    ap.add_argument("--realistic", action="store_true", help="~4 KB chat bodies (bench_peers.py's)")
    ap.add_argument("--top", type=int, default=0)
    ap.add_argument("--raw", default=None, metavar="FILE")
    ap.add_argument("--config-extra", default="", metavar="TOML")
    a = ap.parse_args()
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists() or shutil.which("wrk") is None:
        sys.exit("profile_router needs py-spy (pip install py-spy) and wrk (apt-get install wrk)")
    tmp = Path(tempfile.mkdtemp())
    script = lua_script(tmp / "req.lua", [chat_body(random.Random(i), a.realistic, a.tokens)
                                          for i in range(64 if a.realistic else 1)])
    procs: list[subprocess.Popen[bytes]] = []
    try:
        urls = [e["url"] for e in start_stubs(a.replicas, a.step_ms, procs)]
        cfg = llmgw_config(tmp, urls, a.config_extra)
        rp, rinfo = spawn([sys.executable, "-m", "llmgw", "daemon", "--role", "router", "--config", str(cfg),
                           "--port", "0", "--log-level", "warning"], cpu=0)
        procs.append(rp)
        wrk(rinfo["port"], script, a.conns, 2)  # warm-up
        raw = Path(a.raw) if a.raw else tmp / "samples.txt"
        result: dict[str, float] = {}

        def load() -> None:
            result.update(wrk(rinfo["port"], script, a.conns, a.seconds + 2))

        t = threading.Thread(target=load)
        t.start()
        cpu0 = proc_cpu_seconds(rp.pid)
        subprocess.run([spy, "record", "-p", str(rp.pid), "-d", str(a.seconds), "-r", str(a.rate), "-f", "raw",
                        "-o", str(raw)], check=True, capture_output=True)
        cpu = proc_cpu_seconds(rp.pid) - cpu0
        t.join()
        per_req = cpu / (result["rps"] * a.seconds)
        comps: collections.Counter[str] = collections.Counter()
        funcs: collections.Counter[str] = collections.Counter()
        total = 0
        for line in raw.read_text().splitlines():
            stack, _, n = line.rpartition(" ")
            frames = stack.split(";")
            if not any(f.startswith("<module>") for f in frames[:4]):
                continue  # not the main thread (py-spy's view of a helper thread)
            total += int(n)
            comps[component(frames)] += int(n)
            funcs[frames[-1].split(" (")[0] + " " + frames[-1].rsplit("/", 1)[-1].rsplit(":", 1)[0]] += int(n)
        print(f"{'realistic ~4 KB' if a.realistic else 'tiny'} bodies, {a.conns} connections, {a.replicas} replicas: "
              f"{result['rps']:.0f} req/s, router CPU {1e6 * per_req:.0f} µs per request "
              f"({100 * cpu / a.seconds:.0f}% of a core), {total} samples")
        for comp, n in comps.most_common():
            print(f"  {comp:48s} {1e6 * per_req * n / total:6.0f} µs  {100 * n / total:5.1f}%")
        if a.top:
            print(f"hottest functions (self):")
            for f, n in funcs.most_common(a.top):
                print(f"  {100 * n / total:5.1f}%  {f}")
    finally:
        for p in procs:
            stop(p)
        if hasattr(os, "sched_setaffinity"):
            pass


if __name__ == "__main__":
    main()
