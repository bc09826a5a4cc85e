"""The router's Prometheus metrics (`llmgw_` names), one registry per router instance so that two
daemons in one process never collide. State gauges are computed at scrape time; the request path
only bumps counters and observes histograms. No unbounded labels: models and endpoints are
configured sets, never request ids or users.

The per-request series (requests, time to first byte, latency, decisions, decision time) are
plain Python counters turned into metric families at scrape time: prometheus_client's
``labels(...).inc()``/``observe()`` cost 2-3 us each (a label lookup and a lock per value), ~10 us
a request for these five; a dict lookup and a bisect cost a tenth of that. The exposition is the
same as prometheus_client's Counter/Histogram (``_total``, ``_bucket``/``_count``/``_sum``, ``_created``)."""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterable
from typing import TYPE_CHECKING

import trio
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from llmgw.route.types import Decision

if TYPE_CHECKING:
    from llmgw.daemon.router.proxy import Router

_BREAKER = {"closed": 0.0, "half_open": 1.0, "open": 2.0}
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_DECIDE = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3)


class _Hist:
    """One histogram series: non-cumulative bucket counts (the last is +Inf) and the sum."""
    __slots__ = ("counts", "created", "sum")

    def __init__(self, n: int) -> None:
        self.counts = [0] * (n + 1)
        self.sum = 0.0
        self.created = time.time()


def _hist_family(name: str, doc: str, labels: list[str], bounds: tuple[float, ...],
                 series: dict[tuple[str, ...], _Hist]) -> HistogramMetricFamily:
    fam = HistogramMetricFamily(name, doc, labels=labels)
    les = [str(b) for b in bounds] + ["+Inf"]
    for key, h in series.items():
        acc, buckets = 0, []
        for le, n in zip(les, h.counts):
            acc += n
            buckets.append((le, float(acc)))
        fam.add_metric(list(key), buckets, h.sum)
        fam.samples.append(Sample(name + "_created", dict(zip(labels, key)), h.created))
    return fam


class RouterMetrics(Collector):
    def __init__(self, router: Router) -> None:
        self.router = router
        self.registry = r = CollectorRegistry(auto_describe=False)
        # Hot path: plain counters, exported by collect().
        self._requests: dict[tuple[str, str, int], list[float]] = {}  # -> [count, created]
        self._ttft: dict[tuple[str, ...], _Hist] = {}
        self._latency: dict[tuple[str, ...], _Hist] = {}
        self._decisions: dict[tuple[str, str, bool], list[float]] = {}
        self._decide = _Hist(len(_DECIDE))
        self.upstream_errors = Counter("llmgw_upstream_errors", "Upstream failures by endpoint and kind.",
                                       ["endpoint", "kind"], registry=r)
        self.rejections = Counter("llmgw_admission_rejected", "Requests refused by admission (429).",
                                  ["model", "reason"], registry=r)
        r.register(self)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def request_done(self, model: str, outcome: str, code: int, ttft: float | None, latency: float | None) -> None:
        key = (model, outcome, code)
        c = self._requests.get(key)
        if c is None:
            c = self._requests[key] = [0, time.time()]
        c[0] += 1
        if ttft is not None:
            h = self._ttft.get((model,))
            if h is None:
                h = self._ttft[(model,)] = _Hist(len(_LATENCY))
            h.counts[bisect_left(_LATENCY, ttft)] += 1
            h.sum += ttft
        if latency is not None:
            h = self._latency.get((model,))
            if h is None:
                h = self._latency[(model,)] = _Hist(len(_LATENCY))
            h.counts[bisect_left(_LATENCY, latency)] += 1
            h.sum += latency

    def decision(self, d: Decision) -> None:
        key = (d.strategy, d.picker, bool(d.chosen))
        c = self._decisions.get(key)
        if c is None:
            c = self._decisions[key] = [0, time.time()]
        c[0] += 1
        h = self._decide
        s = d.decide_us / 1e6
        h.counts[bisect_left(_DECIDE, s)] += 1
        h.sum += s

    def upstream_error(self, endpoint: str, kind: str) -> None:
        self.upstream_errors.labels(endpoint, kind).inc()

    def rejected(self, model: str, reason: str) -> None:
        self.rejections.labels(model, reason).inc()

    def _request_families(self) -> Iterable[Metric]:
        req = CounterMetricFamily("llmgw_requests", "Requests by model, outcome and status code.",
                                  labels=["model", "outcome", "code"])
        for (model, outcome, code), (n, created) in self._requests.items():
            req.add_metric([model, outcome, str(code)], n, created=created)
        yield req
        yield _hist_family("llmgw_time_to_first_byte_seconds", "Time to the first response byte (TTFT).",
                           ["model"], _LATENCY, self._ttft)
        yield _hist_family("llmgw_request_latency_seconds", "Whole request latency.", ["model"], _LATENCY,
                           self._latency)
        dec = CounterMetricFamily("llmgw_decisions", "Routing decisions by strategy, picker and result.",
                                  labels=["strategy", "picker", "result"])
        for (strategy, picker, picked), (n, created) in self._decisions.items():
            dec.add_metric([strategy, picker, "picked" if picked else "none"], n, created=created)
        yield dec
        yield _hist_family("llmgw_decision_seconds", "Time spent deciding.", [], _DECIDE, {(): self._decide})

    def collect(self) -> Iterable[Metric]:
        yield from self._request_families()
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
