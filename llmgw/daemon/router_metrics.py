"""The router's Prometheus metrics (`llmgw_` names), one registry per router instance so that two
daemons in one process never collide. State gauges are computed at scrape time; the request path
only bumps counters and observes histograms. No unbounded labels: models and endpoints are
configured sets, never request ids or users."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import trio
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from llmgw.route.types import Decision

if TYPE_CHECKING:
    from llmgw.daemon.router import Router

_BREAKER = {"closed": 0.0, "half_open": 1.0, "open": 2.0}
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_DECIDE = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3)


class RouterMetrics(Collector):
    def __init__(self, router: Router) -> None:
        self.router = router
        self.registry = r = CollectorRegistry(auto_describe=False)
        self.requests = Counter("llmgw_requests", "Requests by model, outcome and status code.",
                                ["model", "outcome", "code"], registry=r)
        self.ttft = Histogram("llmgw_time_to_first_byte_seconds", "Time to the first response byte (TTFT).",
                              ["model"], buckets=_LATENCY, registry=r)
        self.latency = Histogram("llmgw_request_latency_seconds", "Whole request latency.", ["model"],
                                 buckets=_LATENCY, registry=r)
        self.decisions = Counter("llmgw_decisions", "Routing decisions by strategy, picker and result.",
                                 ["strategy", "picker", "result"], registry=r)
        self.decide_time = Histogram("llmgw_decision_seconds", "Time spent deciding.", buckets=_DECIDE, registry=r)
        self.upstream_errors = Counter("llmgw_upstream_errors", "Upstream failures by endpoint and kind.",
                                       ["endpoint", "kind"], registry=r)
        self.rejections = Counter("llmgw_admission_rejected", "Requests refused by admission (429).",
                                  ["model", "reason"], registry=r)
        r.register(self)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def request_done(self, model: str, outcome: str, code: int, ttft: float | None, latency: float | None) -> None:
        self.requests.labels(model, outcome, str(code)).inc()
        if ttft is not None:
            self.ttft.labels(model).observe(ttft)
        if latency is not None:
            self.latency.labels(model).observe(latency)

    def decision(self, d: Decision) -> None:
        self.decisions.labels(d.strategy, d.picker, "picked" if d.chosen else "none").inc()
        self.decide_time.observe(d.decide_us / 1e6)

    def upstream_error(self, endpoint: str, kind: str) -> None:
        self.upstream_errors.labels(endpoint, kind).inc()

    def rejected(self, model: str, reason: str) -> None:
        self.rejections.labels(model, reason).inc()

    def collect(self) -> Iterable[Metric]:
        reps = list(self.router.registry.all_replicas())
        now = trio.current_time()
        labels = ["endpoint", "model"]

        def gauge(name: str, doc: str, value_of: object) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            for rep in reps:
                val = value_of(rep)  # type: ignore[operator]
                if val is not None:
                    g.add_metric([rep.id, rep.view.model], float(val))
            return g

        yield gauge("llmgw_endpoint_inflight", "Requests this router has in flight on the endpoint.",
                    lambda r: r.view.inflight)
        yield gauge("llmgw_endpoint_breaker_state", "Breaker state: 0 closed, 1 half-open, 2 open.",
                    lambda r: _BREAKER.get(r.breaker.state, 2.0))
        yield gauge("llmgw_endpoint_running", "Engine running requests at the last scrape.", lambda r: r.view.running)
        yield gauge("llmgw_endpoint_waiting", "Engine waiting requests at the last scrape.", lambda r: r.view.waiting)
        yield gauge("llmgw_endpoint_kv_usage", "Engine KV-cache usage (0..1) at the last scrape.",
                    lambda r: r.view.kv_usage)
        yield gauge("llmgw_endpoint_stale", "1 when the endpoint's scraped metrics are stale.",
                    lambda r: 1.0 if self.router.registry.is_stale(r, now) else 0.0)
        yield gauge("llmgw_endpoint_scrape_ok", "1 when the last scrape met the metric contract.",
                    lambda r: 0.0 if r.scrape_error else 1.0)
        errors = CounterMetricFamily("llmgw_scrape_errors", "Failed scrapes or contract violations.",
                                     labels=labels)
        for rep in reps:
            errors.add_metric([rep.id, rep.view.model], rep.scrape_errors)
        yield errors
        pm = self.router.prefix.metrics()
        dec = CounterMetricFamily("llmgw_prefix_decisions", "Prefix-affinity outcome of each decision.",
                                  labels=["outcome"])
        for outcome, n in pm["decisions"].items():
            dec.add_metric([outcome], n)
        yield dec
        mb = pm["matched_bytes"]
        h = HistogramMetricFamily("llmgw_prefix_matched_bytes", "Head bytes the chosen replica held.")
        h.add_metric([], [(str(le) if le != float("inf") else "+Inf", c) for le, c in mb["buckets"]], mb["sum"])
        yield h
        tree = pm["tree"]
        for key, doc in (("nodes", "Prefix tree nodes."), ("bytes", "Prefix tree bytes (accounted).")):
            if key in tree:
                g = GaugeMetricFamily(f"llmgw_prefix_tree_{key}", doc)
                g.add_metric([], float(tree[key]))
                yield g
        alarm = GaugeMetricFamily("llmgw_prefix_zero_hit_alarm",
                                  "1 while prefix hits stay at zero although traffic shares prefixes.")
        alarm.add_metric([], 1.0 if self.router.prefix.zero_hit_alarm(now) else 0.0)
        yield alarm
        q = GaugeMetricFamily("llmgw_admission_queue_length", "Requests waiting for capacity.", labels=["model"])
        for model, queue in self.router.queues.items():
            q.add_metric([model], len(queue))
        yield q
