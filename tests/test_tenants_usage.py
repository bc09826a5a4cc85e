"""Usage accounting: minute records drained and put back without loss or duplicates, the
cumulative totals, grouping, and the budget periods."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.tenants import TenantError, UsageBook, UsageRecord, aggregate, period_end, period_keys, period_start

T0 = 1_796_083_200.0  # 2026-12-01T00:00:00Z


def test_add_groups_by_minute_tenant_key_and_model() -> None:
    u = UsageBook()
    u.add("a", "k1", "llama", wall=T0 + 5, prompt=10, cached=4, completion=20, error=False)
    u.add("a", "k1", "llama", wall=T0 + 59.9, prompt=1, cached=0, completion=2, error=True)
    u.add("a", "k1", "llama", wall=T0 + 60, prompt=3, cached=0, completion=0, error=False)
    u.add("b", "-", "qwen", wall=T0 + 1, prompt=7, cached=7, completion=1, error=False)
    assert len(u) == 3
    assert u.drain() == [
        UsageRecord(int(T0), "a", "k1", "llama", 2, 11, 4, 22, 1),
        UsageRecord(int(T0), "b", "-", "qwen", 1, 7, 7, 1, 0),
        UsageRecord(int(T0) + 60, "a", "k1", "llama", 1, 3, 0, 0, 0),
    ]
    assert u.drain() == [] and len(u) == 0
    assert u.totals() == {("a", "llama", "prompt"): 14, ("a", "llama", "cached"): 4,
                          ("a", "llama", "completion"): 22, ("b", "qwen", "prompt"): 7, ("b", "qwen", "cached"): 7,
                          ("b", "qwen", "completion"): 1}
    assert u.requests_total() == {("a", "llama", "ok"): 2, ("a", "llama", "error"): 1, ("b", "qwen", "ok"): 1}


def test_put_back_merges_with_what_came_since_and_peek_does_not_drain() -> None:
    u = UsageBook()
    u.add("a", "k", "m", wall=T0, prompt=1, cached=0, completion=1, error=False)
    failed = u.drain()
    u.add("a", "k", "m", wall=T0 + 1, prompt=2, cached=1, completion=2, error=True)
    u.put_back(failed)
    assert u.peek() == u.peek() == [UsageRecord(int(T0), "a", "k", "m", 2, 3, 1, 3, 1)]
    assert u.drain() == [UsageRecord(int(T0), "a", "k", "m", 2, 3, 1, 3, 1)]
    assert u.requests_total() == {("a", "m", "ok"): 1, ("a", "m", "error"): 1}  # put_back counts nothing twice


_add = st.tuples(st.sampled_from(["a", "b"]), st.sampled_from(["k1", "k2"]), st.sampled_from(["m1", "m2"]),
                 st.floats(0, 600), st.integers(0, 1000), st.integers(0, 1000), st.integers(0, 1000), st.booleans())
_op = st.one_of(st.tuples(st.just("add"), _add), st.tuples(st.just("flush"), st.booleans()))


@settings(max_examples=300, deadline=None)
@given(st.lists(_op, max_size=60))
def test_drain_and_put_back_lose_and_duplicate_nothing(ops: list[tuple[str, object]]) -> None:
    """Whatever the order of adds and flushes, some of which fail (put back), what reached the
    store plus what is still pending is exactly what was added."""
    u = UsageBook()
    added: Counter[tuple[int, str, str, str, str]] = Counter()
    stored: Counter[tuple[int, str, str, str, str]] = Counter()
    for kind, arg in ops:
        if kind == "add":
            tenant, key, model, dt, prompt, cached, completion, error = arg  # type: ignore[misc]
            u.add(tenant, key, model, wall=T0 + dt, prompt=prompt, cached=cached, completion=completion, error=error)
            slot = (int(T0 + dt) // 60 * 60, tenant, key, model)
            added.update({(*slot, "requests"): 1, (*slot, "prompt_tokens"): prompt, (*slot, "cached_tokens"): cached,
                          (*slot, "completion_tokens"): completion, (*slot, "errors"): int(error)})
        else:
            records = u.drain()
            assert len({(r.minute, r.tenant, r.key, r.model) for r in records}) == len(records)  # one per slot
            if arg:  # the store took them
                stored.update(_counts(records))
            else:
                u.put_back(records)
    stored.update(_counts(u.drain()))
    assert +stored == +added


def _counts(records: list[UsageRecord]) -> Counter[tuple[int, str, str, str, str]]:
    c: Counter[tuple[int, str, str, str, str]] = Counter()
    for r in records:
        for f in ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "errors"):
            c[(r.minute, r.tenant, r.key, r.model, f)] += getattr(r, f)
    return c


ROWS = [UsageRecord(int(T0), "a", "k1", "llama", 2, 100, 10, 50, 1),
        UsageRecord(int(T0) + 3600, "a", "k2", "qwen", 1, 10, 0, 5, 0),
        UsageRecord(int(T0) + 86400, "b", "k3", "llama", 4, 40, 0, 40, 0)]


def test_aggregate_by_each_grouping() -> None:
    by_tenant = aggregate(ROWS, "tenant")
    assert by_tenant == [
        {"tenant": "a", "requests": 3, "prompt_tokens": 110, "cached_tokens": 10, "completion_tokens": 55,
         "errors": 1, "total_tokens": 165},
        {"tenant": "b", "requests": 4, "prompt_tokens": 40, "cached_tokens": 0, "completion_tokens": 40, "errors": 0,
         "total_tokens": 80}]
    assert [(r["model"], r["total_tokens"]) for r in aggregate(ROWS, "model")] == [("llama", 230), ("qwen", 15)]
    assert [(r["tenant"], r["key"]) for r in aggregate(ROWS, "key")] == [("a", "k1"), ("a", "k2"), ("b", "k3")]
    assert [(r["day"], r["requests"]) for r in aggregate(ROWS, "day")] == [("2026-12-01", 3), ("2026-12-02", 4)]
    hours = aggregate(ROWS, "hour")
    assert [h["hour"] for h in hours] == ["2026-12-01T00:00Z", "2026-12-01T01:00Z", "2026-12-02T00:00Z"]
    assert hours[1]["start"] == T0 + 3600
    # mappings with the record's fields work as well (the store's rows, a JSON answer)
    as_dicts = [{f: getattr(r, f) for f in r.__slots__} for r in ROWS]  # type: ignore[attr-defined]
    assert aggregate(as_dicts, "tenant") == by_tenant
    assert aggregate([], "day") == []
    with pytest.raises(TenantError) as e:
        aggregate(ROWS, "week")
    assert e.value.field == "by"


@settings(max_examples=100, deadline=None)
@given(st.lists(st.builds(UsageRecord, st.integers(0, 10**6).map(lambda m: m * 60), st.sampled_from("ab"),
                          st.sampled_from("xy"), st.sampled_from("mn"), *[st.integers(0, 100)] * 5), max_size=30),
       st.sampled_from(["tenant", "model", "key", "day", "hour"]))
def test_aggregate_keeps_every_total(rows: list[UsageRecord], by: str) -> None:
    out = aggregate(rows, by)
    for f in ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "errors"):
        assert sum(r[f] for r in out) == sum(getattr(r, f) for r in rows)
    assert all(r["total_tokens"] == r["prompt_tokens"] + r["completion_tokens"] for r in out)


def test_periods_are_utc_days_and_months() -> None:
    assert period_keys(T0) == ("day:2026-12-01", "month:2026-12")
    assert period_keys(T0 - 0.001) == ("day:2026-11-30", "month:2026-11")
    assert period_start("day:2026-12-01") == T0 and period_end("day:2026-12-01") == T0 + 86400
    assert period_start("month:2026-12") == T0 and period_end("month:2026-12") == T0 + 31 * 86400
    assert period_end("month:2028-02") - period_start("month:2028-02") == 29 * 86400  # a leap year
    for bad in ("week:2026-01", "day:2026-13-01", "month:2026", "", "day:"):
        with pytest.raises(TenantError) as e:
            period_start(bad)
        assert e.value.field == "period"


@settings(max_examples=300, deadline=None)
@given(st.floats(0, 4e9))
def test_a_wall_time_is_inside_its_periods(wall: float) -> None:
    for p in period_keys(wall):
        assert period_start(p) <= wall < period_end(p)
