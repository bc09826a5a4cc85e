"""Scheduler decision time: mean, p50 and p99 microseconds per decision at 8, 64 and 512
replicas for each preset strategy (targets on the reference 2-core box: <= 50 µs at 8, <= 300 µs
at 512). Pure CPU, no I/O: a synthetic fleet with live-looking metrics, a session key on half the
requests, and inflight bumped on the chosen replica after each decision (as the router does).

    .venv/bin/python bench/bench_decide.py [--decisions 3000] [--sizes 8,64,512] [--idle] [--runs 1]

--idle starts from an idle fleet (all gauges 0, so every total ties at first): the tie-break path.
The machine is shared: p50 is the figure to compare, the mean and p99 carry the noise. --runs N
repeats the whole table N times (interleaved, so a burst of load elsewhere hits every case alike)
and prints each figure's median over the runs."""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from collections import deque

from llmgw.route.scheduler import Scheduler
from llmgw.route.strategies import PRESETS
from llmgw.route.types import EndpointView, RequestInfo


def fleet(n: int, rng: random.Random, idle: bool = False) -> list[EndpointView]:
    return [
        EndpointView(
            id=f"llama-70b/replica-{i}", model="llama-70b",
            url=f"http://10.0.{i // 250}.{i % 250}:8000",
            running=0.0 if idle else float(rng.randrange(0, 32)),
            waiting=0.0 if idle else float(rng.randrange(0, 4)),
            kv_usage=0.0 if idle else rng.uniform(0.05, 0.9), scraped_at=0.0, stale=False,
            inflight=0 if idle else rng.randrange(0, 8), inflight_at_scrape=0,
        )
        for i in range(n)
    ]


def bench(n: int, strategy: str, decisions: int, idle: bool = False) -> list[float]:
    rng = random.Random(n)
    eps = fleet(n, rng, idle)
    by_id = {e.id: e for e in eps}
    sched = Scheduler()
    strat = PRESETS[strategy]
    reqs = [RequestInfo(request_id=f"r{k}", model="llama-70b", base_model="llama-70b",
                        session_key=f"s{k % 97}" if k % 2 else None) for k in range(decisions)]
    for r in reqs[:200]:  # warm-up: builds the hash ring, fills caches
        sched.decide(r, eps, strat, now=0.0, wall=0.0, rng=rng)
    times: list[float] = []
    live: deque[EndpointView] = deque()  # requests in flight, oldest first
    gc.collect()
    for k, r in enumerate(reqs):
        if k % 100 == 0 and not idle:  # a scrape lands: metrics move, our starts are in them
            for e in eps:
                e.running = float(rng.randrange(0, 32))
                e.inflight_at_scrape = e.inflight
        d = sched.decide(r, eps, strat, now=0.0, wall=0.0, rng=rng)
        times.append(d.decide_us)
        chosen = by_id[d.chosen]  # type: ignore[index]
        chosen.inflight += 1  # as the router does on start...
        live.append(chosen)
        if len(live) > 2 * n:  # ...and on end: a steady ~2 requests in flight per replica
            live.popleft().inflight -= 1
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decisions", type=int, default=3000)
    ap.add_argument("--sizes", default="8,64,512")
    ap.add_argument("--idle", action="store_true", help="start from an idle fleet")
    ap.add_argument("--runs", type=int, default=1, help="repeat and report medians")
    args = ap.parse_args()
    cases = [(int(s), name) for s in args.sizes.split(",") for name in PRESETS]
    stats: dict[tuple[int, str], list[tuple[float, float, float]]] = {c: [] for c in cases}
    t0 = time.perf_counter()
    for _ in range(args.runs):
        for n, name in cases:
            ts = sorted(bench(n, name, args.decisions, args.idle))
            p99 = ts[min(len(ts) - 1, int(len(ts) * 0.99))]
            stats[n, name].append((statistics.fmean(ts), ts[len(ts) // 2], p99))
    print(f"{'replicas':>8} {'strategy':<13} {'mean µs':>8} {'p50 µs':>8} {'p99 µs':>8}")
    for (n, name), runs in stats.items():
        mean, p50, p99 = (statistics.median(col) for col in zip(*runs))
        print(f"{n:>8} {name:<13} {mean:>8.1f} {p50:>8.1f} {p99:>8.1f}")
    print(f"({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
