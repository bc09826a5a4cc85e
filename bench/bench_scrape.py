"""The cost of the router's background work with no traffic: scraping /metrics, per replica per second.

    .venv/bin/python bench/bench_scrape.py [--replicas 8,64,512] [--window 20] [--ab-code DIR]

1. Parse cost per scrape, in process (pure): what one reading of a replica's /metrics costs the
   router for a realistic vLLM body (``vllm_body``: the families, labels and buckets of vLLM's
   PrometheusStatLogger plus prometheus_client's process/python families and the FastAPI
   instrumentator's http_* families that vLLM's /metrics also serves: ~60 KB, ~800 lines) and a
   llama.cpp body (the simulator's: ~2.5 KB). "changed": the body differs from the last one in a
   line the contract does not read (vLLM's http_requests_total for /metrics counts every scrape,
   so a real vLLM body is never byte-identical twice); "identical": byte for byte the last one
   (an idle llama.cpp). "full": what a reading costs with no previous one.
2. An idle router: one bench process (``--serve``, plain epoll, pinned to CPU 1) listens on one
   port per replica and answers /metrics with that body (its /metrics counter moving each time),
   /v1/models and /health; a router (``llmgw daemon --role router``, pinned to CPU 0) has N
   replicas of one vLLM model on those ports and receives no request. After a warm-up its CPU
   time (from /proc) over --window seconds is printed as % of a core and as µs per replica per
   second, at each --replicas count. With --ab-code DIR a second router runs the llmgw package
   found in DIR (e.g. ``git worktree add /tmp/old HEAD~3``) beside this tree's, both measured
   over the same window (the box is shared: same-window figures compare; --rounds repeats and
   prints medians).
Bounded: every process is stopped at the end; all on 127.0.0.1."""

from __future__ import annotations

import argparse
import json
import os
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scrape_bodies import llamacpp_body, vllm_body  # noqa: E402

# -- 1. parse cost -----------------------------------------------------------------------------
def _per_call(fn, n: int) -> float:
    """CPU seconds per call, the best of 20 runs of n/10 calls (the box is shared: the least
    disturbed run)."""
    best, k = float("inf"), max(1, n // 10)
    for r in range(20):
        t0 = time.process_time()
        for i in range(r * k % n, r * k % n + k):
            fn(i % n)
        best = min(best, (time.process_time() - t0) / k)
    return best


def parse_costs(n: int = 300) -> dict[str, float]:
    """µs per reading of one replica's /metrics, as the registry pays it (the code it imports:
    ``llmgw.route.metric_reader.MetricReader`` when it has one, else ``contract.scrape``)."""
    from llmgw.route import contract
    try:
        from llmgw.route.metric_reader import MetricReader as reader_cls
    except ImportError:  # the code before it
        reader_cls = None
    bodies = {"vllm": [vllm_body(i) for i in range(n + 1)], "llamacpp": [llamacpp_body()] * (n + 1)}
    out: dict[str, float] = {}
    for kind, seq in bodies.items():
        if reader_cls is None:
            out[f"{kind} changed"] = _per_call(lambda i: contract.scrape(kind, None, seq[i]), n) * 1e6
            out[f"{kind} identical"] = _per_call(lambda i: contract.scrape(kind, None, seq[0]), n) * 1e6
            out[f"{kind} moved"] = out[f"{kind} changed"]
            continue
        reader = reader_cls(kind, None)
        reader.read(seq[0])
        out[f"{kind} changed"] = _per_call(lambda i: reader.read(seq[i + 1] if kind == "vllm" else seq[i]), n) * 1e6
        out[f"{kind} identical"] = _per_call(lambda i: reader.read(seq[0]), n) * 1e6
        out[f"{kind} moved"] = _per_call(lambda i: reader_cls(kind, None).read(seq[i]), n) * 1e6
    return out


# -- 2. the stub engines -------------------------------------------------------------------------
def serve(n: int) -> None:
    """Answer /metrics, /v1/models and /health on ``n`` ports (one per replica), each port with
    its own /metrics count; print {"ports": [...]} and serve until killed. Plain epoll."""
    ep = select.epoll()
    listeners: dict[int, int] = {}  # fd -> replica index
    socks: dict[int, socket.socket] = {}
    for i in range(n):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        s.setblocking(False)
        ep.register(s.fileno(), select.EPOLLIN)
        listeners[s.fileno()] = i
        socks[s.fileno()] = s
    print(json.dumps({"ports": [socks[fd].getsockname()[1] for fd in listeners]}), flush=True)
    seq = [0] * n
    bodies = [vllm_body(k) for k in range(16)]  # the counters wrap every 16 reads: still never equal twice in a row
    models = json.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]}).encode()
    conns: dict[int, tuple[socket.socket, int, bytearray]] = {}
    while True:
        for fd, _ in ep.poll():
            if fd in listeners:
                try:
                    c, _ = socks[fd].accept()
                except BlockingIOError:
                    continue
                c.setblocking(True)
                c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conns[c.fileno()] = (c, listeners[fd], bytearray())
                ep.register(c.fileno(), select.EPOLLIN)
                continue
            c, i, buf = conns[fd]
            try:
                data = c.recv(65536)
            except OSError:
                data = b""
            if not data:
                ep.unregister(fd)
                del conns[fd]
                c.close()
                continue
            buf += data
            while b"\r\n\r\n" in buf:
                head, _, rest = bytes(buf).partition(b"\r\n\r\n")
                buf[:] = rest
                path = head.split(b" ", 2)[1]
                if path == b"/metrics":
                    body, ctype = bodies[seq[i] % 16], b"text/plain; version=0.0.4; charset=utf-8"
                    seq[i] += 1
                elif path == b"/v1/models":
                    body, ctype = models, b"application/json"
                elif path == b"/health":
                    body, ctype = b"", b"application/json"
                else:
                    c.sendall(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                    continue
                c.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s"
                          % (ctype, len(body), body))


# -- 2. the idle routers -----------------------------------------------------------------------
def _profile(routers: list[tuple[str, subprocess.Popen[bytes]]], seconds: float, n: int) -> None:
    """py-spy samples of each idle router: the share of samples under each function (top 25)."""
    for name, rp in routers:
        out = Path(tempfile.mkdtemp()) / "idle.txt"
        subprocess.run([str(Path(sys.executable).with_name("py-spy")), "record", "-p", str(rp.pid), "-d", str(int(seconds)),
                        "-r", "200", "-f", "raw", "-o", str(out), "--nonblocking"], check=True, capture_output=True)
        total, waiting, by_task, by_fn = 0, 0, {}, {}
        for line in out.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            frames, k = stack.split(";"), int(count)
            total += k
            if "get_events" in frames[-1] or "epoll" in frames[-1] or "select" in frames[-1]:
                waiting += k
                continue
            # the task: the outermost llmgw frame under trio's scheduler (or the thread's first frame)
            inner = [f for f in frames[1:] if "llmgw/" in f]
            under = next((i for i, f in enumerate(frames) if "trio/_core/_run.py" in f and "unrolled_run" in f), None)
            task = next((f for f in frames[under + 1:] if "llmgw/" in f), None) if under is not None else None
            task = task or (inner[0] if inner else frames[-1])
            by_task[task] = by_task.get(task, 0) + k
            for fn in set(frames):
                by_fn[fn] = by_fn.get(fn, 0) + k
        busy = total - waiting
        print(f"py-spy, idle router ({name}), {n} replicas: {busy} busy samples of {total} over {seconds:.0f} s "
              f"at 200/s (= {100 * busy / 200 / seconds:.2f}% of a core); busy samples by task:")
        for fn, c in sorted(by_task.items(), key=lambda kv: -kv[1])[:15]:
            print(f"  {100 * c / max(busy, 1):5.1f}%  {fn}")
        print("  busy samples by function (inclusive):")
        for fn, c in sorted(by_fn.items(), key=lambda kv: -kv[1])[:30]:
            print(f"  {100 * c / max(busy, 1):5.1f}%  {fn}")


def instrumented(out: str, argv: list[str]) -> int:
    """Run ``llmgw`` (argv) with a trio instrument counting each task's steps and their CPU time
    (by task name); SIGUSR1 writes the counts since the last one to ``out`` as JSON."""
    import collections
    import signal

    import trio
    steps: collections.Counter[str] = collections.Counter()
    cpu: collections.Counter[str] = collections.Counter()

    class Steps(trio.abc.Instrument):
        t0 = 0.0

        def before_task_step(self, task: trio.lowlevel.Task) -> None:
            self.t0 = time.thread_time()

        def after_task_step(self, task: trio.lowlevel.Task) -> None:
            steps[task.name] += 1
            cpu[task.name] += time.thread_time() - self.t0

    def dump(*_: object) -> None:
        Path(out).write_text(json.dumps({k: [steps[k], cpu[k]] for k in steps}))
        steps.clear()
        cpu.clear()

    run = trio.run

    def with_steps(*a: object, **k: object) -> object:
        k["instruments"] = [*k.get("instruments", ()), Steps()]  # type: ignore[misc]
        return run(*a, **k)  # type: ignore[arg-type]

    trio.run = with_steps  # type: ignore[assignment]
    signal.signal(signal.SIGUSR1, dump)
    from llmgw.cli.entry import main
    return main(argv)


def _tasks(routers: list[tuple[str, subprocess.Popen[bytes]]], files: dict[str, Path], seconds: float,
           n: int) -> None:
    """Each idle router's tasks over ``seconds``: wake-ups (steps) and CPU per second."""
    import signal
    for _, rp in routers:
        os.kill(rp.pid, signal.SIGUSR1)  # start counting
    t0 = time.monotonic()
    time.sleep(seconds)
    for _, rp in routers:
        os.kill(rp.pid, signal.SIGUSR1)
    dt = time.monotonic() - t0
    time.sleep(0.5)
    for name, _ in routers:
        got = json.loads(files[name].read_text())
        total = sum(c for _, c in got.values())
        print(f"tasks of the idle router ({name}), {n} replicas, over {dt:.0f} s: "
              f"{1e3 * total / dt:.2f} ms of CPU per second in task steps (trio's own scheduling not included)")
        for task, (k, c) in sorted(got.items(), key=lambda kv: -kv[1][1])[:10]:
            print(f"  {k / dt:7.1f} steps/s {1e3 * c / dt:7.2f} ms/s  {task}")


def idle_router_cpu(counts: list[int], window: float, warmup: float, rounds: int, ab_code: str | None,
                    extra: str, profile: float = 0.0, tasks: float = 0.0) -> None:
    from loadgen import proc_cpu_seconds
    from procs import spawn, stop
    variants: list[tuple[str, dict[str, str]]] = [("this tree", {})]
    if ab_code:
        variants.append((f"code of {ab_code}", {"PYTHONPATH": str(Path(ab_code).resolve()), "PYTHONSAFEPATH": "1"}))
    medians: dict[str, list[tuple[int, float]]] = {}
    for n in counts:
        procs: list[subprocess.Popen[bytes]] = []
        try:
            sp, info = spawn([sys.executable, __file__, "--serve", str(n)], cpu=1)
            procs.append(sp)
            d = Path(tempfile.mkdtemp())
            reps = "".join(f'[[models.replicas]]\nurl = "http://127.0.0.1:{p}"\n' for p in info["ports"])
            routers = []
            files: dict[str, Path] = {}
            for k, (name, env) in enumerate(variants):
                cfg = d / f"r{k}.toml"
                cfg.write_text('[server]\nhost = "127.0.0.1"\n[control]\nlisten = "127.0.0.1:0"\nstore = ":memory:"\n'
                               f'[admin]\nsocket = "{d / f"a{k}.sock"}"\n{extra}\n'
                               f'[[models]]\nname = "m"\nengine = "vllm"\n{reps}')
                daemon = ["daemon", "--role", "router", "--config", str(cfg), "--port", "0", "--log-level", "warning"]
                files[name] = d / f"tasks{k}.json"
                cmd = [sys.executable, __file__, "--instrumented", str(files[name]), *daemon] if tasks else \
                    [sys.executable, "-m", "llmgw", *daemon]
                rp, _ = spawn(cmd, cpu=0, env=env)
                procs.append(rp)
                routers.append((name, rp))
            time.sleep(warmup)
            if profile:
                _profile(routers, profile, n)
                continue
            if tasks:
                _tasks(routers, files, tasks, n)
                continue
            per: dict[str, list[float]] = {name: [] for name, _ in routers}
            for _ in range(rounds):
                c0 = {name: proc_cpu_seconds(rp.pid) for name, rp in routers}
                t0 = time.monotonic()
                time.sleep(window)
                dt = time.monotonic() - t0
                for name, rp in routers:
                    per[name].append((proc_cpu_seconds(rp.pid) - c0[name]) / dt)
            for name, vals in per.items():
                frac = statistics.median(vals)
                medians.setdefault(name, []).append((n, frac))
                print(f"idle router ({name}), {n:4d} replicas: {100 * frac:6.2f}% of a core, "
                      f"{1e6 * frac / n:7.1f} µs per replica per second "
                      f"(median of {rounds} × {window:.0f} s; rounds: {', '.join(f'{100 * v:.2f}%' for v in vals)})",
                      flush=True)
        finally:
            for p in procs:
                stop(p)
    # what one more replica costs (the slope between two counts): the fixed cost (timers, the
    # round itself) drops out
    for name, pts in medians.items():
        for (n1, f1), (n2, f2) in zip(pts, pts[1:]):
            print(f"marginal ({name}), {n1} → {n2} replicas: {1e6 * (f2 - f1) / (n2 - n1):6.1f} µs per replica "
                  f"per second; fixed part {100 * (f1 - n1 * (f2 - f1) / (n2 - n1)):.2f}% of a core")


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False)  # the daemon's --config is not --config-extra
    ap.add_argument("--replicas", default="8,64,512", help="replica counts, comma-separated")
    ap.add_argument("--window", type=float, default=20.0, help="seconds of idle router CPU per round")
    ap.add_argument("--warmup", type=float, default=8.0, help="seconds before measuring (idle intervals settle)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--ab-code", default=None, metavar="DIR",
                    help="also measure a router (and the parse cost) with the llmgw package found in DIR")
    ap.add_argument("--config-extra", default="", metavar="TOML",
                    help="added to the routers' config (e.g. '[router]\\nscrape_idle_factor = 1')")
    ap.add_argument("--parse-only", action="store_true", help="part 1 only")
    ap.add_argument("--profile", type=float, default=0.0, metavar="S",
                    help="instead of CPU figures, py-spy each idle router for S seconds (needs py-spy in the venv)")
    ap.add_argument("--tasks", type=float, default=0.0, metavar="S",
                    help="instead of CPU figures, each idle router's trio tasks over S seconds: steps and CPU per second")
    ap.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--instrumented", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json-parse", action="store_true", help=argparse.SUPPRESS)
    a, rest = ap.parse_known_args()
    if a.instrumented is not None:
        sys.exit(instrumented(a.instrumented, rest))
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    if a.serve is not None:
        serve(a.serve)
        return
    if a.json_parse:
        print(json.dumps(parse_costs()))
        return
    vb = vllm_body()
    print(f"body sizes: vLLM {len(vb):,} bytes ({vb.count(10)} lines), llama.cpp {len(llamacpp_body()):,} bytes")
    trees = [("this tree", {})]
    if a.ab_code:
        trees.append((f"code of {a.ab_code}", {"PYTHONPATH": str(Path(a.ab_code).resolve()), "PYTHONSAFEPATH": "1"}))
    print("parse cost per reading of one replica's /metrics (µs of CPU, best of 20 × 30):")
    for name, env in trees:
        got = json.loads(subprocess.run([sys.executable, __file__, "--json-parse"], check=True, capture_output=True,
                                        env={**os.environ, **env}).stdout)
        print(f"  {name:24s} " + "  ".join(f"{k} {v:7.1f}" for k, v in got.items()))
    if a.parse_only:
        return
    idle_router_cpu([int(x) for x in a.replicas.split(",")], a.window, a.warmup, a.rounds, a.ab_code,
                    a.config_extra.replace("\\n", "\n"), a.profile, a.tasks)


if __name__ == "__main__":
    main()
