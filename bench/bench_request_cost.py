"""The router's own CPU cost of one request, in process: the trio shell and the core (plan, next,
finish: scheduler, admission, trace, counters) around a stand-in upstream that answers at once
(bench/walk_request.py's), so no socket or engine time is in it. Compare two trees by running it
with each on PYTHONPATH, e.g. to price a change to the request path:

    PYTHONPATH=. .venv/bin/python bench/bench_request_cost.py [--requests 20000] [--rounds 5]

Prints the median over rounds of µs per request (one trio run per round, a fresh router each)."""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from pathlib import Path
from typing import Any

import trio

_spec = importlib.util.spec_from_file_location("walk_request", Path(__file__).resolve().parent / "walk_request.py")
assert _spec is not None and _spec.loader is not None
walk = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(walk)


def one_round(n: int) -> float:
    from llmgw.config import parse_config
    from llmgw.daemon.net.httpserver import Request
    from llmgw.daemon.router.proxy import Router

    router = Router(parse_config(walk.CFG), walk._Pool(0), seed=0)  # type: ignore[arg-type]
    req = Request("POST", "/v1/chat/completions", "/v1/chat/completions", "",
                  [("content-type", "application/json")], walk.BODY, ("127.0.0.1", 1))
    out: list[float] = []

    async def main() -> None:
        for _ in range(200):  # warm up
            resp = await router.handle(req)
            await resp.body.relay(walk._Sink())  # type: ignore[union-attr]
        t0 = time.process_time()  # CPU time: the box is shared
        for _ in range(n):
            resp = await router.handle(req)
            await resp.body.relay(walk._Sink())  # type: ignore[union-attr]
        out.append((time.process_time() - t0) / n * 1e6)

    trio.run(main)
    return out[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=5)
    ns = ap.parse_args()
    runs: list[Any] = [one_round(ns.requests) for _ in range(ns.rounds)]
    print(f"{statistics.median(runs):.2f} µs per request (median of {ns.rounds} rounds: "
          + ", ".join(f"{r:.2f}" for r in runs) + ")")


if __name__ == "__main__":
    main()
