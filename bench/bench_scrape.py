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

# -- bodies ------------------------------------------------------------------------------------
_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
         80.0, 160.0, 640.0, 2560.0)
_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_LAT = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
        960.0, 1920.0, 7680.0)
_TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 32768)
_ITER = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_HANDLERS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/tokenize",
             "/load", "/ping")


def _fmt(v: float) -> str:
    return repr(float(v)) if v == v else "NaN"


def vllm_body(seq: int = 0, *, dp: int = 1, running: int = 0, waiting: int = 0) -> bytes:
    """A realistic vLLM /metrics body (prometheus_client 0.0.4 text, as vLLM serves it): ``seq``
    is how many times /metrics was read before (it moves http_requests_total and a few process
    gauges, as on a real engine); ``dp`` engines each with their own per-engine series."""
    out: list[str] = []

    def fam(name: str, kind: str, doc: str, samples: list[tuple[str, str, float]]) -> None:
        out.append(f"# HELP {name} {doc}")
        out.append(f"# TYPE {name} {kind}")
        for suffix, labels, value in samples:
            out.append(f"{name}{suffix}{{{labels}}} {_fmt(value)}" if labels else f"{name}{suffix} {_fmt(value)}")

    def hist(name: str, doc: str, buckets: tuple[float, ...], labels: str) -> list[tuple[str, str, float]]:
        s = [("_bucket", f'{labels},le="{_fmt(b)}"', 0.0) for b in buckets]
        s += [("_bucket", f'{labels},le="+Inf"', 0.0), ("_count", labels, 0.0), ("_sum", labels, 0.0)]
        return s

    gen = (("0", 41.0 + seq % 7), ("1", 12.0), ("2", 3.0))
    fam("python_gc_objects_collected", "counter", "Objects collected during gc",
        [("_total", f'generation="{g}"', v) for g, v in gen])
    fam("python_gc_objects_uncollectable", "counter", "Uncollectable objects found during GC",
        [("_total", f'generation="{g}"', 0.0) for g, _ in gen])
    fam("python_gc_collections", "counter", "Number of times this generation was collected",
        [("_total", f'generation="{g}"', v + seq // 3) for g, v in gen])
    fam("python_info", "gauge", "Python platform information",
        [("", 'implementation="CPython",major="3",minor="12",patchlevel="11",version="3.12.11"', 1.0)])
    for name, doc, v in (("process_virtual_memory_bytes", "Virtual memory size in bytes.", 3.1e10),
                         ("process_resident_memory_bytes", "Resident memory size in bytes.", 2.2e9 + 4096 * (seq % 5)),
                         ("process_start_time_seconds", "Start time of the process since unix epoch in seconds.",
                          1.76e9),
                         ("process_cpu_seconds_total", "Total user and system CPU time spent in seconds.",
                          1234.5 + 0.01 * seq),
                         ("process_open_fds", "Number of open file descriptors.", 87.0),
                         ("process_max_fds", "Maximum number of open file descriptors.", 1048576.0)):
        fam(name, "counter" if name.endswith("_total") else "gauge", doc, [("", "", v)])
    eng = [f'engine="{e}",model_name="meta-llama/Llama-3.1-8B-Instruct"' for e in range(dp)]
    fam("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
        [("", lb, float(running)) for lb in eng])
    fam("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
        [("", lb, float(waiting)) for lb in eng])
    fam("vllm:engine_sleep_state", "gauge", "Engine sleep state; awake = 0 means engine is sleeping",
        [("", f'{lb},sleep_state="{s}"', 1.0 if s == "awake" else 0.0) for lb in eng
         for s in ("awake", "weights_offloaded", "discard_all")])
    fam("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
        [("", lb, 0.0) for lb in eng])
    for name, doc in (("vllm:num_preemptions", "Cumulative number of preemption from the engine."),
                      ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."),
                      ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
                      ("vllm:mm_cache_queries", "Multi-modal cache queries, in terms of number of queried items."),
                      ("vllm:mm_cache_hits", "Multi-modal cache hits, in terms of number of cached items."),
                      ("vllm:prompt_tokens", "Number of prefill tokens processed."),
                      ("vllm:generation_tokens", "Number of generation tokens processed.")):
        fam(name, "counter", doc, [(sfx, lb, 0.0) for lb in eng for sfx in ("_total", "_created")])
    fam("vllm:request_success", "counter", "Count of successfully processed requests.",
        [(sfx, f'{lb},finished_reason="{r}"', 0.0) for lb in eng for r in ("stop", "length", "abort", "error")
         for sfx in ("_total", "_created")])
    for name, doc, buckets in (
            ("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", _ITER),
            ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", _TOKENS),
            ("vllm:request_generation_tokens", "Number of generation tokens processed.", _TOKENS),
            ("vllm:request_max_num_generation_tokens", "Histogram of maximum number of requested generation tokens.",
             _TOKENS),
            ("vllm:request_params_n", "Histogram of the n request parameter.", (1, 2, 5, 10, 20)),
            ("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", _TOKENS),
            ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", _TTFT),
            ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", _ITL),
            ("vllm:request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per request.",
             _ITL),
            ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", _LAT),
            ("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", _LAT),
            ("vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.", _LAT),
            ("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", _LAT),
            ("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", _LAT)):
        fam(name, "histogram", doc, [s for lb in eng for s in hist(name, doc, buckets, lb)])
    fam("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig",
        [("", f'block_size="16",cache_dtype="auto",calculate_kv_scales="False",enable_prefix_caching="True",'
              f'engine="{e}",gpu_memory_utilization="0.9",is_attention_free="False",num_cpu_blocks="None",'
              f'num_gpu_blocks="27910",prefix_caching_hash_algo="sha256",swap_space="4"', 1.0) for e in range(dp)])
    fam("http_requests", "counter", "Total number of requests by method, status and handler.",
        [("_total", f'handler="{h}",method="{"GET" if h in ("/v1/models", "/health", "/metrics") else "POST"}",'
                    f'status="2xx"', float(seq if h == "/metrics" else 10)) for h in _HANDLERS])
    for name, doc in (("http_request_size_bytes", "Content length of incoming requests by handler."),
                      ("http_response_size_bytes", "Content length of outgoing responses by handler.")):
        fam(name, "summary", doc, [(sfx, f'handler="{h}"', float(seq if h == "/metrics" else 10))
                                   for h in _HANDLERS for sfx in ("_count", "_sum", "_created")])
    fam("http_request_duration_highr_seconds", "histogram", "Latency with many buckets but no API specific labels.",
        [(f"_bucket", f'le="{_fmt(b)}"', float(seq)) for b in
         (0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 7.5, 10.0, 30.0,
          60.0)] + [("_bucket", 'le="+Inf"', float(seq)), ("_count", "", float(seq)), ("_sum", "", 0.002 * seq)])
    fam("http_request_duration_seconds", "histogram", "Latency with only few buckets by handler.",
        [s for h in _HANDLERS for s in
         [("_bucket", f'handler="{h}",le="{b}",method="GET"', float(seq)) for b in ("0.1", "0.5", "1.0", "+Inf")]
         + [("_count", f'handler="{h}",method="GET"', float(seq)), ("_sum", f'handler="{h}",method="GET"', 0.001 * seq)]])
    return ("\n".join(out) + "\n").encode()


def llamacpp_body() -> bytes:
    from types import SimpleNamespace

    from llmgw.sim.llamacpp_core import Metrics
    from llmgw.sim.llamacpp_surface import metrics_text
    core = SimpleNamespace(metrics=Metrics(prompt_tokens=700, prompt_cached=300, predicted_tokens=50),
                           requests_processing=0, requests_deferred=0)
    return metrics_text(core).encode()  # type: ignore[arg-type]


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


def idle_router_cpu(counts: list[int], window: float, warmup: float, rounds: int, ab_code: str | None,
                    extra: str, profile: float = 0.0) -> None:
    from loadgen import proc_cpu_seconds
    from procs import spawn, stop
    variants: list[tuple[str, dict[str, str]]] = [("this tree", {})]
    if ab_code:
        variants.append((f"code of {ab_code}", {"PYTHONPATH": str(Path(ab_code).resolve()), "PYTHONSAFEPATH": "1"}))
    for n in counts:
        procs: list[subprocess.Popen[bytes]] = []
        try:
            sp, info = spawn([sys.executable, __file__, "--serve", str(n)], cpu=1)
            procs.append(sp)
            d = Path(tempfile.mkdtemp())
            reps = "".join(f'[[models.replicas]]\nurl = "http://127.0.0.1:{p}"\n' for p in info["ports"])
            routers = []
            for k, (name, env) in enumerate(variants):
                cfg = d / f"r{k}.toml"
                cfg.write_text('[server]\nhost = "127.0.0.1"\n[control]\nlisten = "127.0.0.1:0"\nstore = ":memory:"\n'
                               f'[admin]\nsocket = "{d / f"a{k}.sock"}"\n{extra}\n'
                               f'[[models]]\nname = "m"\nengine = "vllm"\n{reps}')
                rp, _ = spawn([sys.executable, "-m", "llmgw", "daemon", "--role", "router", "--config", str(cfg),
                               "--port", "0", "--log-level", "warning"], cpu=0, env=env)
                procs.append(rp)
                routers.append((name, rp))
            time.sleep(warmup)
            if profile:
                _profile(routers, profile, n)
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
                print(f"idle router ({name}), {n:4d} replicas: {100 * frac:6.2f}% of a core, "
                      f"{1e6 * frac / n:7.1f} µs per replica per second "
                      f"(median of {rounds} × {window:.0f} s; rounds: {', '.join(f'{100 * v:.2f}%' for v in vals)})",
                      flush=True)
        finally:
            for p in procs:
                stop(p)


def main() -> None:
    ap = argparse.ArgumentParser()
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
    ap.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json-parse", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
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
                    a.config_extra.replace("\\n", "\n"), a.profile)


if __name__ == "__main__":
    main()
