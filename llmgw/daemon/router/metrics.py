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

from bisect import bisect_left
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import trio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from llmgw.daemon.net.httpserver import ServerStats
from llmgw.daemon.router.registry import Registry
from llmgw.route.counters import DECIDE_BUCKETS, LATENCY_BUCKETS, Hist, RouterCounters
from llmgw.route.kv_scorer import MATCHED_BUCKETS, KvDecisionStats
from llmgw.route.kv_scorer import OUTCOMES as KV_OUTCOMES
from llmgw.route.replicas import Replica

__all__ = ["MetricsSource", "RouterMetrics", "Tier2DecisionMetrics", "TOKENIZE_BUCKETS"]

_BREAKER = {"closed": 0.0, "half_open": 1.0, "open": 2.0}


class MetricsSource(Protocol):
    """What the exporter reads of the router at scrape time (the core implements it)."""

    def all_replicas(self) -> Iterable[Replica]: ...

    def is_stale(self, rep: Replica, now: float) -> bool: ...

    def prefix_metrics(self) -> dict[str, Any]: ...

    def zero_hit_alarm(self, now: float) -> bool: ...

    def queue_lengths(self) -> Mapping[str, int]: ...

    def queue_by_band(self) -> Mapping[tuple[str, str], int]: ...

    def queue_displaced(self) -> Mapping[str, int]: ...

    def counts(self) -> RouterCounters: ...


def _hist_family(name: str, doc: str, labels: list[str], bounds: tuple[float, ...],
                 series: Mapping[tuple[str, ...], Hist]) -> HistogramMetricFamily:
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


def _counter_family(name: str, doc: str, labels: list[str],
                    series: Mapping[tuple[Any, ...], list[float]]) -> CounterMetricFamily:
    fam = CounterMetricFamily(name, doc, labels=labels)
    for key, (n, created) in series.items():
        fam.add_metric([str(k) for k in key], n, created=created)
    return fam


class RouterMetrics(Collector):
    """The router's Prometheus exposition: the core's counters and, computed at scrape time,
    the state gauges read from a :class:`MetricsSource`."""

    def __init__(self, source: MetricsSource, *, registry: Registry | None = None,
                 http: ServerStats | None = None) -> None:
        self.counters = source.counts()  # read-only here: the core bumps them
        self.source = source
        self.replicas = registry  # its failed reads of engines' /v1/models and /slots
        self.http = http  # the OpenAI endpoint's connection counters
        self.registry = r = CollectorRegistry(auto_describe=False)
        r.register(self)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def _request_families(self) -> Iterable[Metric]:
        c = self.counters
        yield _counter_family("llmgw_requests", "Requests by model, outcome and status code.",
                              ["model", "outcome", "code"], c.requests)
        yield _hist_family("llmgw_time_to_first_byte_seconds", "Time to the first response byte (TTFT).",
                           ["model"], LATENCY_BUCKETS, c.ttft)
        yield _hist_family("llmgw_request_latency_seconds", "Whole request latency.", ["model"],
                           LATENCY_BUCKETS, c.latency)
        dec = CounterMetricFamily("llmgw_decisions", "Routing decisions by strategy, picker and result.",
                                  labels=["strategy", "picker", "result"])
        for (strategy, picker, picked), (n, created) in c.decisions.items():
            dec.add_metric([strategy, picker, "picked" if picked else "none"], n, created=created)
        yield dec
        yield _hist_family("llmgw_decision_seconds", "Time spent deciding.", [], DECIDE_BUCKETS,
                           {(): c.decide})
        yield _counter_family("llmgw_upstream_errors", "Upstream failures by endpoint and kind.",
                              ["endpoint", "kind"], c.upstream_errors)
        yield _counter_family("llmgw_admission_rejected", "Requests refused by admission (429).",
                              ["model", "reason"], c.rejections)
        yield _counter_family("llmgw_poison_requests", "Requests two replicas answered 5xx: the request's "
                              "fault, counted on no breaker.", ["model"], c.poison)

    def _edge_families(self) -> Iterable[Metric]:
        """The OpenAI endpoint's connections, and what engines answered that could not be used."""
        h = self.http
        if h is not None:
            for name, doc, value in (
                    ("llmgw_http_connections_open", "Open client connections.", h.connections_open),
                    ("llmgw_http_connections_max", "The cap on open client connections (0: none).",
                     h.max_connections)):
                g = GaugeMetricFamily(name, doc)
                g.add_metric([], float(value))
                yield g
            for name, doc, value in (
                    ("llmgw_http_connections_refused", "Connections refused at the cap (503).",
                     h.connections_refused),
                    ("llmgw_http_connections_evicted", "Connections closed at the cap to make room: the longest "
                     "waiting for a request.", h.connections_evicted),
                    ("llmgw_http_connections_idle_closed", "Connections closed for sending no request in time.",
                     h.connections_idle_closed),
                    ("llmgw_http_accept_errors", "accept() failures (EMFILE...): accepting paused.",
                     h.accept_errors),
                    ("llmgw_http_responses_aborted", "Responses cut off because the engine's answer broke off.",
                     h.responses_aborted)):
                c = CounterMetricFamily(name, doc)
                c.add_metric([], float(value))
                yield c
        if self.replicas is not None:
            c = CounterMetricFamily("llmgw_engine_answer_errors", "Unusable /v1/models, /slots and /lora-adapters "
                                    "answers (too large, malformed, failed).", labels=["endpoint", "path"])
            for (rid, path), n in self.replicas.answer_errors.items():
                c.add_metric([rid, path], float(n))
            yield c

    def collect(self) -> Iterable[Metric]:
        yield from self._request_families()
        yield from self._edge_families()
        src = self.source
        reps = list(src.all_replicas())
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
                    lambda r: 1.0 if src.is_stale(r, now) else 0.0)
        yield gauge("llmgw_endpoint_scrape_ok", "1 when the last scrape met the metric contract.",
                    lambda r: 0.0 if r.scrape_error else 1.0)
        errors = CounterMetricFamily("llmgw_scrape_errors", "Failed scrapes or contract violations.",
                                     labels=labels)
        for rep in reps:
            errors.add_metric([rep.id, rep.view.model], rep.scrape_errors)
        yield errors
        pm = src.prefix_metrics()
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
        alarm.add_metric([], 1.0 if src.zero_hit_alarm(now) else 0.0)
        yield alarm
        q = GaugeMetricFamily("llmgw_admission_queue_length", "Requests waiting for capacity.", labels=["model"])
        for model, n in src.queue_lengths().items():
            q.add_metric([model], n)
        yield q
        w = GaugeMetricFamily("llmgw_queue_waiting", "Requests waiting for capacity, by priority band.",
                              labels=["model", "band"])
        for (model, band), n in sorted(src.queue_by_band().items()):
            w.add_metric([model, band], n)
        yield w
        d = CounterMetricFamily("llmgw_queue_displaced", "Waiting requests a full queue gave up (answered 429) "
                                "for a higher band's arrival or a fairer share, by the displaced one's band.",
                                labels=["band"])
        for band, n in sorted(src.queue_displaced().items()):
            d.add_metric([band], n)
        yield d


# Seconds of tier 2's /tokenize step per request (a cached prompt takes microseconds).
TOKENIZE_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class Tier2DecisionMetrics(Collector):
    """Tier 2 on the request path: llmgw_kv_decisions_total{outcome} (each committed decision of a
    kv_events model: decided by tier 2, or why tier 1 did), llmgw_kv_matched_blocks (the leading
    blocks the chosen replica held), llmgw_kv_tier_decisions_total{endpoint,tier} and
    llmgw_kv_tokenize_seconds (the tokenize step's time, cached prompts included)."""

    def __init__(self, stats: KvDecisionStats, wall: float) -> None:
        self.stats = stats
        self.tokenize = Hist(len(TOKENIZE_BUCKETS), wall)

    def observe_tokenize(self, seconds: float) -> None:
        h = self.tokenize
        h.counts[bisect_left(TOKENIZE_BUCKETS, seconds)] += 1
        h.sum += seconds

    def collect(self) -> Iterable[Metric]:
        st = self.stats
        c = CounterMetricFamily("llmgw_kv_decisions", "Decisions of kv_events models by tier 2's outcome: decided "
                                "(tier 2 voted), else why tier 1 decided.", labels=["outcome"])
        for outcome in KV_OUTCOMES:
            c.add_metric([outcome], float(st.outcomes[outcome]))
        yield c
        h = HistogramMetricFamily("llmgw_kv_matched_blocks", "Leading KV blocks of the request the chosen "
                                  "replica held (decisions with tier-2 hashes).")
        acc, buckets = 0, []
        for le, n in zip([str(b) for b in MATCHED_BUCKETS] + ["+Inf"], st.matched):
            acc += n
            buckets.append((le, float(acc)))
        h.add_metric([], buckets, float(st.matched_sum))
        yield h
        t = CounterMetricFamily("llmgw_kv_tier_decisions", "Decisions of kv_events models per chosen endpoint, "
                                "by the tier that decided (tier2: tier 2 voted; tier1: it fell back).",
                                labels=["endpoint", "tier"])
        for rid, (tier1, tier2) in list(st.by_replica.items()):
            t.add_metric([rid, "tier1"], float(tier1))
            t.add_metric([rid, "tier2"], float(tier2))
        yield t
        yield _hist_family("llmgw_kv_tokenize_seconds", "Time of tier 2's tokenize step per request.", [],
                           TOKENIZE_BUCKETS, {(): self.tokenize})
