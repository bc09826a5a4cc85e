"""What W3C trace context and OTLP export cost the router per request, in process (the request
path of bench/bench_request_cost.py around a stand-in upstream that answers at once):

- ``off``          no traceparent from the client, no export (the router still makes a trace id
                   and sends the engine a traceparent: that is the baseline every request pays)
- ``traceparent``  the client sends traceparent and tracestate (parsed, passed on), no export
- ``otlp``         as ``traceparent``, and every trace exported over OTLP/HTTP (2 spans: the
                   request and its attempt; the 6 phases as span events) to a collector in another
                   process (a tiny HTTP server that reads and discards)
- ``otlp-phases``  as ``otlp`` with ``otlp_phase_spans = true`` (8 spans)
- ``otlp-sampled`` no traceparent, ``otlp_sample = 0.1``: a tenth of the traces exported

For each: µs per request on the trio thread (wall time of the request loop: what a request's
latency and the router's throughput see) and CPU µs per request of the whole process (the SDK's
exporting thread included: what the host pays). Spans exported = spans submitted is checked, so
no drop hides the cost.

    PYTHONPATH=. .venv/bin/python bench/bench_otel_cost.py [--requests 5000] [--rounds 3]"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import trio

_spec = importlib.util.spec_from_file_location("walk_request", Path(__file__).resolve().parent / "walk_request.py")
assert _spec is not None and _spec.loader is not None
walk = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(walk)

COLLECTOR = r"""
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", "0")))
        self.send_response(200); self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0"); self.end_headers()
    def log_message(self, *a): pass
s = ThreadingHTTPServer(("127.0.0.1", 0), H)
print(s.server_address[1], flush=True)
s.serve_forever()
"""


def one_round(n: int, mode: str, collector: str) -> tuple[float, float, str]:
    from llmgw.config import parse_config
    from llmgw.daemon.net.httpserver import Request
    from llmgw.daemon.router.proxy import Router

    cfg = walk.CFG
    if mode.startswith("otlp"):
        cfg += f'[router.traces]\notlp_endpoint = "{collector}"\n'
        cfg += {"otlp-phases": "otlp_phase_spans = true\n", "otlp-sampled": "otlp_sample = 0.1\n"}.get(mode, "")
    router = Router(parse_config(cfg), walk._Pool(0), seed=0)  # type: ignore[arg-type]
    headers = [("content-type", "application/json")]
    if mode in ("traceparent", "otlp", "otlp-phases"):
        headers += [("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
                    ("tracestate", "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE")]
    req = Request("POST", "/v1/chat/completions", "/v1/chat/completions", "", headers, walk.BODY, ("127.0.0.1", 1))
    out: list[float] = []

    async def main() -> None:
        for _ in range(200):  # warm up
            resp = await router.handle(req)
            await resp.body.relay(walk._Sink())  # type: ignore[union-attr]
        c0, t0 = time.process_time(), time.perf_counter()
        for _ in range(n):
            resp = await router.handle(req)
            await resp.body.relay(walk._Sink())  # type: ignore[union-attr]
        t1 = time.perf_counter()
        if router.otlp is not None:  # the SDK's thread sends what is queued: its CPU is counted too
            router.otlp.processor.force_flush(60_000)
        c1 = time.process_time()
        out.extend([(t1 - t0) / n * 1e6, (c1 - c0) / n * 1e6])

    trio.run(main)
    note = ""
    if router.otlp is not None:
        e = router.otlp
        note = (f"traces queued {e.traces}, dropped {e.dropped}; spans submitted {e.submitted}, exported "
                f"{e.exported}, failed {e.failed}")
        e.close()
    return out[0], out[1], note


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=3)
    ns = ap.parse_args()
    os.environ.setdefault("OTEL_BSP_MAX_QUEUE_SIZE", str(16 * ns.requests))  # measure the cost, not drops
    coll = subprocess.Popen([sys.executable, "-c", COLLECTOR], stdout=subprocess.PIPE, text=True)
    try:
        assert coll.stdout is not None
        url = f"http://127.0.0.1:{coll.stdout.readline().strip()}/v1/traces"
        for mode in ("off", "traceparent", "otlp", "otlp-phases", "otlp-sampled"):
            runs: list[Any] = [one_round(ns.requests, mode, url) for _ in range(ns.rounds)]
            wall = statistics.median(r[0] for r in runs)
            cpu = statistics.median(r[1] for r in runs)
            print(f"{mode:13s} {wall:7.2f} µs/request on the trio thread, {cpu:7.2f} µs CPU/request in all"
                  + (f"  ({runs[-1][2]})" if runs[-1][2] else ""))
    finally:
        coll.terminate()
        coll.wait(5)


if __name__ == "__main__":
    main()
