"""The router's request counters: plain numbers the request path bumps, turned into Prometheus
families only at scrape time (``llmgw.daemon.router.metrics``).

prometheus_client's ``labels(...).inc()``/``observe()`` cost 2-3 µs each (a label lookup and a
lock per value), ~10 µs a request for the per-request series; a dict lookup and a bisect cost a
tenth of that. Every series is keyed by configured names (models, endpoints, strategies, outcome
words), never by request ids or users, so none grows without bound. Each request is counted
once, where it ends: the core calls :meth:`request_done` exactly once per request it answered.

Pure: ``wall`` (the series' creation time, Unix seconds) is injected."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable

from .types import Decision

__all__ = ["Hist", "RouterCounters", "LATENCY_BUCKETS", "DECIDE_BUCKETS"]

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
                   300.0, 600.0)
DECIDE_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3)


class Hist:
    """One histogram series: non-cumulative bucket counts (the last is +Inf) and the sum."""
    __slots__ = ("counts", "created", "sum")

    def __init__(self, n: int, created: float) -> None:
        self.counts = [0] * (n + 1)
        self.sum = 0.0
        self.created = created


class RouterCounters:
    """What the request path counts; each value is ``[count, created]`` or a :class:`Hist`."""

    def __init__(self, wall: Callable[[], float]) -> None:
        self._wall = wall
        self.requests: dict[tuple[str, str, int], list[float]] = {}  # (model, outcome, code)
        self.ttft: dict[tuple[str, ...], Hist] = {}
        self.latency: dict[tuple[str, ...], Hist] = {}
        self.decisions: dict[tuple[str, str, bool], list[float]] = {}  # (strategy, picker, picked)
        self.decide = Hist(len(DECIDE_BUCKETS), wall())
        self.upstream_errors: dict[tuple[str, str], list[float]] = {}  # (endpoint, kind)
        self.rejections: dict[tuple[str, str], list[float]] = {}  # (model, reason)
        self.poison: dict[tuple[str], list[float]] = {}  # (model,): requests 5xx on two replicas
        # The eval runner's requests per model (also in the tables above): [all, failed, ttft sum, with ttft],
        # so that what the clients sent can be told apart (the canary's tally).
        self.internal: dict[str, list[float]] = {}

    def _bump(self, table: dict, key: tuple) -> None:  # type: ignore[type-arg]
        c = table.get(key)
        if c is None:
            c = table[key] = [0, self._wall()]
        c[0] += 1

    def request_done(self, model: str, outcome: str, code: int, ttft: float | None,
                     latency: float | None) -> None:
        key = (model, outcome, code)
        c = self.requests.get(key)
        if c is None:
            c = self.requests[key] = [0, self._wall()]
        c[0] += 1
        if ttft is not None:
            h = self.ttft.get((model,))
            if h is None:
                h = self.ttft[(model,)] = Hist(len(LATENCY_BUCKETS), self._wall())
            h.counts[bisect_left(LATENCY_BUCKETS, ttft)] += 1
            h.sum += ttft
        if latency is not None:
            h = self.latency.get((model,))
            if h is None:
                h = self.latency[(model,)] = Hist(len(LATENCY_BUCKETS), self._wall())
            h.counts[bisect_left(LATENCY_BUCKETS, latency)] += 1
            h.sum += latency

    def internal_done(self, model: str, failed: bool, ttft: float | None) -> None:
        """An eval runner's request ended (besides its request_done)."""
        c = self.internal.get(model)
        if c is None:
            c = self.internal[model] = [0, 0, 0.0, 0]
        c[0] += 1
        c[1] += failed
        if ttft is not None:
            c[2] += ttft
            c[3] += 1

    def decision(self, d: Decision) -> None:
        key = (d.strategy, d.picker, bool(d.chosen))
        c = self.decisions.get(key)
        if c is None:
            c = self.decisions[key] = [0, self._wall()]
        c[0] += 1
        h = self.decide
        s = d.decide_us / 1e6
        h.counts[bisect_left(DECIDE_BUCKETS, s)] += 1
        h.sum += s

    def upstream_error(self, endpoint: str, kind: str) -> None:
        self._bump(self.upstream_errors, (endpoint, kind))

    def rejected(self, model: str, reason: str) -> None:
        self._bump(self.rejections, (model, reason))

    def poisoned(self, model: str) -> None:
        self._bump(self.poison, (model,))

    def client_counts(self, model: str) -> tuple[int, int, float, int]:
        """`model`'s client requests so far (the eval runner's left out): (all, failed — 5xx and
        the router's own failures —, the sum of their times to the first byte in s, how many have one)."""
        total = failed = 0
        for (m, outcome, code), (n, _) in self.requests.items():
            if m == model:
                total += n
                if outcome != "ok" and (code >= 500 or outcome == "failed"):
                    failed += n
        h = self.ttft.get((model,))
        evals = self.internal.get(model, [0, 0, 0.0, 0])
        return (total - int(evals[0]), failed - int(evals[1]), (h.sum if h is not None else 0.0) - evals[2],
                (sum(h.counts) if h is not None else 0) - int(evals[3]))
