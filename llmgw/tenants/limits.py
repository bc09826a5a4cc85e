"""Quotas (pure): what a router lets through per tenant and per key, and what it refuses with 429.

Each request is checked against two scopes, ``("tenant", name)`` and ``("key", id)`` — each one
that has a limit; both must pass. Per scope:

- **requests and tokens per minute**: token buckets (:mod:`.scope_state`) of ``limit × share``,
  refilled over a minute. A request costs 1 request and ``cost`` tokens — the prompt's estimate
  plus ``max_tokens``, charged up front; :meth:`Limiter.settle` corrects the tokens by what the
  usage says (actual − charged; the bucket may go into debt);
- **concurrency**: requests in flight, given back by :meth:`Limiter.release`;
- **budgets**: tokens per UTC day and calendar month. Used = the store's figure for the period
  (every router's flushed use: :meth:`Limiter.set_spent`) + what this router settled since + what
  its grants in flight hold; a request goes when ``used + cost ≤ budget`` (so none once ``used ≥
  budget``). A request admitted before the budget ran out is settled in full, whatever it used.

All checks come first, then all charges: a refused request is charged nothing. Every check
counts towards the scope's **demand** (requests per minute asked, an EWMA over ~30 s), by which
several routers share the per-minute limits (:mod:`.shares`, :meth:`Limiter.set_shares`).

Time comes in: ``now`` (monotonic seconds, the buckets) and ``wall`` (Unix, the budgets' periods)."""

from __future__ import annotations

import math
from math import exp
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .book import Principal, TenantBook, iso_utc
from .model import Quota
from .scope_state import DEMAND_TAU_S, Scope, ScopeState, reset_text
from .usage import period_end, period_keys

__all__ = ["Grant", "Limiter", "QuotaRefused"]

_EPS = 1e-9
_IMPULSE = 1.0 / DEMAND_TAU_S  # one request's step in the demand EWMA (requests per second)
_WHAT = {"rpm": "requests per minute", "tpm": "tokens per minute", "concurrency": "concurrent requests",
         "day": "tokens per day", "month": "tokens per month"}


@dataclass(slots=True)
class Grant:
    """What :meth:`Limiter.admit` gave; settle and release take it back, each once."""
    principal: Principal
    charged: int  # tokens charged up front
    settled: bool = False
    released: bool = False
    states: tuple[ScopeState, ...] = ()  # the scopes it was charged in
    holds: tuple[tuple[ScopeState, str, int], ...] = ()  # budget reservations: (scope, period, tokens)
    actual: int | None = None  # tokens settled


class QuotaRefused(Exception):
    """429: ``rate_limit_exceeded`` (rpm, tpm, concurrency) or ``insufficient_quota`` (budgets).
    ``reason`` is the limit (rpm|tpm|concurrency|day|month), ``scope`` whose it is, ``type`` the
    error envelope's ("requests", "tokens" or "insufficient_quota"), ``retry_after`` whole seconds
    ≥ 1, ``headers`` the x-ratelimit-* headers as of the refusal."""

    status = 429

    def __init__(self, code: str, message: str, *, reason: str, scope: Scope, retry_after: int,
                 headers: list[tuple[str, str]]) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason
        self.scope = scope
        self.retry_after = retry_after
        self.headers = headers
        self.type = ("insufficient_quota" if code == "insufficient_quota"
                     else "tokens" if reason == "tpm" else "requests")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": None, "code": self.code}}


def _who(scope: Scope) -> str:
    return f"tenant `{scope[1]}`" if scope[0] == "tenant" else f"API key `{scope[1]}`"


def _limit_text(st: ScopeState, limit: int, local: float) -> str:
    """``60``, or with a share ``60 (this router's share: 20)``."""
    return str(limit) if st.share >= 1.0 else f"{limit} (this router's share: {math.floor(local + _EPS)})"


def _retry(seconds: float, cap: int = 86400) -> int:
    if not math.isfinite(seconds):
        return 60
    return max(1, min(cap, math.ceil(seconds - _EPS)))


@dataclass(slots=True)
class _Periods:
    day: str = ""
    month: str = ""
    day_end: float = -math.inf
    month_end: float = -math.inf
    start: float = math.inf

    def at(self, wall: float) -> tuple[str, str]:
        if not (self.start <= wall < self.day_end):
            self.day, self.month = period_keys(wall)
            self.start = wall - (wall % 86400)
            self.day_end = period_end(self.day)
            self.month_end = period_end(self.month)
        return self.day, self.month


class Limiter:
    """A router's quotas: the state of every scope, kept across books."""

    def __init__(self) -> None:
        self._states: dict[Scope, ScopeState] = {}
        self._book_scopes: dict[Scope, Quota] = {}
        self._shares: dict[Scope, float] = {}
        self._spent: dict[tuple[str, str, str], int] = {}
        self._spent_of: dict[Scope, dict[str, int]] = {}  # the same by scope, then period
        self._periods = _Periods()
        self._now = 0.0
        self._wall = 0.0

    # ------------------------------------------------------------------------------ inputs
    def set_book(self, book: TenantBook) -> None:
        """The quotas of ``book``'s tenants and keys (the anonymous tenant's too). A scope's state
        (buckets, requests in flight, budget holds) is kept across books; a scope gone from the
        book is dropped once nothing is in flight."""
        scopes: dict[Scope, Quota] = {}
        for t in [*book.tenants().values(), book.anonymous.tenant]:
            if not t.quota.empty():
                scopes[("tenant", t.name)] = t.quota
        for k in book.keys().values():
            if not k.quota.empty():
                scopes[("key", k.id)] = k.quota
        self._book_scopes = scopes
        for scope, st in list(self._states.items()):
            q = scopes.get(scope)
            if q is not None:
                st.set_quota(q)
            elif st.idle():
                del self._states[scope]

    def set_shares(self, shares: Mapping[Scope, float], *, now: float | None = None) -> None:
        """This router's fraction (0, 1] of each scope's rpm, tpm and concurrency; missing: 1.0.
        The buckets are refilled up to ``now`` (monotonic; default the last time seen — pass it:
        an idle router's buckets must not refill at the old part for the time after the change)
        at their old part, then move with the change (what was used stays used)."""
        t = self._now if now is None else now
        self._shares = {s: min(1.0, max(0.0, float(v))) for s, v in shares.items()}
        for scope, st in self._states.items():
            share = self._shares.get(scope, 1.0)
            if share == st.share:
                continue
            q = st.quota
            for bucket, limit in ((st.rpm, q.rpm), (st.tpm, q.tpm)):
                if limit is not None and bucket.t is not None:
                    bucket.refill(limit * st.share, t)
            st.share = share

    def set_spent(self, spent: Mapping[tuple[str, str, str], int], *, as_of: float | None = None) -> None:
        """Budgets: the tokens the store counts per (kind, name, period) — every router's flushed
        use. This router's own settled use is forgotten as far as the store now counts it: all of
        it (``as_of`` None), or what was settled before ``as_of`` (wall time: the shell passes the
        time its last successful flush drained the usage book, so use settled since is not lost
        between a flush and the next read)."""
        if as_of is not None and as_of > self._wall:
            self._wall = as_of  # the budgets' periods of use() on a router not asked anything yet
        self._spent = dict(spent)
        self._spent_of = {}
        for (kind, name, period), tokens in self._spent.items():
            self._spent_of.setdefault((kind, name), {})[period] = tokens
        current = self._periods.at(self._wall) if self._wall else ()
        for st in self._states.values():
            if st.local:
                st.forget_local(as_of, current)

    # ------------------------------------------------------------------------------ a request
    def _state(self, scope: Scope, quota: Quota) -> ScopeState:
        st = self._states.get(scope)
        if st is None:
            st = self._states[scope] = ScopeState(scope, quota, self._shares.get(scope, 1.0))
        elif st.quota is not quota and st.quota != quota:
            st.set_quota(quota)
        return st

    def admit(self, p: Principal, cost: int, now: float, wall: float) -> Grant:
        """A :class:`Grant` for a request of ``cost`` tokens (prompt estimate + max_tokens), or
        :class:`QuotaRefused` — nothing charged then."""
        if not p.scopes:
            return Grant(p, cost)
        got = self._states.get
        states = []
        for scope, quota in p.scopes:
            st = got(scope)
            if st is None or st.quota is not quota:
                st = self._state(scope, quota)
            states.append(st)
        if now > self._now:
            self._now = now
        self._wall = wall
        day, month = self._periods.at(wall)
        for st in states:  # the demand (ScopeState.asked, inlined: the hot path)
            dt = now - st.demand_t
            if dt > 0:
                st.demand = st.demand * exp(-dt / DEMAND_TAU_S) + _IMPULSE
                st.demand_t = now
            else:
                st.demand += _IMPULSE
        for st in states:
            q = st.quota
            if q.tokens_per_day is not None:
                spent = self._spent_of.get(st.scope)
                used = (spent.get(day, 0) if spent else 0) + st.held.get(day, 0)
                if used >= q.tokens_per_day or used + cost > q.tokens_per_day:
                    raise self._refuse_budget(st, "day", q.tokens_per_day, day, used, cost, now, wall, states)
            if q.tokens_per_month is not None:
                spent = self._spent_of.get(st.scope)
                used = (spent.get(month, 0) if spent else 0) + st.held.get(month, 0)
                if used >= q.tokens_per_month or used + cost > q.tokens_per_month:
                    raise self._refuse_budget(st, "month", q.tokens_per_month, month, used, cost, now, wall, states)
            if q.concurrency is not None and st.inflight >= (q.concurrency if st.share >= 1.0
                                                             else st.concurrency_cap()):
                raise self._refuse_concurrency(st, now, states)
            if q.rpm is not None:
                cap = q.rpm * st.share
                if q.rpm == 0 or st.rpm.refill(cap, now) < min(1.0, cap) - _EPS:
                    raise self._refuse_rate(st, "rpm", q.rpm, 1, now, states)
            if q.tpm is not None:
                cap = q.tpm * st.share
                if q.tpm == 0 or cost > q.tpm or st.tpm.refill(cap, now) < min(cost, cap) - _EPS:
                    raise self._refuse_rate(st, "tpm", q.tpm, cost, now, states)
        holds = []
        for st in states:
            q = st.quota
            if q.rpm is not None:
                st.rpm.level -= 1
            if q.tpm is not None:
                st.tpm.level -= cost
            st.inflight += 1
            if q.tokens_per_day is not None:
                st.reserve(day, cost)
                holds.append((st, day, cost))
            if q.tokens_per_month is not None:
                st.reserve(month, cost)
                holds.append((st, month, cost))
        return Grant(p, cost, states=tuple(states), holds=tuple(holds))

    # ------------------------------------------------------------------------------ refusals
    def _refuse_budget(self, st: ScopeState, reason: str, budget: int, period: str, used: int, cost: int,
                       now: float, wall: float, states: list[ScopeState]) -> QuotaRefused:
        end = period_end(period)
        return QuotaRefused("insufficient_quota",
                            f"You exceeded your token budget for {_who(st.scope)} on {_WHAT[reason]}: limit {budget}, "
                            f"used {used}, requested {cost}. It renews at {iso_utc(end)}.",
                            reason=reason, scope=st.scope, retry_after=_retry(end - wall),
                            headers=self._headers(tuple(states), now))

    def _refuse_concurrency(self, st: ScopeState, now: float, states: list[ScopeState]) -> QuotaRefused:
        limit = st.quota.concurrency
        assert limit is not None
        return QuotaRefused("rate_limit_exceeded",
                            f"Too many concurrent requests for {_who(st.scope)}: limit "
                            f"{_limit_text(st, limit, st.concurrency_cap())}, in flight {st.inflight}. "
                            "Retry after 1 s.", reason="concurrency", scope=st.scope, retry_after=1,
                            headers=self._headers(tuple(states), now))

    def _refuse_rate(self, st: ScopeState, reason: str, limit: int, need: int, now: float,
                     states: list[ScopeState]) -> QuotaRefused:
        headers = self._headers(tuple(states), now)
        what = f"{_who(st.scope)} on {_WHAT[reason]}"
        if reason == "tpm" and 0 < limit < need:
            return QuotaRefused("rate_limit_exceeded",
                                f"Request too large for {what}: limit {limit}, requested {need} (the prompt and "
                                "max_tokens): max_tokens too large for tpm; lower max_tokens.",
                                reason=reason, scope=st.scope, retry_after=60, headers=headers)
        bucket = st.rpm if reason == "rpm" else st.tpm
        cap = st.capacity(limit)
        level = bucket.level_at(cap, now)
        retry = _retry(bucket.until(cap, min(need, cap), now) if limit else math.inf)
        used = max(0, math.ceil(cap - level - _EPS))
        extra = f", requested {need}" if reason == "tpm" else ""
        return QuotaRefused("rate_limit_exceeded",
                            f"Rate limit reached for {what}: limit {_limit_text(st, limit, cap)}, used {used}{extra}. "
                            f"Retry after {retry} s.", reason=reason, scope=st.scope, retry_after=retry,
                            headers=headers)

    def settle(self, g: Grant, actual_tokens: int, now: float, wall: float) -> None:
        """The request's real tokens (prompt + completion): the tpm buckets and budgets are
        corrected by actual − charged. Once; later calls do nothing."""
        if g.settled:
            return
        g.settled = True
        actual = max(0, int(actual_tokens))
        g.actual = actual
        if not g.states:
            return
        if now > self._now:
            self._now = now
        if wall > self._wall:
            self._wall = wall
        delta = actual - g.charged
        if delta:
            for st in g.states:
                tpm = st.quota.tpm
                if tpm is not None:
                    cap = tpm * st.share
                    level = st.tpm.refill(cap, now) - delta
                    st.tpm.level = cap if level > cap else level
        if not g.holds:
            return
        for st, period, tokens in g.holds:
            st.unreserve(period, tokens)
        day, month = self._periods.at(wall)
        second = int(wall)
        for st in g.states:
            q = st.quota
            if q.tokens_per_day is not None:
                st.add_local(day, second, actual)
            if q.tokens_per_month is not None:
                st.add_local(month, second, actual)

    def release(self, g: Grant) -> None:
        """The request's concurrency back. Once; a grant not settled yet is settled at its charge
        first (its budget hold must not outlive it)."""
        if g.released:
            return
        if not g.settled:
            self.settle(g, g.charged, self._now, self._wall)
        g.released = True
        for st in g.states:
            if st.inflight > 0:
                st.inflight -= 1

    # ------------------------------------------------------------------------------ reading
    def headers(self, g: Grant, now: float) -> list[tuple[str, str]]:
        """The x-ratelimit-* headers of the grant's tightest scopes (lowest remaining): the
        requests' three when a scope has an rpm limit, the tokens' three when one has tpm. The
        limit is this router's (``limit × share``); reset is the time until the bucket is full."""
        return self._headers(g.states, now)

    def _headers(self, states: tuple[ScopeState, ...], now: float) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        for kind, attr in (("requests", "rpm"), ("tokens", "tpm")):
            best: tuple[float, float, float] | None = None  # remaining, capacity, seconds to full
            for st in states:
                limit = getattr(st.quota, attr)
                if limit is None:
                    continue
                bucket = st.rpm if attr == "rpm" else st.tpm
                cap = st.capacity(limit)
                level = bucket.level_at(cap, now)
                if best is None or level < best[0]:
                    best = (level, cap, bucket.until(cap, cap, now) if cap > 0 else 0.0)
            if best is not None:
                out += [(f"x-ratelimit-limit-{kind}", str(math.floor(best[1] + _EPS))),
                        (f"x-ratelimit-remaining-{kind}", str(max(0, math.floor(best[0] + _EPS)))),
                        (f"x-ratelimit-reset-{kind}", reset_text(best[2]))]
        return out

    def use(self, now: float, wall: float | None = None) -> dict[Scope, dict[str, Any]]:
        """Per scope of the book with a limit: ``rpm``/``tpm`` {limit, remaining}, ``concurrency``
        {limit, inflight}, ``day``/``month`` {limit, used} — only the limits it has. ``wall``
        defaults to the last one seen (the budgets' periods)."""
        day, month = self._periods.at(wall if wall is not None else self._wall)
        out: dict[Scope, dict[str, Any]] = {}
        for scope, q in self._book_scopes.items():
            st = self._states.get(scope) or ScopeState(scope, q, self._shares.get(scope, 1.0))
            d: dict[str, Any] = {}
            for attr, bucket in (("rpm", st.rpm), ("tpm", st.tpm)):
                limit = getattr(q, attr)
                if limit is not None:
                    d[attr] = {"limit": limit,
                               "remaining": max(0, math.floor(bucket.level_at(st.capacity(limit), now) + _EPS))}
            if q.concurrency is not None:
                d["concurrency"] = {"limit": q.concurrency, "inflight": st.inflight}
            for name, budget, period in (("day", q.tokens_per_day, day), ("month", q.tokens_per_month, month)):
                if budget is not None:
                    d[name] = {"limit": budget,
                               "used": self._spent.get((scope[0], scope[1], period), 0) + st.used_here(period)}
            out[scope] = d
        return out

    def demand(self, now: float | None = None) -> dict[Scope, float]:
        """Per scope with a per-minute limit (rpm, tpm or concurrency): requests per minute this
        router was asked lately (admitted and refused), as of ``now`` (monotonic; default the last
        time a request was seen — pass it: an idle router's demand must decay, or it keeps the
        share it had when last asked); scopes asked nothing lately are left out."""
        t = self._now if now is None else now
        out = {}
        for scope, st in self._states.items():
            q = st.quota
            if q.rpm is None and q.tpm is None and q.concurrency is None:
                continue
            d = st.demand_at(t)
            if d >= 1e-3:
                out[scope] = d
        return out
