"""The admission queue alone, in simulated time: a flooding tenant and a steady one, FIFO (the
WaitQueue llmgw had before tenants) against the FairQueue, and what a high band gets under a low
band's flood — the queue's part of issue 24's measurement, without processes or a network.

    .venv/bin/python bench/bench_fair_queue.py [--seconds 600] [--slots 8] [--service 1.0] [--seed 1]

A model with --slots requests in flight at most, each taking --service s on average
(exponential: completions do not fall into step), so capacity is slots/service requests per s. Tenant A sends 10× capacity (Poisson), tenant B 10 % of it; a
queue of 256 with a 10 s deadline, as [router] has by default. For each queue and for B alone it
prints B's wait in the queue (p50, p90, p99), how many of B's requests were served, refused (full
queue), displaced or timed out, and the service share each tenant got. The end-to-end TTFT bench
over real processes needs the router's authentication to tag requests: bench/bench_tenants.py."""

from __future__ import annotations

import argparse
import heapq
import random
from typing import Any

from llmgw.route.admission import WaitQueue
from llmgw.route.fair_queue import FairQueue
from llmgw.tenants.model import band_rank

QUEUE, DEADLINE = 256, 10.0


class _Fifo:
    """WaitQueue behind FairQueue's enqueue signature (tenants ignored: today's behaviour)."""

    def __init__(self, size: int) -> None:
        self.q = WaitQueue(size)

    def enqueue(self, rid: str, deadline: float, now: float, **_: Any) -> Any:
        return self.q.enqueue(rid, deadline, now)

    def take_displaced(self) -> list[Any]:
        return []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.q, name)


def run(queue: Any, rates: dict[str, float], bands: dict[str, str], seconds: float, slots: int,
        service: float, seed: int) -> dict[str, dict[str, Any]]:
    rng = random.Random(seed)
    events: list[tuple[float, int, str, str]] = []  # (time, seq, kind, tenant)
    seq = 0
    for tenant, rate in rates.items():
        t = 0.0
        while rate > 0:
            t += rng.expovariate(rate)
            if t > seconds:
                break
            seq += 1
            events.append((t, seq, "arrive", tenant))
    heapq.heapify(events)
    busy = 0
    stats = {k: {"waits": [], "served": 0, "refused": 0, "displaced": 0, "expired": 0} for k in rates}
    tickets: dict[str, tuple[str, float]] = {}

    def start(tenant: str, now: float, waited: float) -> None:
        nonlocal busy, seq
        busy += 1
        stats[tenant]["served"] += 1
        stats[tenant]["waits"].append(waited)
        seq += 1
        heapq.heappush(events, (now + rng.expovariate(1 / service), seq, "done", tenant))

    while events:
        now, _, kind, tenant = heapq.heappop(events)
        for t in queue.expire(now):
            who, _at = tickets.pop(t.request_id)
            stats[who]["expired"] += 1
        if kind == "done":
            busy -= 1
            for t in queue.on_capacity(1):
                who, at = tickets.pop(t.request_id)
                start(who, now, now - at)
            continue
        if queue.admit_now(busy >= slots):
            start(tenant, now, 0.0)
            continue
        rid = f"{tenant}{len(tickets)}-{now}"
        t = queue.enqueue(rid, now + DEADLINE, now, tenant=tenant, band=band_rank(bands[tenant]),
                          cost=1)
        for d in queue.take_displaced():
            who, _at = tickets.pop(d.request_id)
            stats[who]["displaced"] += 1
        if t is None:
            stats[tenant]["refused"] += 1
        else:
            tickets[rid] = (tenant, now)
    return stats


def _pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def report(title: str, stats: dict[str, dict[str, Any]], who: str) -> None:
    s = stats[who]
    total = sum(x["served"] for x in stats.values()) or 1
    shares = ", ".join(f"{k} {x['served'] / total:.1%}" for k, x in stats.items())
    asked = s["served"] + s["refused"] + s["displaced"] + s["expired"]
    print(f"{title:<34} {who}: wait p50 {_pct(s['waits'], .5):6.2f}s p90 {_pct(s['waits'], .9):6.2f}s "
          f"p99 {_pct(s['waits'], .99):6.2f}s  served {s['served']}/{asked} refused {s['refused']} "
          f"displaced {s['displaced']} expired {s['expired']}  share: {shares}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=600.0)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--service", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    cap = a.slots / a.service
    flood, steady = 10 * cap, 0.1 * cap
    args = (a.seconds, a.slots, a.service, a.seed)
    same = {"A": "normal", "B": "normal"}
    report("B alone", run(FairQueue(QUEUE), {"A": 0.0, "B": steady}, same, *args), "B")
    report("FIFO (before tenants)", run(_Fifo(QUEUE), {"A": flood, "B": steady}, same, *args), "B")
    report("fair queue, same band", run(FairQueue(QUEUE), {"A": flood, "B": steady}, same, *args), "B")
    report("fair queue, B high, A low", run(FairQueue(QUEUE), {"A": flood, "B": steady},
                                            {"A": "low", "B": "high"}, *args), "B")
    report("fair queue, B at 10x capacity too", run(FairQueue(QUEUE), {"A": flood, "B": flood}, same, *args), "B")


if __name__ == "__main__":
    main()
