"""What the autoscaler (llmgw.fleet.autoscale) reads: one model's load at one moment, and the
arithmetic over a window of those.

- :class:`RouterLoad` is one router's figures for one model; the routers write theirs to the store
  (``to_wire``/``from_wire``, plain JSON types). :func:`merge` sums every router's into a
  :class:`Sample`, with the replica counts the control plane knows.
- ``ttft`` is a histogram of times to first token: one count per bucket of :data:`TTFT_BUCKETS`
  (each bucket's own count, as the router's ``Hist`` keeps them, *not* Prometheus' cumulative
  ``le`` counts), the last one +Inf; each count grows over time (since the router started). ``()``
  means no TTFT yet. ``arrivals`` grows over time too. A counter that goes back (a router
  restarted or left the merge) counts as no change, step by step: never as negative load.
- The window functions take samples in time order and return plain numbers (None: nothing to
  measure).

Pure: no clock (times come in the samples), no I/O."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["TTFT_BUCKETS", "RouterLoad", "Sample", "merge", "concurrency", "mean", "slope", "arrival_rate",
           "ttft_counts", "quantile"]

# The router's TTFT buckets (llmgw.route.counters.LATENCY_BUCKETS, seconds). Not imported from there:
# llmgw/route imports llmgw/fleet, so the reverse would be a folder cycle (tests/test_import_contract.py);
# tests/test_autoscale.py checks the two stay equal.
TTFT_BUCKETS: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                                   120.0, 300.0, 600.0)
N_TTFT = len(TTFT_BUCKETS) + 1  # with +Inf


@dataclass(frozen=True)
class RouterLoad:
    """One router's figures for one model (see the module docstring for the counters)."""
    inflight: int = 0  # requests in flight (sent to a replica, not finished)
    queued: int = 0  # waiting in admission, cold waiters included
    cold_waiting: int = 0  # of those, waiting because the model has no replica at all
    arrivals: int = 0  # client requests for the model since the router started
    engine_waiting: float = 0.0  # the engines' own waiting queues, summed (scraped)
    kv_usage: float | None = None  # mean KV cache use of the ready replicas, 0–1 (None: unknown)
    ttft: tuple[int, ...] = ()  # TTFT histogram, per bucket of TTFT_BUCKETS, +Inf last

    def to_wire(self) -> dict[str, object]:
        return {"inflight": self.inflight, "queued": self.queued, "cold_waiting": self.cold_waiting,
                "arrivals": self.arrivals, "engine_waiting": self.engine_waiting, "kv_usage": self.kv_usage,
                "ttft": list(self.ttft)}

    @classmethod
    def from_wire(cls, doc: object) -> RouterLoad:
        """The inverse of :meth:`to_wire`. Missing keys take their defaults and unknown keys are
        ignored (a router of another version); a wrong type or value raises ValueError naming the key."""
        if not isinstance(doc, dict):
            raise ValueError(f"router load: expected an object, got {type(doc).__name__}")
        ints = {k: _count(doc, k) for k in ("inflight", "queued", "cold_waiting", "arrivals")}
        engine_waiting = _number(doc, "engine_waiting", 0.0)
        kv = doc.get("kv_usage")
        if kv is not None:
            kv = _number(doc, "kv_usage", 0.0)
            if kv > 1.0 + 1e-6:
                raise ValueError(f"router load: kv_usage must be within 0–1, got {kv!r}")
            kv = min(kv, 1.0)  # a mean of fractions may round past 1
        ttft = doc.get("ttft", [])
        if not isinstance(ttft, list | tuple) or len(ttft) > N_TTFT:
            raise ValueError(f"router load: ttft must be a list of at most {N_TTFT} counts")
        counts = tuple(_count({"ttft": x}, "ttft") for x in ttft)
        return cls(**ints, engine_waiting=engine_waiting, kv_usage=kv, ttft=counts)


def _count(doc: dict, key: str) -> int:  # type: ignore[type-arg]
    v = doc.get(key, 0)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"router load: {key} must be a count (an integer ≥ 0), got {v!r}")
    return v


def _number(doc: dict, key: str, default: float) -> float:  # type: ignore[type-arg]
    v = doc.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
        raise ValueError(f"router load: {key} must be a finite number ≥ 0, got {v!r}")
    return float(v)


@dataclass(frozen=True)
class Sample:
    """One model's load at one moment, every router merged (see :func:`merge`)."""
    t: float  # the plane's monotonic seconds
    ready: int  # replicas in routing, not draining
    starting: int  # placed and meant to run, not ready yet
    inflight: int = 0
    queued: int = 0  # cold waiters included
    cold_waiting: int = 0
    arrivals: int = 0  # cumulative (monotone but for restarts)
    engine_waiting: float = 0.0
    kv_usage: float | None = None
    ttft: tuple[int, ...] = ()


def merge(t: float, parts: Sequence[RouterLoad], ready: int, starting: int) -> Sample:
    """Every router's figures for one model as one sample: in flight, queued, cold waiters,
    arrivals and the TTFT histogram are summed; the engines' waiting queue and KV use are the
    engines' own (each router scrapes the same engines): the largest any router reports."""
    ttft: tuple[int, ...] = ()
    if any(p.ttft for p in parts):
        sums = [0] * N_TTFT
        for p in parts:
            for i, n in enumerate(p.ttft[:N_TTFT]):
                sums[i] += n
        ttft = tuple(sums)
    kvs = [p.kv_usage for p in parts if p.kv_usage is not None]
    return Sample(t=t, ready=ready, starting=starting, inflight=sum(p.inflight for p in parts),
                  queued=sum(p.queued for p in parts), cold_waiting=sum(p.cold_waiting for p in parts),
                  arrivals=sum(p.arrivals for p in parts),
                  engine_waiting=max((p.engine_waiting for p in parts), default=0.0),
                  kv_usage=max(kvs) if kvs else None, ttft=ttft)


# -- window arithmetic ------------------------------------------------------------------------------------
def concurrency(s: Sample) -> int:
    """C: requests in flight or waiting at the routers."""
    return s.inflight + s.queued


def mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def slope(points: Sequence[tuple[float, float]]) -> float:
    """The least-squares slope of y over t (per second); 0 with fewer than two distinct times."""
    n = len(points)
    if n < 2:
        return 0.0
    mt = sum(t for t, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    if var <= 1e-12:
        return 0.0
    return sum((t - mt) * (y - my) for t, y in points) / var


def line_at(points: Sequence[tuple[float, float]], at: float) -> float | None:
    """The least-squares line of y over t, read at ``at`` (None without points): the level now of a
    noisy series, smoothed over all of it."""
    if not points:
        return None
    n = len(points)
    mt = sum(t for t, _ in points) / n
    my = sum(y for _, y in points) / n
    return my + slope(points) * (at - mt)


def _steps(samples: Sequence[Sample], get: Callable[[Sample], float]) -> float:
    """A counter's growth over the samples, step by step; a step back (a restart) counts as 0."""
    return sum(max(0.0, get(b) - get(a)) for a, b in zip(samples, samples[1:]))


def arrival_rate(samples: Sequence[Sample]) -> float | None:
    """Client requests a second over the samples (None: fewer than two, or no time between them)."""
    if len(samples) < 2 or samples[-1].t <= samples[0].t:
        return None
    return _steps(samples, lambda s: s.arrivals) / (samples[-1].t - samples[0].t)


def ttft_counts(samples: Sequence[Sample]) -> list[int]:
    """The TTFT histogram of what happened over the samples (per bucket, step by step, each step of
    each bucket clamped at 0)."""
    out = [0] * N_TTFT
    for a, b in zip(samples, samples[1:]):
        if not b.ttft:
            continue
        for i in range(min(len(b.ttft), N_TTFT)):
            before = a.ttft[i] if i < len(a.ttft) else 0
            out[i] += max(0, b.ttft[i] - before)
    return out


def quantile(counts: Sequence[int], q: float, bounds: Sequence[float] = TTFT_BUCKETS) -> float | None:
    """The q-quantile of a per-bucket histogram, interpolated linearly inside its bucket (from 0 for
    the first); in the +Inf bucket, the last finite bound (as Prometheus' histogram_quantile).
    None when the histogram is empty."""
    total = sum(counts)
    if total <= 0:
        return None
    rank = q * total
    seen = 0
    for i, n in enumerate(counts):
        if n > 0 and seen + n >= rank:
            if i >= len(bounds):
                return float(bounds[-1])
            lower = bounds[i - 1] if i > 0 else 0.0
            return lower + (bounds[i] - lower) * max(0.0, rank - seen) / n
        seen += n
    return float(bounds[-1])
