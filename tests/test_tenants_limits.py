"""Quotas: rpm/tpm token buckets, concurrency, day/month budgets — their refusals, headers and
what is charged; with hypothesis: the window bound, idempotent settle/release, nothing charged on
a refusal, budgets."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.tenants import Grant, Limiter, Principal, QuotaRefused, TenantBook
from llmgw.tenants.model import ApiKey, Quota, Tenant
from llmgw.tenants.scope_state import reset_text

WALL = 1_796_083_200.0 + 3600  # 2026-12-01T01:00:00Z
HASH = "0" * 64


def _setup(tq: Quota = Quota(), kq: Quota = Quota()) -> tuple[Limiter, Principal, TenantBook]:
    book = TenantBook([Tenant("a", quota=tq)], [ApiKey(id="key1abcdef", tenant="a", hash=HASH, prefix="", quota=kq)])
    lim = Limiter()
    lim.set_book(book)
    p = book.principal_of_key("key1abcdef")
    assert p is not None
    return lim, p, book


def _refused(lim: Limiter, p: Principal, cost: int, now: float, wall: float = WALL) -> QuotaRefused:
    with pytest.raises(QuotaRefused) as e:
        lim.admit(p, cost, now, wall)
    return e.value


def test_no_quota_admits_everything_and_sends_no_headers() -> None:
    lim, p, _ = _setup()
    g = lim.admit(p, 10**9, 0.0, WALL)
    assert g.states == () and lim.headers(g, 0.0) == []
    lim.settle(g, 5, 1.0, WALL)
    lim.release(g)
    assert lim.use(1.0) == {} and lim.demand() == {}


def test_rpm_refuses_with_the_limit_named_and_refills() -> None:
    lim, p, _ = _setup(Quota(rpm=3))
    for i in range(3):
        lim.admit(p, 1, 0.0, WALL)
    e = _refused(lim, p, 1, 0.0)
    assert (e.status, e.code, e.type, e.reason, e.scope) == (429, "rate_limit_exceeded", "requests", "rpm", ("tenant", "a"))
    assert e.message == "Rate limit reached for tenant `a` on requests per minute: limit 3, used 3. Retry after 20 s."
    assert e.retry_after == 20
    assert e.headers == [("x-ratelimit-limit-requests", "3"), ("x-ratelimit-remaining-requests", "0"),
                         ("x-ratelimit-reset-requests", "1m0s")]
    assert e.body() == {"error": {"message": e.message, "type": "requests", "param": None,
                                  "code": "rate_limit_exceeded"}}
    assert _refused(lim, p, 1, 19.0).retry_after == 1
    g = lim.admit(p, 1, 20.0, WALL)
    assert lim.headers(g, 20.0)[1] == ("x-ratelimit-remaining-requests", "0")
    assert lim.headers(g, 50.0)[1:] == [("x-ratelimit-remaining-requests", "1"), ("x-ratelimit-reset-requests", "30s")]


def test_tpm_charges_up_front_and_settles_by_the_usage() -> None:
    lim, p, _ = _setup(Quota(tpm=1000))
    g = lim.admit(p, 600, 0.0, WALL)
    e = _refused(lim, p, 600, 0.0)
    assert (e.type, e.reason) == ("tokens", "tpm")
    assert e.message == ("Rate limit reached for tenant `a` on tokens per minute: limit 1000, used 600, requested 600. "
                         "Retry after 12 s.")
    lim.settle(g, 100, 0.0, WALL)  # used far less than charged: 500 back
    lim.settle(g, 900, 0.0, WALL)  # once
    assert g.actual == 100
    g2 = lim.admit(p, 600, 0.0, WALL)
    lim.settle(g2, 1500, 0.0, WALL)  # used more than charged: debt
    assert lim.use(0.0)[("tenant", "a")]["tpm"] == {"limit": 1000, "remaining": 0}
    assert lim.use(60.0)[("tenant", "a")]["tpm"] == {"limit": 1000, "remaining": 400}  # 1600 used, 1000 refilled


def test_a_request_larger_than_the_tpm_limit_is_refused_for_good() -> None:
    lim, p, _ = _setup(Quota(tpm=1000))
    e = _refused(lim, p, 1001, 0.0)
    assert e.retry_after == 60 and "max_tokens too large for tpm" in e.message
    assert lim.use(0.0)[("tenant", "a")]["tpm"]["remaining"] == 1000  # nothing charged


def test_concurrency_and_idempotent_release() -> None:
    lim, p, _ = _setup(Quota(concurrency=2))
    g1 = lim.admit(p, 1, 0.0, WALL)
    lim.admit(p, 1, 0.0, WALL)
    e = _refused(lim, p, 1, 0.0)
    assert (e.reason, e.retry_after, e.type) == ("concurrency", 1, "requests")
    assert e.message == "Too many concurrent requests for tenant `a`: limit 2, in flight 2. Retry after 1 s."
    lim.settle(g1, 1, 0.0, WALL)
    lim.release(g1)
    lim.release(g1)
    assert lim.use(0.0)[("tenant", "a")]["concurrency"] == {"limit": 2, "inflight": 1}
    lim.admit(p, 1, 0.0, WALL)
    assert _refused(lim, p, 1, 0.0).reason == "concurrency"


def test_key_and_tenant_both_must_pass_and_a_refusal_charges_neither() -> None:
    lim, p, _ = _setup(Quota(rpm=10, tpm=10_000), Quota(rpm=2))
    lim.admit(p, 100, 0.0, WALL)
    lim.admit(p, 100, 0.0, WALL)
    e = _refused(lim, p, 100, 0.0)
    assert e.scope == ("key", "key1abcdef") and "API key `key1abcdef`" in e.message
    use = lim.use(0.0)
    assert use[("tenant", "a")]["rpm"]["remaining"] == 8 and use[("tenant", "a")]["tpm"]["remaining"] == 9800
    # the headers are the tightest scope's
    assert e.headers == [("x-ratelimit-limit-requests", "2"), ("x-ratelimit-remaining-requests", "0"),
                         ("x-ratelimit-reset-requests", "1m0s"), ("x-ratelimit-limit-tokens", "10000"),
                         ("x-ratelimit-remaining-tokens", "9800"), ("x-ratelimit-reset-tokens", "1.2s")]


def test_budgets_count_the_store_this_routers_settled_use_and_what_is_in_flight() -> None:
    lim, p, _ = _setup(Quota(tokens_per_day=1000, tokens_per_month=5000))
    lim.set_spent({("tenant", "a", "day:2026-12-01"): 500, ("tenant", "a", "month:2026-12"): 4000})
    g = lim.admit(p, 300, 0.0, WALL)  # 500 + 300 ≤ 1000
    e = _refused(lim, p, 300, 0.0)  # 500 + 300 held + 300 > 1000
    assert (e.code, e.type, e.reason) == ("insufficient_quota", "insufficient_quota", "day")
    assert e.message == ("You exceeded your token budget for tenant `a` on tokens per day: limit 1000, used 800, "
                         "requested 300. It renews at 2026-12-02T00:00:00Z.")
    assert e.retry_after == 23 * 3600
    lim.settle(g, 600, 0.0, WALL + 10)  # admitted before the budget ran out: settled in full, past the budget
    lim.release(g)
    assert lim.use(0.0)[("tenant", "a")]["day"] == {"limit": 1000, "used": 1100}
    assert _refused(lim, p, 1, 0.0).reason == "day"
    # the next day the day budget is fresh, the month one is not
    tomorrow = WALL + 86400
    g2 = lim.admit(p, 100, 0.0, tomorrow)
    lim.settle(g2, 100, 0.0, tomorrow)
    e = _refused(lim, p, 400, 0.0, tomorrow)  # month: 4000 + 600 + 100 + 400 > 5000
    assert e.reason == "month" and e.retry_after == 86400  # capped


def test_set_spent_forgets_only_what_the_store_counts() -> None:
    lim, p, _ = _setup(Quota(tokens_per_day=10_000))
    for i, t in enumerate((WALL, WALL + 5, WALL + 20)):
        g = lim.admit(p, 100, float(i), t)
        lim.settle(g, 100, float(i), t)
        lim.release(g)
    assert lim.use(0.0)[("tenant", "a")]["day"]["used"] == 300
    # the store has the first two (a flush drained at WALL + 10); the third is still only here
    lim.set_spent({("tenant", "a", "day:2026-12-01"): 200}, as_of=WALL + 10)
    assert lim.use(0.0)[("tenant", "a")]["day"]["used"] == 300
    lim.set_spent({("tenant", "a", "day:2026-12-01"): 300})  # no as_of: all of it is the store's now
    assert lim.use(0.0)[("tenant", "a")]["day"]["used"] == 300


def test_shares_scale_the_per_minute_limits_and_say_so() -> None:
    lim, p, _ = _setup(Quota(rpm=60, tpm=1000, concurrency=10))
    lim.set_shares({("tenant", "a"): 0.25})
    g = lim.admit(p, 400, 0.0, WALL)  # 400 > 250 (this router's part): goes when the bucket is full
    assert lim.headers(g, 0.0)[:2] == [("x-ratelimit-limit-requests", "15"), ("x-ratelimit-remaining-requests", "14")]
    e = _refused(lim, p, 10, 0.0)
    assert e.reason == "tpm" and "limit 1000 (this router's share: 250)" in e.message
    assert e.retry_after == 39  # 150 of debt + 10, at 250/60 per second: 38.4 s
    lim.set_shares({("tenant", "a"): 0.1})
    lim.release(g)
    lim.admit(p, 1, 200.0, WALL)  # (at 60 s the tokens used before are still over the new part: 150 of 100)
    assert _refused(lim, p, 1, 200.0).message.startswith(
        "Too many concurrent requests for tenant `a`: limit 10 (this router's share: 1), in flight 1.")


def test_limits_of_zero_refuse_everything() -> None:
    lim, p, _ = _setup(Quota(rpm=0))
    assert _refused(lim, p, 1, 0.0).retry_after == 60
    for q in (Quota(tpm=0), Quota(concurrency=0), Quota(tokens_per_day=0)):
        lim, p, _ = _setup(q)
        _refused(lim, p, 1, 0.0)


def test_a_new_book_keeps_the_state_and_clamps_to_new_limits() -> None:
    lim, p, book = _setup(Quota(rpm=10, concurrency=3))
    g = lim.admit(p, 1, 0.0, WALL)
    book2 = TenantBook([Tenant("a", quota=Quota(rpm=2, concurrency=3))], book.keys().values())
    lim.set_book(book2)
    p2 = book2.principal_of_key("key1abcdef")
    assert p2 is not None
    lim.admit(p2, 1, 0.0, WALL)
    assert _refused(lim, p2, 1, 0.0).reason == "rpm"  # lowered to 2: the one used before stays used
    assert lim.use(0.0)[("tenant", "a")]["concurrency"]["inflight"] == 2
    # a tenant gone: its scope stays while a grant is in flight, and release still works
    lim.set_book(TenantBook([], []))
    assert lim.use(0.0) == {}
    lim.release(g)
    lim.set_book(TenantBook([], []))
    assert lim.demand(0.0) != {}  # the in-flight one kept its state until released


def test_release_before_settle_settles_at_the_charge() -> None:
    lim, p, _ = _setup(Quota(tokens_per_day=1000))
    g = lim.admit(p, 400, 0.0, WALL)
    lim.release(g)
    assert g.settled and g.actual == 400
    assert lim.use(0.0)[("tenant", "a")]["day"]["used"] == 400


def test_demand_is_requests_per_minute_asked_admitted_or_not() -> None:
    lim, p, _ = _setup(Quota(rpm=1))
    for i in range(300):  # 1 per second, almost all refused
        try:
            lim.admit(p, 1, float(i), WALL)
        except QuotaRefused:
            pass
    assert lim.demand(299.0)[("tenant", "a")] == pytest.approx(60.0, rel=0.03)
    assert lim.demand(299.0 + 300)[("tenant", "a")] == pytest.approx(60.0 * 2.718 ** -10, rel=0.04)
    assert lim.demand(299.0 + 3000) == {}


def test_use_lists_every_scope_of_the_book_with_limits() -> None:
    lim, _, _ = _setup(Quota(rpm=5, tokens_per_month=100), Quota(concurrency=1))
    assert lim.use(0.0, WALL) == {("tenant", "a"): {"rpm": {"limit": 5, "remaining": 5},
                                                    "month": {"limit": 100, "used": 0}},
                                  ("key", "key1abcdef"): {"concurrency": {"limit": 1, "inflight": 0}}}


@pytest.mark.parametrize(("seconds", "text"), [(0, "0s"), (0.02, "20ms"), (0.0201, "21ms"), (1, "1s"), (1.5, "1.5s"),
                                               (59.9999, "60s"), (60, "1m0s"), (360, "6m0s"), (3725, "1h2m5s")])
def test_reset_is_written_as_openai_does(seconds: float, text: str) -> None:
    assert reset_text(seconds) == text


# ------------------------------------------------------------------------------ properties
@settings(max_examples=300, deadline=None)
@given(st.integers(1, 50), st.sampled_from([1.0, 0.5, 0.25, 0.1, 0.03]),
       st.lists(st.floats(0, 5, allow_nan=False), min_size=1, max_size=150))
def test_rpm_admits_at_most_the_bucket_plus_its_refill_in_any_window(limit: int, share: float,
                                                                      gaps: list[float]) -> None:
    """From a full bucket of C = limit × share: in any window of T seconds at most C + C·T/60
    requests go (plus one when C < 1: a full bucket lets one through)."""
    lim, p, _ = _setup(Quota(rpm=limit))
    lim.set_shares({("tenant", "a"): share})
    cap = limit * share
    t, admitted = 0.0, []
    for gap in gaps:
        t += gap
        try:
            lim.admit(p, 1, t, WALL)
        except QuotaRefused as e:
            assert e.reason == "rpm" and e.retry_after >= 1
        else:
            admitted.append(t)
    for i in range(len(admitted)):
        for j in range(i, len(admitted)):
            window = admitted[j] - admitted[i]
            assert j - i + 1 <= cap + cap * window / 60 + max(0.0, 1 - cap) + 1e-6


_ops = st.lists(st.tuples(st.sampled_from(["admit", "settle", "release", "tick"]), st.integers(0, 40),
                          st.integers(0, 900)), max_size=80)


@settings(max_examples=300, deadline=None)
@given(_ops, st.booleans())
def test_settle_release_are_idempotent_and_refusals_charge_nothing(ops: list[tuple[str, int, int]],
                                                                    with_key: bool) -> None:
    lim, p, _ = _setup(Quota(rpm=20, tpm=3000, concurrency=4, tokens_per_day=20_000),
                       Quota(rpm=15, concurrency=3) if with_key else Quota())
    now, grants, live = 0.0, [], set()
    for op, pick, n in ops:
        if op == "tick":
            now += pick / 4
        elif op == "admit":
            before = lim.use(now)
            try:
                g = lim.admit(p, n, now, WALL + now)
            except QuotaRefused:
                assert lim.use(now) == before  # nothing charged
            else:
                grants.append(g)
                live.add(len(grants) - 1)
        elif grants:
            i = pick % len(grants)
            if op == "settle":
                lim.settle(grants[i], n, now, WALL + now)
            else:
                lim.release(grants[i])
                live.discard(i)
        use = lim.use(now)
        for scope, u in use.items():
            assert u["concurrency"]["inflight"] == len(live) >= 0
            assert u["rpm"]["remaining"] >= 0
    for g in grants:
        lim.release(g)
        lim.release(g)
    assert all(u["concurrency"]["inflight"] == 0 for u in lim.use(now).values())
    # every grant's budget hold is gone: the day's use is what was settled
    assert lim.use(now)[("tenant", "a")]["day"]["used"] == sum(g.actual for g in grants if g.actual is not None)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 5000), st.integers(0, 3000),
       st.lists(st.tuples(st.integers(0, 800), st.integers(0, 1200), st.booleans()), max_size=40))
def test_budgets_refuse_once_spent_and_settle_what_was_admitted(budget: int, spent: int,
                                                                 reqs: list[tuple[int, int, bool]]) -> None:
    """A request goes only while used + cost ≤ budget; once used ≥ budget every request is
    refused; every admitted request is settled in full even past the budget."""
    lim, p, _ = _setup(Quota(tokens_per_day=budget))
    lim.set_spent({("tenant", "a", "day:2026-12-01"): spent})
    inflight: list[Grant] = []
    settled = 0
    for cost, actual, finish_one in reqs:
        used = lim.use(0.0, WALL)[("tenant", "a")]["day"]["used"]
        assert used == spent + settled + sum(g.charged for g in inflight)
        try:
            inflight.append(lim.admit(p, cost, 0.0, WALL))
        except QuotaRefused as e:
            assert e.reason == "day" and (used >= budget or used + cost > budget)
        else:
            assert used < budget and used + cost <= budget
        if finish_one and inflight:
            g = inflight.pop(0)
            lim.settle(g, actual, 0.0, WALL)
            lim.release(g)
            settled += actual
    if lim.use(0.0, WALL)[("tenant", "a")]["day"]["used"] >= budget:
        with pytest.raises(QuotaRefused):
            lim.admit(p, 0, 0.0, WALL)


def test_a_share_change_refills_at_the_old_part_first_and_keeps_what_was_used() -> None:
    lim, p, _ = _setup(Quota(rpm=60))
    for _ in range(60):
        lim.admit(p, 1, 0.0, WALL)  # the whole minute used at t=0
    # 30 s at the full part (30 back), then a quarter of the limit: 30 used of 15 → 15 in debt
    lim.set_shares({("tenant", "a"): 0.25}, now=30.0)
    assert lim.use(30.0)[("tenant", "a")]["rpm"]["remaining"] == 0
    assert _refused(lim, p, 1, 30.0).retry_after == 64  # 16 at 15/60 per second
    lim.admit(p, 1, 94.0, WALL)
    # and back to all of it: what the quarter had used (all 15: empty again) stays used
    lim.set_shares({}, now=94.0)
    assert lim.use(94.0)[("tenant", "a")]["rpm"]["remaining"] == 45


def test_use_before_any_request_reads_the_periods_of_the_last_flush() -> None:
    lim, _, _ = _setup(Quota(tokens_per_day=1000))
    lim.set_spent({("tenant", "a", "day:2026-12-01"): 250}, as_of=WALL)
    assert lim.use(0.0)[("tenant", "a")]["day"] == {"limit": 1000, "used": 250}
