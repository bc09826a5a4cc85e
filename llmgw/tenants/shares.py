"""Quotas across several routers (pure): each router's share of a scope's per-minute limits and
concurrency, from every live router's recent demand.

Routers on one shared store do not ask each other per request: each enforces a part of every
limit locally (:class:`~.limits.Limiter`, ``set_shares``) and, every ``[tenants] share_sync_s``,
writes its demand per scope (:meth:`~.limits.Limiter.demand`: requests per minute asked, an EWMA
over ~30 s) to the store, reads the others', and takes

    share = max(floor, my demand / the live routers' total demand),   floor = 1 / (4N)

with N the live routers (this one counted). A router nobody asks keeps the floor, so its first
request does not wait for a sync; with no demand anywhere each takes 1/N.

**The bound.** When the routers read the same demands, the shares of a scope sum to

    S = Σ share  ≤  1 + (N − 1) / (4N)   (< 1.25; 1 for N = 1, 1.125 for N = 2)

— exactly 1 when no router is below the floor (equal demand gives each 1/N), and at most N − 1
routers can be below it, each raised by at most the floor. A per-minute limit ``L`` is then
enforced as buckets of ``C_i = L·share_i`` that refill over a minute (:mod:`.scope_state`): over
any window of T seconds in which the shares hold, the routers together let through at most

    L·S·(1 + T/60) + Σ_i max(0, c − C_i)

where c is the largest single charge (1 for requests) — the full buckets, their refill, and one
overdraft per router; with shares moving inside the window, at most Σ_i max(C_i, c) + T/60 · ΣC
with each term's largest value over the window (at worst N·L + L·S·T/60: a bucket is refilled at
its old part up to a change and keeps what was used, so moving shares create no room). The
long-run rate is at most ``L·S`` per minute. Concurrency: each router allows ⌊L·share⌋ but at
least 1, so at most ``L·S + N`` at once. docs/tenants.md, "Quotas across several routers", has
the measured figures. Budgets are not shared this way; see :meth:`~.limits.Limiter.set_spent`."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from .model import TenantError

__all__ = ["floor_share", "scope_key", "scope_of", "share_bound", "shares"]

Scope = tuple[str, str]


def floor_share(n: int) -> float:
    """The least share of a router among ``n`` live ones: 1/(4n)."""
    return 1.0 / (4 * max(1, n))


def share_bound(n: int) -> float:
    """The most the shares of a scope sum to over ``n`` routers with the same view: 1 + (n−1)/(4n)."""
    n = max(1, n)
    return 1.0 + (n - 1) / (4 * n)


def _demand(v: object) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        return 0.0
    return float(v)


def shares(limits_scopes: Iterable[Scope], me: str, demands: Mapping[str, Mapping[Scope, float]],
           live: Iterable[str]) -> dict[Scope, float]:
    """This router's fraction of each scope in ``limits_scopes`` (the scopes with a per-minute
    limit or a concurrency limit): proportional to its demand among the ``live`` routers'
    (``demands``: router → scope → requests per minute; routers not live are ignored, a missing
    or bad figure is 0), never below 1/(4N); 1/N when nobody asked; 1.0 alone."""
    routers = set(live)
    routers.add(me)
    n = len(routers)
    if n == 1:
        return {s: 1.0 for s in limits_scopes}
    floor = floor_share(n)
    mine = demands.get(me, {})
    others = [demands[r] for r in routers if r != me and r in demands]
    out: dict[Scope, float] = {}
    for s in limits_scopes:
        d = _demand(mine.get(s))
        total = d + sum(_demand(o.get(s)) for o in others)
        out[s] = 1.0 / n if total <= 0 else min(1.0, max(floor, d / total))
    return out


def scope_key(scope: Scope) -> str:
    """A scope as the store keeps it: ``tenant:NAME`` or ``key:ID``."""
    return f"{scope[0]}:{scope[1]}"


def scope_of(key: str) -> Scope:
    """The scope of a store key (:func:`scope_key`'s inverse); :class:`TenantError` if malformed."""
    kind, sep, name = key.partition(":") if isinstance(key, str) else ("", "", "")
    if not sep or kind not in ("tenant", "key") or not name:
        raise TenantError("scope", f"must be tenant:NAME or key:ID; got {str(key)[:100]!r}")
    return kind, name
