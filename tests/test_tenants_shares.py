"""Quota shares across routers: proportional to demand with a floor, and the bound on their sum —
and, with Limiters, on what several routers let through together."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.tenants import Limiter, QuotaRefused, TenantBook, floor_share, share_bound, shares
from llmgw.tenants.model import Quota, Tenant
from llmgw.tenants.shares import scope_key, scope_of

A, B = ("tenant", "a"), ("key", "k1")


def test_alone_a_router_has_everything() -> None:
    assert shares([A, B], "r1", {"r1": {A: 5.0}}, ["r1"]) == {A: 1.0, B: 1.0}
    assert shares([A], "r1", {}, []) == {A: 1.0}  # itself counts as live


def test_no_demand_is_an_equal_split_and_equal_demand_too() -> None:
    live = ["r1", "r2", "r3"]
    assert shares([A], "r2", {}, live) == {A: pytest.approx(1 / 3)}
    d = {r: {A: 12.0} for r in live}
    assert shares([A], "r2", d, live) == {A: pytest.approx(1 / 3)}


def test_proportional_with_a_floor_and_dead_routers_ignored() -> None:
    live = ["r1", "r2"]
    d = {"r1": {A: 90.0, B: 0.0}, "r2": {A: 10.0, B: 7.0}, "gone": {A: 1000.0}}
    assert shares([A, B], "r1", d, live) == {A: pytest.approx(0.9), B: pytest.approx(floor_share(2))}
    assert shares([A, B], "r2", d, live) == {A: pytest.approx(0.125), B: 1.0}  # 0.1 raised to the floor
    bad = {"r1": {A: float("nan")}, "r2": {A: -5.0}}
    assert shares([A], "r1", bad, live) == {A: 0.5}  # bad figures are no demand


def test_the_bound() -> None:
    assert [share_bound(n) for n in (1, 2, 4)] == [1.0, 1.125, 1.1875]
    assert floor_share(4) == 1 / 16


def test_scope_keys_round_trip() -> None:
    assert scope_key(A) == "tenant:a" and scope_of("key:k1") == B
    assert scope_of("tenant:a:b") == ("tenant", "a:b")
    for bad in ("tenant", "tenant:", "x:y", ""):
        with pytest.raises(ValueError):
            scope_of(bad)


@settings(max_examples=500, deadline=None)
@given(st.lists(st.one_of(st.just(0.0), st.floats(0, 1e6)), min_size=1, max_size=12))
def test_shares_sum_to_at_most_the_bound_and_never_below_the_floor(demand: list[float]) -> None:
    routers = [f"r{i}" for i in range(len(demand))]
    d = {r: {A: x} for r, x in zip(routers, demand)}
    got = [shares([A], r, d, routers)[A] for r in routers]
    n = len(routers)
    assert sum(got) <= share_bound(n) + 1e-9 <= 1 + n * floor_share(n) + 1e-9
    assert all(floor_share(n) - 1e-12 <= s <= 1.0 for s in got)
    if len(set(demand)) == 1:  # equal demand (or none): 1/N each
        assert got == pytest.approx([1 / n] * n)


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 4), st.integers(5, 120),
       st.lists(st.tuples(st.integers(0, 3), st.floats(0.0, 1.5)), min_size=1, max_size=400))
def test_routers_together_stay_within_the_bound(n: int, limit: int, arrivals: list[tuple[int, float]]) -> None:
    """N routers share an rpm limit by their demands, re-shared every 2 s from one view. In any
    window of T seconds they admit at most Σ_i max C_i (at least 1 each) + T/60 · max Σ_i C_i, the
    maxima over the parts C_i = L·share_i in force; with the shares steady, L·S·(1 + T/60) +
    Σ max(0, 1 − C_i)."""
    book = TenantBook([Tenant("a", quota=Quota(rpm=limit))], [], anonymous_tenant="a")
    routers = [f"r{i}" for i in range(n)]
    lims = {r: Limiter() for r in routers}
    for lim in lims.values():
        lim.set_book(book)
    p = book.anonymous
    now, next_sync, epoch = 0.0, 2.0, 0
    admitted: list[tuple[float, int]] = []  # time, share epoch
    caps: dict[int, list[float]] = {0: [float(limit) / n] * n}
    for lim in lims.values():
        lim.set_shares({A: 1 / n})
    for which, gap in arrivals:
        now += gap
        while now >= next_sync:
            demands = {r: lims[r].demand(next_sync) for r in routers}
            epoch += 1
            caps[epoch] = []
            for r in routers:
                s = shares([A], r, demands, routers)
                lims[r].set_shares(s, now=next_sync)
                caps[epoch].append(limit * s[A])
            next_sync += 2.0
        try:
            lims[routers[which % n]].admit(p, 1, now, 1.8e9)
        except QuotaRefused:
            continue
        admitted.append((now, epoch))
    assert all(lim.use(now) for lim in lims.values())  # the limit is the one in force
    for i in range(len(admitted)):
        for j in range(i, len(admitted)):
            (t0, e0), (t1, e1) = admitted[i], admitted[j]
            held = [caps[e] for e in range(e0, e1 + 1)]  # the parts in force in the window
            burst = sum(max(max(c[r], 1.0) for c in held) for r in range(n))
            flow = (t1 - t0) / 60 * max(sum(c) for c in held)
            assert j - i + 1 <= burst + flow + 1e-6
            if e0 == e1:  # the shares held: the bound of the docs, L·S·(1 + T/60) + Σ max(0, 1 − C_i)
                c = caps[e0]
                assert j - i + 1 <= sum(c) * (1 + (t1 - t0) / 60) + sum(max(0.0, 1 - x) for x in c) + 1e-6
                assert sum(c) <= limit * share_bound(n) + 1e-6
