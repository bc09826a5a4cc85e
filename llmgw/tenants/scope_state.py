"""One quota scope's state on one router (pure; :mod:`.limits` drives it): a tenant's or a key's
token buckets (requests and tokens per minute), its requests in flight, its token budgets' local
use, and its recent demand.

A bucket of a per-minute limit ``L`` with this router's share ``s`` holds ``C = L·s`` and refills
at ``C/60`` per second, starting full. A charge of ``c`` is let through when the bucket holds at
least ``min(c, C)`` — so a request costlier than this router's part of the limit (but not than
the limit itself) goes when the bucket is full — and may leave it below zero (debt, paid back by
the refill). Hence in any window of ``T`` seconds the charges let through sum to at most
``C + C·T/60 + max(0, c_max − C)``: what the bucket held, what flowed in, and the one charge that
may overdraw it (0 for requests when ``C ≥ 1``). A change of ``C`` (a new share or limit) moves
the level by the change: what was used stays used, so the routers' shares moving between them
neither creates nor loses room."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .model import Quota

__all__ = ["Scope", "ScopeState", "DEMAND_TAU_S", "reset_text"]

Scope = tuple[str, str]  # ("tenant", name) or ("key", id)
DEMAND_TAU_S = 30.0  # the demand EWMA's time constant
_EPS = 1e-9


def reset_text(seconds: float) -> str:
    """A duration as OpenAI's x-ratelimit-reset-* headers write it: ``20ms``, ``1.5s``, ``6m0s``."""
    if seconds <= 0:
        return "0s"
    if seconds < 1:
        return f"{math.ceil(seconds * 1000 - _EPS)}ms"
    if seconds < 60:
        return f"{math.ceil(seconds * 1000 - _EPS) / 1000:g}s"
    s = math.ceil(seconds - _EPS)
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m}m{s}s" if h else f"{m}m{s}s"


@dataclass(slots=True)
class Bucket:
    """A token bucket of a per-minute limit; ``t`` None: full (never used). ``cap`` is the
    capacity it was last refilled at: when the capacity changes (a new share, a new limit) the
    level moves by the change, so what was used in the last minute stays used."""
    level: float = 0.0
    t: float | None = None
    cap: float = 0.0

    def _at(self, capacity: float, now: float) -> float:
        if self.t is None:
            return capacity
        level = min(self.cap, self.level + max(0.0, now - self.t) * self.cap / 60.0)
        return level + (capacity - self.cap)

    def refill(self, capacity: float, now: float) -> float:
        t = self.t
        if t is None:
            level = capacity
            self.t = now
        else:
            cap = self.cap
            level = self.level
            if now > t:
                level += (now - t) * cap / 60.0
                self.t = now
            if level > cap:
                level = cap
            level += capacity - cap
        self.level = level
        self.cap = capacity
        return level

    def level_at(self, capacity: float, now: float) -> float:
        """The level at ``now`` without touching the bucket."""
        return self._at(capacity, now)

    def until(self, capacity: float, level: float, now: float) -> float:
        """Seconds from ``now`` until the bucket holds ``level`` (inf if it never will)."""
        have = self._at(capacity, now)
        if have >= level - _EPS:
            return 0.0
        if capacity <= 0:
            return math.inf
        return (level - have) * 60.0 / capacity


class ScopeState:
    """What a router keeps of one scope. ``share`` is this router's fraction of the per-minute
    limits and of the concurrency (1.0 alone)."""

    __slots__ = ("scope", "quota", "share", "rpm", "tpm", "inflight", "demand", "demand_t", "held", "local")

    def __init__(self, scope: Scope, quota: Quota, share: float = 1.0) -> None:
        self.scope = scope
        self.quota = quota
        self.share = share
        self.rpm = Bucket()
        self.tpm = Bucket()
        self.inflight = 0
        self.demand = 0.0  # requests per second asked, an EWMA (admitted and refused alike)
        self.demand_t = 0.0
        # period -> tokens this router holds against the budget beyond the store's figure: charged
        # by grants not settled yet + settled here and not yet counted by the store (local)
        self.held: dict[str, int] = {}
        self.local: dict[str, dict[int, int]] = {}  # period -> settle second -> tokens settled here

    # ------------------------------------------------------------------------------ limits
    def capacity(self, limit: int) -> float:
        return limit * self.share

    def concurrency_cap(self) -> int:
        """This router's part of the concurrency limit: all of it alone, else ⌊L·share⌋ but at least
        1 (a limit of 0 stays 0: nothing goes)."""
        limit = self.quota.concurrency
        assert limit is not None
        if limit == 0 or self.share >= 1.0:
            return limit
        return max(1, math.floor(limit * self.share + _EPS))

    def set_quota(self, quota: Quota) -> None:
        """New limits: a limit newly set starts full; a changed one keeps what was used (the
        level moves with the capacity at the next refill)."""
        if quota.rpm is not None and self.quota.rpm is None:
            self.rpm = Bucket()
        if quota.tpm is not None and self.quota.tpm is None:
            self.tpm = Bucket()
        self.quota = quota

    # ------------------------------------------------------------------------------ demand
    def asked(self, now: float) -> None:
        """One request asked (admitted or not): the demand EWMA moves."""
        dt = now - self.demand_t
        self.demand = (self.demand * math.exp(-dt / DEMAND_TAU_S) if dt > 0 else self.demand) + 1.0 / DEMAND_TAU_S
        self.demand_t = max(self.demand_t, now)

    def demand_at(self, now: float) -> float:
        """Requests per minute asked lately, as of ``now``."""
        dt = now - self.demand_t
        return 60.0 * (self.demand * math.exp(-dt / DEMAND_TAU_S) if dt > 0 else self.demand)

    # ------------------------------------------------------------------------------ budgets
    def used_here(self, period: str) -> int:
        """Tokens this router holds against a budget period beyond the store's figure: grants in
        flight and settled use not yet in the store."""
        return self.held.get(period, 0)

    def reserve(self, period: str, tokens: int) -> None:
        self.held[period] = self.held.get(period, 0) + tokens

    def unreserve(self, period: str, tokens: int) -> None:
        left = self.held.get(period, 0) - tokens
        if left > 0:
            self.held[period] = left
        else:
            self.held.pop(period, None)

    def add_local(self, period: str, second: int, tokens: int) -> None:
        by_second = self.local.get(period)
        if by_second is None:
            by_second = self.local[period] = {}
        by_second[second] = by_second.get(second, 0) + tokens
        self.held[period] = self.held.get(period, 0) + tokens

    def forget_local(self, as_of: float | None, current: tuple[str, ...]) -> None:
        """The store's figure now counts what was settled before ``as_of`` (all when None): those
        local entries go (a second that ``as_of`` cuts stays: counted twice rather than not at
        all); periods other than ``current`` go whole."""
        for period in list(self.local):
            by_second = self.local[period]
            whole = as_of is None or period not in current
            gone = [sec for sec in by_second if whole or sec + 1 <= as_of]  # type: ignore[operator]
            for sec in gone:
                self.unreserve(period, by_second.pop(sec))
            if not by_second:
                del self.local[period]

    def idle(self) -> bool:
        """Nothing in flight (so no budget hold either: a grant is settled before it is released):
        the state may be dropped."""
        return self.inflight == 0
