"""Windowed cache-hit counters per replica (and so per model): what the admin API's cache summary
and the console's sparklines show.

Two views of one question, "are requests landing where their prefix is cached?":

- prefix decisions: the router sent a request to a replica that held its prefix (the prefix
  scorer's outcome "hit") or not (any other outcome), counted per decision;
- the engines' own prefix-cache hit rate: the deltas between scrapes of the cumulative
  ``prefix_hits_total`` / ``prefix_queries_total`` (tokens; llmgw/route/contract.py).

Counts go into fixed buckets (10 s by default) of a window (300 s); older buckets are dropped as
new ones open. Recording costs a dict lookup and an add (a bucket roll every 10 s); the window's
sums are computed when asked. Time is the caller's monotonic clock. Pure: no I/O, no trio.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

__all__ = ["CacheStats"]

_HITS, _MISSES, _ENGINE_HITS, _ENGINE_QUERIES = range(4)


class _Series:
    """One replica's buckets: the open one (``cur``) and the closed ones still in the window."""

    __slots__ = ("cur", "done", "idx", "last_hits", "last_queries", "model")

    def __init__(self, model: str, idx: int) -> None:
        self.model = model
        self.idx = idx  # the open bucket's index (time // bucket_s)
        self.cur: list[float] = [0, 0, 0.0, 0.0]
        self.done: deque[tuple[int, list[float]]] = deque()
        self.last_hits: float | None = None  # the engine's totals at the last scrape
        self.last_queries: float | None = None

    def roll(self, idx: int, keep: int) -> list[float]:
        if idx > self.idx:
            if any(self.cur):
                self.done.append((self.idx, self.cur))
            self.idx, self.cur = idx, [0, 0, 0.0, 0.0]
            done = self.done
            while done and done[0][0] <= idx - keep:
                done.popleft()
        return self.cur  # a clock that went back counts into the open bucket


class CacheStats:
    def __init__(self, window_s: float = 300.0, bucket_s: float = 10.0) -> None:
        if not (bucket_s > 0 and window_s >= bucket_s):
            raise ValueError("need bucket_s > 0 and window_s >= bucket_s")
        self.bucket_s = bucket_s
        self.buckets = math.ceil(window_s / bucket_s)
        self._series: dict[str, _Series] = {}

    @property
    def window_s(self) -> float:
        return self.buckets * self.bucket_s

    def _get(self, model: str, replica: str, idx: int) -> _Series:
        s = self._series.get(replica)
        if s is None or s.model != model:
            s = self._series[replica] = _Series(model, idx)
        return s

    # -- recording (the router's hot path, the scrape loop) -------------------------------------------
    def decision(self, model: str, replica: str, hit: bool, now: float) -> None:
        """A prefix decision sent a request of ``model`` to ``replica``; ``hit``: it held the prefix."""
        idx = int(now // self.bucket_s)
        s = self._series.get(replica)
        if s is None or s.model != model:
            s = self._get(model, replica, idx)
        c = s.cur if s.idx == idx else s.roll(idx, self.buckets)
        c[_HITS if hit else _MISSES] += 1

    def engine(self, model: str, replica: str, hits_total: float, queries_total: float, now: float) -> None:
        """The engine's cumulative prefix-cache counters as just scraped. The first sight is only a
        baseline; a counter that went down means the engine restarted, and counts from zero again."""
        idx = int(now // self.bucket_s)
        s = self._get(model, replica, idx)
        c = s.roll(idx, self.buckets)
        last_h, last_q = s.last_hits, s.last_queries
        s.last_hits, s.last_queries = hits_total, queries_total
        if last_h is None or last_q is None:
            return
        dh, dq = hits_total - last_h, queries_total - last_q
        if dh < 0 or dq < 0:
            dh, dq = hits_total, queries_total
        c[_ENGINE_HITS] += dh
        c[_ENGINE_QUERIES] += dq

    def forget(self, replica: str) -> None:
        self._series.pop(replica, None)

    # -- reading --------------------------------------------------------------------------------------
    def summary(self, now: float, window_s: float | None = None) -> dict[str, Any]:
        """Counts over the last ``window_s`` (whole buckets, the open one included; at most the
        configured window): totals, per model, per replica, each with per-bucket rate series."""
        n = self.buckets if window_s is None else max(1, min(self.buckets, math.ceil(window_s / self.bucket_s)))
        cur = int(now // self.bucket_s)
        first = cur - n + 1
        total = _zeros(n)
        models: dict[str, list[list[float]]] = {}
        replicas: list[dict[str, Any]] = []
        for rid in sorted(self._series):
            s = self._series[rid]
            if s.idx <= cur - self.buckets:  # silent for a whole window: gone
                del self._series[rid]
                continue
            vec = _zeros(n)
            for idx, counts in (*s.done, (s.idx, s.cur)):
                if first <= idx <= cur:
                    _add(vec[idx - first], counts)
            m = models.setdefault(s.model, _zeros(n))
            for i, counts in enumerate(vec):
                _add(m[i], counts)
                _add(total[i], counts)
            replicas.append({**_counts(vec), "replica": rid, "model": s.model})
        return {"window_s": n * self.bucket_s, "bucket_s": self.bucket_s, "total": _counts(total),
                "models": [{**_counts(v), "model": name} for name, v in sorted(models.items())],
                "replicas": replicas}


def _zeros(n: int) -> list[list[float]]:
    return [[0, 0, 0.0, 0.0] for _ in range(n)]


def _add(into: list[float], counts: list[float]) -> None:
    for k in range(4):
        into[k] += counts[k]


def _rate(hits: float, of: float) -> float | None:
    return hits / of if of > 0 else None


def _counts(vec: list[list[float]]) -> dict[str, Any]:
    h = sum(int(b[_HITS]) for b in vec)
    m = sum(int(b[_MISSES]) for b in vec)
    eh = sum(b[_ENGINE_HITS] for b in vec)
    eq = sum(b[_ENGINE_QUERIES] for b in vec)
    return {"prefix_hits": h, "prefix_misses": m, "prefix_hit_rate": _rate(h, h + m),
            "engine_hit_tokens": eh, "engine_query_tokens": eq, "engine_hit_rate": _rate(eh, eq),
            "prefix_hit_rate_series": [_rate(b[_HITS], b[_HITS] + b[_MISSES]) for b in vec],
            "engine_hit_rate_series": [_rate(b[_ENGINE_HITS], b[_ENGINE_QUERIES]) for b in vec]}
