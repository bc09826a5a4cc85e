"""What this router tells the autoscaler about each model's load (pure): the figures of
:class:`llmgw.fleet.autoscale.RouterLoad`, as plain data. The control plane's leader reads its own
router's with ``RouterPort.autoscale_load`` and the other routers' from the store, and merges them
(llmgw.fleet.autoscale.merge).

Per model:

- ``arrivals``: client requests planned so far (the eval runner's left out), a running count —
  idle detection reads it, not the scrape pace, so a quiet model is seen at once;
- ``inflight``: requests out to its replicas now (the router's own count, exact);
- ``queued`` and ``cold_waiting``: waiting in admission now, and whether they wait for a cold start;
- ``cold_waits``: requests that ever waited for a cold start (``llmgw_cold_start_waits_total``);
- ``engine_waiting`` and ``kv_usage``: the engines' queues summed, and their mean KV cache use, from
  the last scrapes of the replicas that take requests (None where no replica has a reading);
- ``ttft``: the running TTFT histogram's counts (llmgw.route.counters.LATENCY_BUCKETS, +Inf last).
"""

from __future__ import annotations

from typing import Any

from .counters import LATENCY_BUCKETS, RouterCounters
from .replicas import ReplicaTable
from .waiting import WaitRoom

__all__ = ["LoadReport"]


class LoadReport:
    def __init__(self, table: ReplicaTable, wait: WaitRoom, counters: RouterCounters) -> None:
        self.table = table
        self.wait = wait
        self.counters = counters
        self.arrivals: dict[str, int] = {}
        self.cold_waits: dict[str, int] = {}

    def arrived(self, model: str) -> None:
        self.arrivals[model] = self.arrivals.get(model, 0) + 1

    def cold_wait(self, model: str) -> None:
        self.cold_waits[model] = self.cold_waits.get(model, 0) + 1

    def report(self) -> dict[str, dict[str, Any]]:
        """Every model this router knows: its figures (above), JSON-ready."""
        out: dict[str, dict[str, Any]] = {}
        queues = self.wait.queues
        empty = [0] * (len(LATENCY_BUCKETS) + 1)
        for name, entry in self.table.models.items():
            inflight = 0
            waiting = 0.0
            kv_sum = 0.0
            kv_n = 0
            seen = False
            for r in entry.replicas:
                v = r.view
                inflight += v.inflight
                if r.draining:
                    continue
                if v.waiting is not None:
                    waiting += v.waiting
                    seen = True
                if v.kv_usage is not None:
                    kv_sum += v.kv_usage
                    kv_n += 1
            q = queues.get(name)
            queued = len(q) if q is not None else 0
            h = self.counters.ttft.get((name,))
            out[name] = {
                "arrivals": self.arrivals.get(name, 0),
                "inflight": inflight,
                "queued": queued,
                "cold_waiting": queued if queued and self.wait.cold(entry) else 0,
                "cold_waits": self.cold_waits.get(name, 0),
                "engine_waiting": waiting if seen else 0.0,
                "kv_usage": kv_sum / kv_n if kv_n else None,
                "ttft": list(h.counts) if h is not None else list(empty),
            }
        return out
