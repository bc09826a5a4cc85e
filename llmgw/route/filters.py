"""The scheduler's filters: which endpoints may take a request at all.

Each filter returns a :class:`FilterResult` (the kept endpoints, a drop with a reason for every
endpoint it removed, and an optional note for the decision). Fast path: when nothing is dropped
the input sequence itself is returned, so the common case allocates nothing but one list scan.

:func:`is_saturated` / :func:`pool_saturated` are public so that admission measures saturation
exactly as pool spill-over does (one definition, never two that drift apart).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from .types import EndpointView, FilterDrop, RequestInfo, SchedulerConfig

__all__ = [
    "FilterResult", "NO_DROPS", "load_estimate", "loads_of", "is_saturated", "room", "pool_saturated",
    "serves", "healthy", "pool_priority", "ALL_OPEN_NOTE",
]

ALL_OPEN_NOTE = "all breakers open: probing each open replica early"
NO_DROPS: tuple[FilterDrop, ...] = ()


class FilterResult(NamedTuple):
    kept: Sequence[EndpointView]
    drops: Sequence[FilterDrop] = NO_DROPS
    note: str = ""


# --------------------------------------------------------------------------- load and saturation

def load_estimate(e: EndpointView) -> float:
    """Requests on the replica: running + waiting from the last scrape, plus what *we* started
    since that scrape (so a burst between scrapes is counted). Stale or missing scrape: our own
    live inflight, the only number we still trust."""
    if e.stale:
        return float(e.inflight)
    r = e.running
    w = e.waiting
    if r is None and w is None:
        return float(e.inflight)
    d = e.inflight - e.inflight_at_scrape
    if d < 0:  # requests finished since the scrape are already gone from running/waiting
        d = 0
    return (r or 0.0) + (w or 0.0) + d


def loads_of(endpoints: Sequence[EndpointView]) -> list[float]:
    """:func:`load_estimate` for many endpoints (inlined: this is the hottest loop per decision)."""
    out: list[float] = []
    ap = out.append
    for e in endpoints:
        if e.stale:
            ap(float(e.inflight))
            continue
        r = e.running
        w = e.waiting
        d = e.inflight - e.inflight_at_scrape
        if d < 0:
            d = 0
        if r is None:
            ap(float(e.inflight) if w is None else w + d)
        else:
            ap(r + d if w is None else r + w + d)
    return out


def is_saturated(e: EndpointView, cfg: SchedulerConfig) -> bool:
    """A replica is saturated at its admission cap; without a cap, when its load estimate reaches
    ``cfg.saturation_load`` (None = uncapped replicas never count as saturated)."""
    if e.max_inflight is not None:
        return e.inflight >= e.max_inflight
    limit = cfg.saturation_load
    return limit is not None and load_estimate(e) >= limit


def room(e: EndpointView, cfg: SchedulerConfig) -> float:
    """How many more requests the replica takes before :func:`is_saturated` says it is full (0 when
    it is; ``inf`` when nothing bounds it). Admission lets this many waiters try after a scrape."""
    if e.max_inflight is not None:
        return float(max(0, e.max_inflight - e.inflight))
    limit = cfg.saturation_load
    if limit is None:
        return float("inf")
    free = limit - load_estimate(e)
    return float(max(0, math.ceil(free)))


def pool_saturated(endpoints: Iterable[EndpointView], cfg: SchedulerConfig) -> bool:
    """A pool is saturated when every one of its endpoints is (an empty pool has no room)."""
    return all(is_saturated(e, cfg) for e in endpoints)


# --------------------------------------------------------------------------- filters

def serves(req: RequestInfo, endpoints: Sequence[EndpointView]) -> FilterResult:
    """Keep endpoints serving the request's base model and, if one is asked for, its adapter."""
    base = req.base_model
    adapter = req.adapter
    if adapter is None:
        kept = [e for e in endpoints if e.model == base]
    else:
        kept = [e for e in endpoints if e.model == base and adapter in e.adapters]
    if len(kept) == len(endpoints):
        return FilterResult(endpoints)
    drops = [
        FilterDrop("serves", e.id, f"serves model {e.model!r}, not {base!r}") if e.model != base
        else FilterDrop("serves", e.id, f"adapter {adapter!r} not loaded")
        for e in endpoints if e.model != base or (adapter is not None and adapter not in e.adapters)
    ]
    return FilterResult(kept, drops)


def healthy(endpoints: Sequence[EndpointView], now: float) -> FilterResult:
    """Drop endpoints whose breaker refuses traffic. If that would drop them all, fail open: keep
    every replica whose breaker is open (the core probes it early, before its cooldown ends,
    within its own probe limit), so recovery admits probes in proportion to the replicas — not
    one at a time on the replica closest to recovery while every other request is turned away.
    When every breaker is half-open with its probe slots taken, all are kept and the request
    waits in the admission queue for a slot. A model must never answer "no deployments" for
    good because every breaker tripped at once (a burst of poison requests, a network blip)."""
    kept = [e for e in endpoints if e.available]
    if len(kept) == len(endpoints):
        return FilterResult(endpoints)
    if not kept and endpoints:
        kept = [e for e in endpoints if e.breaker_state == "open"] or list(endpoints)
        ids = {e.id for e in kept}
        drops = [FilterDrop("healthy", e.id, _breaker_reason(e, now)) for e in endpoints if e.id not in ids]
        return FilterResult(kept, drops, ALL_OPEN_NOTE)
    drops = [FilterDrop("healthy", e.id, _breaker_reason(e, now)) for e in endpoints if not e.available]
    return FilterResult(kept, drops)


def _breaker_reason(e: EndpointView, now: float) -> str:
    if e.retry_at is None:
        return f"breaker {e.breaker_state}"
    return f"breaker {e.breaker_state}, retry in {max(0.0, e.retry_at - now):.1f}s"


def pool_priority(endpoints: Sequence[EndpointView], cfg: SchedulerConfig) -> FilterResult:
    """Keep the most preferred pool (lowest priority number) that is not saturated; when every
    pool is saturated keep the preferred one (queueing there beats spilling to the last resort).
    Pools with equal priority form one group."""
    if len({e.pool_priority for e in endpoints}) <= 1:
        return FilterResult(endpoints)
    groups: dict[int, list[EndpointView]] = {}
    for e in endpoints:
        groups.setdefault(e.pool_priority, []).append(e)
    order = sorted(groups)
    chosen = next((p for p in order if not pool_saturated(groups[p], cfg)), None)
    if chosen is None:
        chosen, note = order[0], "all pools saturated: keeping the preferred pool"
    elif chosen != order[0]:
        note = f"preferred pool saturated: spilled to priority {chosen}"
    else:
        note = ""
    drops: list[FilterDrop] = []
    for p in order:
        if p == chosen:
            continue
        if p < chosen:
            why = "saturated"
        elif note and chosen == order[0]:
            why = "all pools saturated, the preferred one is kept"
        else:
            why = f"priority {chosen} has room"
        reasons: dict[str, str] = {}  # one string per pool, not per endpoint
        for e in groups[p]:
            r = reasons.get(e.pool)
            if r is None:
                r = reasons[e.pool] = f"pool {e.pool!r} (priority {p}): {why}"
            drops.append(FilterDrop("pool", e.id, r))
    return FilterResult(groups[chosen], drops, note)
