"""The router's scheduler: filters, scorers, pickers, strategies and the decision itself."""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from dataclasses import replace

import pytest
from hypothesis import assume, given, settings, strategies as st

from llmgw.route.filters import (
    ALL_OPEN_NOTE, healthy, is_saturated, load_estimate, loads_of, pool_priority,
    pool_saturated, serves,
)
from llmgw.route.pickers import (
    PICKERS, PickerState, pick_max_score, pick_power_of_two, pick_round_robin, pick_softmax,
    tie_break,
)
from llmgw.route.scheduler import (
    Scheduler, SchedulerConfig, _unfiltered_loads, top_indices, weighted_sum,
)
from llmgw.route.scorers import (
    NEUTRAL, SCORERS, ScoreContext, Scores, score_inflight, score_kv, score_load, score_queue,
    score_session, score_weight,
)
from llmgw.route.strategies import PRESETS, Strategy, StrategyError, resolve
from llmgw.route.types import EndpointView, RequestInfo

CFG = SchedulerConfig()


def ep(i: int | str, **kw) -> EndpointView:
    name = kw.pop("id", f"m/r{i}")
    base = dict(model="m", url=f"http://h{i}:8000", running=0.0, waiting=0.0, kv_usage=0.1,
                scraped_at=0.0, stale=False)
    base.update(kw)
    return EndpointView(id=name, **base)


def req(**kw) -> RequestInfo:
    base = dict(request_id="req-1", model="m", base_model="m")
    base.update(kw)
    return RequestInfo(**base)


def ctx_for(eps, r=None, cfg=CFG, state=None) -> ScoreContext:
    return ScoreContext(r or req(), eps, eps, cfg, 0.0, {} if state is None else state)


def values(s: Scores, n: int) -> list[float]:
    return [s.at(i) for i in range(n)]


def pick_args(**kw):
    return dict(rng=random.Random(0), state=PickerState(), key="m", param=None) | kw


# --------------------------------------------------------------------------- load estimate

def test_load_estimate_counts_our_starts_since_the_scrape():
    e = ep(0, running=3.0, waiting=2.0, inflight=7, inflight_at_scrape=4)
    assert load_estimate(e) == 3 + 2 + 3


def test_load_estimate_ignores_finished_since_the_scrape():
    assert load_estimate(ep(0, running=3.0, waiting=1.0, inflight=1, inflight_at_scrape=4)) == 4


def test_load_estimate_stale_or_missing_falls_back_to_inflight():
    assert load_estimate(ep(0, running=30.0, waiting=9.0, stale=True, inflight=2)) == 2
    assert load_estimate(ep(0, running=None, waiting=None, inflight=5)) == 5
    assert load_estimate(ep(0, running=4.0, waiting=None, inflight=1, inflight_at_scrape=0)) == 5


gauge = st.none() | st.integers(0, 50).map(float)


@st.composite
def views(draw, i: int = 0, model: str | None = None) -> EndpointView:
    return EndpointView(
        id=f"m/r{i}", model=model or draw(st.sampled_from(["m", "m", "m", "other"])),
        url=f"http://h{i}", pool=draw(st.sampled_from(["default", "burst", "spare"])),
        pool_priority=draw(st.sampled_from([0, 0, 10, 20])),
        weight=draw(st.floats(0.1, 4.0)),
        adapters=frozenset(draw(st.sets(st.sampled_from(["a1", "a2"])))),
        available=draw(st.booleans()),
        breaker_state=draw(st.sampled_from(["closed", "open", "half_open"])),
        retry_at=draw(st.none() | st.floats(0, 100)),
        running=draw(gauge), waiting=draw(gauge),
        kv_usage=draw(st.none() | st.floats(0.0, 1.0)),
        stale=draw(st.booleans()),
        inflight=draw(st.integers(0, 40)), inflight_at_scrape=draw(st.integers(0, 40)),
        max_inflight=draw(st.none() | st.integers(1, 40)),
    )


@st.composite
def fleets(draw, min_size: int = 1, max_size: int = 10, model: str | None = None):
    n = draw(st.integers(min_size, max_size))
    return [draw(views(i, model)) for i in range(n)]


@given(fleets(max_size=20))
def test_loads_of_matches_load_estimate(eps):
    assert loads_of(eps) == [load_estimate(e) for e in eps]
    assert ctx_for(eps).loads == [load_estimate(e) for e in eps]  # the inlined fast path too


# --------------------------------------------------------------------------- filters

def test_serves_drops_other_models_and_missing_adapters():
    eps = [ep(0), ep(1, model="other"), ep(2, adapters=frozenset({"a1"}))]
    res = serves(req(), eps)
    assert [e.id for e in res.kept] == ["m/r0", "m/r2"]
    assert [(d.filter, d.endpoint_id) for d in res.drops] == [("serves", "m/r1")]
    assert "other" in res.drops[0].reason
    res = serves(req(model="a1", adapter="a1"), eps)
    assert [e.id for e in res.kept] == ["m/r2"]
    reasons = {d.endpoint_id: d.reason for d in res.drops}
    assert set(reasons) == {"m/r0", "m/r1"} and "adapter 'a1' not loaded" in reasons["m/r0"]


def test_filters_return_their_input_when_nothing_is_dropped():
    eps = [ep(0), ep(1)]
    for res in (serves(req(), eps), healthy(eps, 0.0), pool_priority(eps, CFG)):
        assert res.kept is eps and not res.drops and not res.note


def test_healthy_drops_open_breakers_with_a_reason():
    eps = [ep(0), ep(1, available=False, breaker_state="open", retry_at=12.0)]
    res = healthy(eps, now=10.0)
    assert [e.id for e in res.kept] == ["m/r0"]
    assert res.drops[0].endpoint_id == "m/r1" and "retry in 2.0s" in res.drops[0].reason
    assert res.note == ""


def test_healthy_all_open_fails_open_to_every_open_replica():
    """Every breaker open: each open replica may be probed early (not only the one closest to
    recovery); one whose probe slots are taken (half-open, unavailable) is left out."""
    eps = [ep(0, available=False, breaker_state="open", retry_at=30.0),
           ep(1, available=False, breaker_state="open", retry_at=None),
           ep(2, available=False, breaker_state="half_open"),
           ep(3, available=False, breaker_state="open", retry_at=25.0)]
    res = healthy(eps, now=10.0)
    assert [e.id for e in res.kept] == ["m/r0", "m/r1", "m/r3"]
    assert res.note == ALL_OPEN_NOTE
    assert [d.endpoint_id for d in res.drops] == ["m/r2"]
    # every one half-open with its slots taken: all kept (the request waits for a slot)
    busy = [ep(i, available=False, breaker_state="half_open") for i in range(3)]
    res = healthy(busy, now=10.0)
    assert len(res.kept) == 3 and res.note == ALL_OPEN_NOTE and not res.drops


def test_saturation_measure():
    assert is_saturated(ep(0, max_inflight=4, inflight=4), CFG)
    assert not is_saturated(ep(0, max_inflight=4, inflight=3, running=500.0), CFG)  # cap rules
    cfg = replace(CFG, saturation_load=10.0)
    assert is_saturated(ep(0, running=8.0, waiting=2.0), cfg)
    assert not is_saturated(ep(0, running=8.0, waiting=1.0), cfg)
    assert not is_saturated(ep(0, running=1e6), replace(CFG, saturation_load=None))
    full = dict(max_inflight=1, inflight=1)
    assert pool_saturated([ep(0, **full), ep(1, **full)], CFG)
    assert not pool_saturated([ep(0, max_inflight=1, inflight=1), ep(1, max_inflight=1)], CFG)


def test_pool_priority_keeps_the_preferred_pool_with_room():
    eps = [ep(0, pool="burst", pool_priority=10), ep(1, pool="default"), ep(2, pool="default")]
    res = pool_priority(eps, CFG)
    assert [e.id for e in res.kept] == ["m/r1", "m/r2"] and res.note == ""
    assert res.drops[0].endpoint_id == "m/r0" and res.drops[0].filter == "pool"
    assert "'burst'" in res.drops[0].reason


def test_pool_priority_spills_in_priority_order():
    full = dict(max_inflight=2, inflight=2)
    eps = [ep(0, pool="last", pool_priority=20), ep(1, pool="default", **full),
           ep(2, pool="burst", pool_priority=10), ep(3, pool="default", **full)]
    res = pool_priority(eps, CFG)
    assert [e.id for e in res.kept] == ["m/r2"]
    assert "spilled to priority 10" in res.note
    assert {d.endpoint_id for d in res.drops} == {"m/r0", "m/r1", "m/r3"}


def test_pool_priority_all_saturated_keeps_the_preferred():
    full = dict(max_inflight=1, inflight=1)
    eps = [ep(0, pool_priority=10, **full), ep(1, pool_priority=0, **full),
           ep(2, pool_priority=5, **full)]
    res = pool_priority(eps, CFG)
    assert [e.id for e in res.kept] == ["m/r1"]
    assert res.note == "all pools saturated: keeping the preferred pool"


def _ref_saturated(e: EndpointView, cfg: SchedulerConfig) -> bool:
    if e.max_inflight is not None:
        return e.inflight >= e.max_inflight
    return cfg.saturation_load is not None and load_estimate(e) >= cfg.saturation_load


@settings(max_examples=200)
@given(fleets(model="m"), st.sampled_from([None, 5.0, 30.0]))
def test_spill_order_follows_pool_priority(eps, limit):
    cfg = replace(CFG, saturation_load=limit)
    res = pool_priority(eps, cfg)
    prios = sorted({e.pool_priority for e in eps})
    open_ = [p for p in prios
             if not all(_ref_saturated(e, cfg) for e in eps if e.pool_priority == p)]
    expect = open_[0] if open_ else prios[0]
    if len(prios) == 1:
        assert res.kept is eps
    else:
        assert {e.pool_priority for e in res.kept} == {expect}
        assert [e.id for e in res.kept] == [e.id for e in eps if e.pool_priority == expect]
    assert len(res.kept) + len(res.drops) == len(eps)


@given(fleets(model="m"), st.floats(0, 100))
def test_all_open_keeps_the_open_ones_and_the_decision_says_fallback(eps, now):
    eps = [replace(e, available=False) for e in eps]
    res = healthy(eps, now)
    opened = [e.id for e in eps if e.breaker_state == "open"]
    assert [e.id for e in res.kept] == (opened or [e.id for e in eps]) and res.note == ALL_OPEN_NOTE
    d = Scheduler().decide(req(), eps, PRESETS["chat"], now=now, wall=0.0, rng=random.Random(0))
    assert d.chosen in {e.id for e in res.kept} and ALL_OPEN_NOTE in d.note and d.fallback


# --------------------------------------------------------------------------- scorers

def test_scores_affine_constant_and_sparse():
    s = Scores([2.0, 4.0], -0.25, 1.0)
    assert values(s, 2) == [0.5, 0.0]
    assert values(Scores.constant(0.3), 3) == [0.3, 0.3, 0.3]
    assert values(Scores({1: 1.0}, 0.5, 0.25), 3) == [0.25, 0.75, 0.25]


def test_scheduler_config_is_validated():
    for bad in (dict(kv_ceiling=0), dict(kv_ceiling=1.5), dict(saturation_load=0),
                dict(bounded_load_c=0.9), dict(ring_vnodes=0), dict(record_candidates=0)):
        with pytest.raises(ValueError):
            SchedulerConfig(**bad)


def test_queue_scorer_relative_with_neutral_unknowns():
    eps = [ep(0, waiting=0.0), ep(1, waiting=2.0), ep(2, waiting=4.0)]
    assert values(score_queue(ctx_for(eps)), 3) == [1.0, 0.5, 0.0]
    eps[2] = ep(2, waiting=None)
    assert values(score_queue(ctx_for(eps)), 3) == [1.0, 0.0, NEUTRAL]
    eps[1] = ep(1, waiting=9.0, stale=True)  # a stale scrape is no evidence
    assert values(score_queue(ctx_for(eps)), 3) == [1.0, NEUTRAL, NEUTRAL]
    assert score_queue(ctx_for([ep(0, waiting=0.0), ep(1, waiting=0.0)])).scale == 0.0
    assert values(score_queue(ctx_for([ep(0, waiting=3.0), ep(1, waiting=3.0)])), 2) == [0.0, 0.0]


def test_kv_scorer_headroom_and_hard_ceiling():
    eps = [ep(0, kv_usage=0.0), ep(1, kv_usage=0.475), ep(2, kv_usage=0.97), ep(3, kv_usage=None)]
    ctx = ctx_for(eps)
    got = values(score_kv(ctx), 4)
    assert got[:3] == [1.0, pytest.approx(0.5), 0.0] and got[3] == NEUTRAL
    assert ctx.vetoed == {2}
    assert ctx.flags == {2: ["kv 0.97 >= ceiling 0.95"]}
    ctx = ctx_for([ep(0, kv_usage=0.95)])  # at the ceiling counts
    score_kv(ctx)
    assert ctx.vetoed == {0}


def test_kv_scorer_without_the_metric_is_neutral_and_never_vetoes():
    for eps in ([ep(0, kv_usage=None, engine="llamacpp"), ep(1, kv_usage=None)],
                [ep(0, kv_usage=0.99, stale=True), ep(1, kv_usage=None)]):
        ctx = ctx_for(eps)
        s = score_kv(ctx)
        assert s.scale == 0.0 and s.offset == NEUTRAL and ctx.vetoed is None


def test_inflight_scorer():
    eps = [ep(0, inflight=0), ep(1, inflight=3), ep(2, inflight=6)]
    assert values(score_inflight(ctx_for(eps)), 3) == [1.0, 0.5, 0.0]
    assert values(score_inflight(ctx_for([ep(0), ep(1)])), 2) == [1.0, 1.0]


def test_load_scorer_sees_a_burst_since_the_scrape():
    eps = [ep(0, running=2.0), ep(1, running=2.0, inflight=4, inflight_at_scrape=0)]
    assert values(score_load(ctx_for(eps)), 2) == [pytest.approx(2 / 3), 0.0]
    eps = [ep(0, running=50.0, stale=True, inflight=1),
           ep(1, running=None, waiting=None, inflight=2)]
    assert values(score_load(ctx_for(eps)), 2) == [0.5, 0.0]


def test_weight_scorer_normalised_to_the_largest():
    eps = [ep(0, weight=1.0), ep(1, weight=4.0), ep(2, weight=2.0)]
    assert values(score_weight(ctx_for(eps)), 3) == [0.25, 1.0, 0.5]
    assert values(score_weight(ctx_for([ep(0), ep(1)])), 2) == [1.0, 1.0]


def test_session_scorer_one_hot_and_sticky():
    eps = [ep(i) for i in range(6)]
    assert values(score_session(ctx_for(eps)), 6) == [0.0] * 6  # no key
    state: dict = {}
    got = values(score_session(ctx_for(eps, req(session_key="alice"), state=state)), 6)
    assert sorted(got) == [0.0] * 5 + [1.0]
    again = values(score_session(ctx_for(eps, req(session_key="alice"), state=state)), 6)
    assert again == got
    _, ring = state["session"].get(("m", None), eps)
    score_session(ctx_for([*eps], req(session_key="alice"), state=state))  # same views, new list
    assert state["session"].get(("m", None), eps)[1] is ring  # not rebuilt
    eps2 = [replace(e) for e in eps]  # new view objects, same ids
    score_session(ctx_for(eps2, req(session_key="alice"), state=state))
    assert state["session"].get(("m", None), eps2)[1] is ring


def test_session_scorer_spills_off_an_overloaded_home():
    eps = [ep(i) for i in range(4)]
    state: dict = {}
    c = ctx_for(eps, req(session_key="bob"), state=state)
    home = values(score_session(c), 4).index(1.0)
    assert c.flags == {home: ["session home"]}
    eps[home] = ep(home, running=20.0)
    c = ctx_for(eps, req(session_key="bob"), state=state)
    moved = values(score_session(c), 4).index(1.0)
    assert moved != home and "session moved off" in c.flags[moved][0]


def test_session_ring_spans_filtered_members():
    # r0 filtered out (e.g. its breaker opened): only its keys move, every other key stays home
    members = [ep(i) for i in range(6)]
    kept = members[1:]
    state: dict = {}

    def target(cands, key):
        c = ScoreContext(req(session_key=key), cands, members, CFG, 0.0, state)
        return cands[values(score_session(c), len(cands)).index(1.0)].id

    homes = {f"k{k}": target(members, f"k{k}") for k in range(60)}
    assert "m/r0" in homes.values()
    for key, home in homes.items():
        if home != "m/r0":
            assert target(kept, key) == home


def test_scorers_stay_in_unit_range_on_random_fleets():
    rng = random.Random(7)
    for _ in range(200):
        eps = [ep(i, running=rng.choice([None, float(rng.randrange(30))]),
                  waiting=rng.choice([None, float(rng.randrange(30))]),
                  kv_usage=rng.choice([None, rng.random()]), stale=rng.random() < 0.2,
                  inflight=rng.randrange(10), weight=rng.uniform(0.1, 3))
               for i in range(rng.randrange(1, 9))]
        for name, fn in SCORERS.items():
            s = fn(ctx_for(eps, req(session_key="s")))
            for v in values(s, len(eps)):
                assert -1e-12 <= v <= 1 + 1e-12, (name, v)


# --------------------------------------------------------------------------- pickers

def test_max_score_ties_go_to_lowest_load_then_random():
    eps = [ep(0, inflight=2), ep(1), ep(2)]
    assert pick_max_score([0.9, 0.5, 0.1], eps, None, **pick_args()) == 0
    assert pick_max_score([0.5, 0.5, 0.5], eps, None, **pick_args()) in (1, 2)  # r1, r2 idle: either
    eps = [ep("z", id="z"), ep("a", id="a", inflight=1)]
    assert pick_max_score([0.5, 0.5], eps, None, **pick_args()) == 0  # load before id


@given(st.lists(st.integers(0, 3).map(float), min_size=1, max_size=40),
       st.lists(st.integers(0, 2), min_size=40, max_size=40), st.booleans())
def test_max_score_tie_break_matches_its_definition(totals, inflights, give_loads):
    eps = [ep(f"{(7 * i) % 41:02d}", id=f"r{(7 * i) % 41:02d}", inflight=inflights[i])
           for i in range(len(totals))]
    loads = [load_estimate(e) for e in eps] if give_loads else None
    k = pick_max_score(totals, eps, loads, **pick_args())
    tied = [i for i, t in enumerate(totals) if t == max(totals)]
    least = min(load_estimate(eps[i]) for i in tied)
    assert k in [i for i in tied if load_estimate(eps[i]) == least]  # a random one of the least loaded
    assert tie_break([k], eps) == k


def test_power_of_two_single_and_pair():
    assert pick_power_of_two([0.3], [ep(0)], None, **pick_args()) == 0
    for seed in range(50):  # with two candidates both are always sampled: the better wins
        rng = random.Random(seed)
        assert pick_power_of_two([0.3, 0.7], [ep(0), ep(1)], None, **pick_args(rng=rng)) == 1


class RecordingRandom(random.Random):
    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.drawn: list[int] = []

    def randrange(self, *a, **kw):  # type: ignore[override]
        v = super().randrange(*a, **kw)
        self.drawn.append(v)
        return v


@given(st.lists(st.floats(0, 1), min_size=2, max_size=30), st.integers(0, 2**32))
def test_power_of_two_never_takes_the_worse_sample(totals, seed):
    eps = [ep(i) for i in range(len(totals))]
    rng = RecordingRandom(seed)
    k = pick_power_of_two(totals, eps, None, **pick_args(rng=rng))
    i, j = rng.drawn
    j += j >= i
    assert i != j and k in (i, j)
    assert totals[k] >= totals[j if k == i else i]
    worst = min(totals)
    if totals.count(worst) == 1:
        assert totals[k] > worst  # the unique worst can never win a duel


def test_softmax_prefers_high_totals_and_replays():
    eps = [ep(i) for i in range(3)]
    totals = [0.9, 0.5, 0.1]
    picks = Counter(pick_softmax(totals, eps, None, **pick_args(rng=random.Random(s), param=0.1))
                    for s in range(2000))
    assert picks[0] > picks[1] > picks[2]
    assert abs(picks[0] / 2000 - 1 / (1 + math.exp(-4) + math.exp(-8))) < 0.05
    a = [pick_softmax(totals, eps, None, **pick_args(rng=random.Random(3))) for _ in range(5)]
    b = [pick_softmax(totals, eps, None, **pick_args(rng=random.Random(3))) for _ in range(5)]
    assert a == b
    assert pick_softmax([0.2, 0.8], eps[:2], None, **pick_args(param=0.0)) == 1


def test_softmax_survives_huge_differences():
    eps = [ep(i) for i in range(2)]
    assert pick_softmax([1.0, 0.0], eps, None, **pick_args(param=1e-6)) == 0


def test_round_robin_cycles_per_key():
    state = PickerState()
    eps = [ep(i) for i in range(3)]
    seq = [pick_round_robin([0.0] * 3, eps, None, **pick_args(state=state)) for _ in range(7)]
    assert seq == [0, 1, 2, 0, 1, 2, 0]
    assert pick_round_robin([0.0] * 3, eps, None, **pick_args(state=state, key="other")) == 0


# --------------------------------------------------------------------------- strategies

def test_presets_are_normalised_and_valid():
    assert set(PRESETS) == {"chat", "batch", "long-context", "load-balance", "prefill", "decode"}
    for s in PRESETS.values():
        assert math.isclose(sum(s.weights.values()), 1.0)
        assert set(s.weights) <= set(SCORERS) and s.picker in PICKERS
    assert PRESETS["batch"].picker == "power-of-two"
    # cache-aware by default: the default preset's largest weight is the prefix vote, and its kv
    # term keeps the KV ceiling's veto; only load-balance has no affinity at all
    chat = PRESETS["chat"].weights
    tier1 = {k: v for k, v in chat.items() if k != "kv_cache"}  # kv_cache: tier 2, 0 without KV events
    assert chat["prefix"] == max(tier1.values()) and "kv" in chat and chat["kv_cache"] > chat["prefix"]
    assert all("prefix" in PRESETS[p].weights for p in ("chat", "batch", "long-context"))
    assert not {"prefix", "session"} & set(PRESETS["load-balance"].weights)
    lc = PRESETS["long-context"].weights
    assert lc["kv"] == max(lc.values())
    # disaggregation: the prefiller by cache affinity, the decoder by KV headroom with no affinity
    assert PRESETS["prefill"].weights["kv_cache"] == max(PRESETS["prefill"].weights.values())
    dec = PRESETS["decode"].weights
    assert dec["kv"] == max(dec.values()) and not {"prefix", "kv_cache", "session"} & set(dec)


def test_resolve_overrides_and_errors():
    assert resolve("chat") is PRESETS["chat"]
    s = resolve("chat", {"session": 0, "weight": 1.0, "picker": "softmax", "param": 0.05})
    assert "session" not in s.weights and s.picker == "softmax" and s.param == 0.05
    assert math.isclose(sum(s.weights.values()), 1.0)
    with pytest.raises(StrategyError, match="unknown strategy 'chatt'.*did you mean 'chat'"):
        resolve("chatt")
    with pytest.raises(StrategyError, match="unknown scorer 'kvv'"):
        resolve("chat", {"kvv": 1.0})
    with pytest.raises(StrategyError, match="unknown picker"):
        resolve("chat", {"picker": "best"})
    with pytest.raises(StrategyError, match=">= 0"):
        resolve("chat", {"kv": -1})
    with pytest.raises(StrategyError, match="at least one"):
        Strategy("x", {"kv": 0.0})
    assert resolve("chat", {"prefix": 0.5}, scorers=[*SCORERS, "prefix"]).weights["prefix"] > 0


# --------------------------------------------------------------------------- helpers

@given(st.lists(st.lists(st.floats(-10, 10), min_size=5, max_size=5), max_size=6),
       st.lists(st.floats(-2, 2), min_size=6, max_size=6))
def test_weighted_sum_matches_naive(cols, coefs):
    coefs = coefs[:len(cols)]
    got = weighted_sum(coefs, cols, 5)
    want = [sum(a * c[i] for a, c in zip(coefs, cols)) for i in range(5)]
    assert got == pytest.approx(want)


@given(st.lists(st.sampled_from([0.0, 0.25, 0.5, 1.0]) | st.floats(0, 1), max_size=40),
       st.integers(1, 20))
def test_top_indices(vals, k):
    want = sorted(range(len(vals)), key=lambda i: (-vals[i], i))[:k]
    assert top_indices(vals, k) == want


@given(st.lists(st.sampled_from([0.0, 0.125, 0.5, 1.0]) | st.floats(-1, 1), min_size=50,
                max_size=1000), st.integers(1, 12))
def test_top_indices_at_fleet_sizes(vals, k):
    want = sorted(range(len(vals)), key=lambda i: (-vals[i], i))[:k]
    assert top_indices(vals, k) == want


# --------------------------------------------------------------------------- the scheduler

def decide(eps, r=None, strategy="chat", sched=None, **kw):
    s = strategy if isinstance(strategy, Strategy) else PRESETS[strategy]
    return (sched or Scheduler()).decide(r or req(), eps, s, now=kw.pop("now", 0.0),
                                         wall=kw.pop("wall", 1000.0),
                                         rng=kw.pop("rng", random.Random(0)))


def test_decision_records_everything():
    ticks = iter([1_000, 43_000])
    sched = Scheduler(timer=lambda: next(ticks))
    eps = [ep(0, running=5.0), ep(1), ep(2, model="other"), ep(3, available=False)]
    d = decide(eps, sched=sched, wall=123.0)
    assert d.chosen == "m/r1" and d.decide_us == 42.0 and d.decided_at == 123.0
    assert d.strategy == "chat" and d.picker == "max-score"
    assert d.weights == PRESETS["chat"].weights
    assert {x.endpoint_id: x.filter for x in d.dropped} == {"m/r2": "serves", "m/r3": "healthy"}
    assert [c.endpoint_id for c in d.candidates] == ["m/r1", "m/r0"] and d.n_candidates == 2
    best = d.candidates[0]
    assert set(best.scores) == set(PRESETS["chat"].weights)
    assert best.total == pytest.approx(sum(PRESETS["chat"].weights[k] * v
                                           for k, v in best.scores.items()))
    json.dumps(d.to_json())


def test_no_endpoint_serves():
    d = decide([ep(0, model="other")])
    assert d.chosen is None and d.note == "no endpoint serves model 'm'"
    d = decide([ep(0)], req(model="a9", adapter="a9"))
    assert d.chosen is None and "adapter 'a9'" in d.note
    assert decide([]).chosen is None


def test_kv_veto_is_avoided_unless_everything_is_over():
    eps = [ep(0, kv_usage=0.97), ep(1, kv_usage=0.5, running=20.0, waiting=5.0, inflight=9)]
    d = decide(eps)
    assert d.chosen == "m/r1" and "vetoed" in d.note
    flags = {c.endpoint_id: c.flags for c in d.candidates}
    assert flags["m/r0"] == ("kv 0.97 >= ceiling 0.95",)
    d = decide([ep(0, kv_usage=0.97), ep(1, kv_usage=0.99)])
    assert d.chosen in ("m/r0", "m/r1") and "picking among them anyway" in d.note


def test_records_only_the_best_candidates_and_always_the_pick():
    sched = Scheduler(SchedulerConfig(record_candidates=3))
    eps = [ep(i, running=float(i)) for i in range(10)]
    d = decide(eps, sched=sched, strategy=resolve("chat", {"picker": "round-robin"}))
    assert d.n_candidates == 10 and len(d.candidates) == 3
    for _ in range(12):
        d = decide(eps, sched=sched, strategy=resolve("chat", {"picker": "round-robin"}))
        assert d.chosen in [c.endpoint_id for c in d.candidates]


@pytest.mark.parametrize("weights", [{"load": 1.0}, {"load": 1.0, "queue": 1.0},
                                     {"session": 1.0, "kv": 2.0, "weight": 1.0}])
def test_candidate_scores_are_each_scorers_value(weights):
    eps = [ep(i, running=float(i), waiting=float(3 - i), kv_usage=0.1 * i, weight=1.0 + i)
           for i in range(4)]
    d = decide(eps, req(session_key="alice"), Strategy("x", weights))
    ctx = ctx_for(eps, req(session_key="alice"))
    for c in d.candidates:
        i = int(c.endpoint_id[3:])
        assert c.scores == {k: SCORERS[k](ctx).at(i) for k in weights}
        assert c.total == pytest.approx(sum(d.weights[k] * v for k, v in c.scores.items()))


def test_custom_scorer_plugs_in():
    def prefer_r2(ctx: ScoreContext) -> Scores:
        return Scores([1.0 if e.id == "m/r2" else 0.0 for e in ctx.endpoints])

    sched = Scheduler(scorers={"r2": prefer_r2})
    strat = resolve("chat", {"r2": 5.0}, scorers=sched.scorers)
    d = decide([ep(i) for i in range(4)], sched=sched, strategy=strat)
    assert d.chosen == "m/r2" and d.candidates[0].scores["r2"] == 1.0
    with pytest.raises(StrategyError, match="unknown scorer 'r2'"):
        decide([ep(0)], strategy=strat)  # a scheduler without it
    # a bare scheduler has a neutral stand-in for the prefix index: the presets still decide
    assert decide([ep(i) for i in range(4)], strategy=PRESETS["chat"]).candidates[0].scores["prefix"] == 0.0


@pytest.mark.parametrize("strategy", [*PRESETS, Strategy("load-only", {"load": 1.0})],
                         ids=[*PRESETS, "load-only"])
def test_burst_spreads_instead_of_herding(strategy):
    """Many decisions between two scrapes, each followed by inflight += 1 on the pick (as the
    router does): the load estimate must see them, or every request lands on the replica that
    looked idlest at the scrape (here r0)."""
    eps = [ep(i, running=0.0 if i == 0 else float(1 + i % 3), kv_usage=0.2) for i in range(8)]
    sched = Scheduler()
    rng = random.Random(1)
    counts: Counter[str] = Counter()
    for k in range(64):
        d = decide(eps, req(request_id=f"r{k}"), strategy, sched=sched, rng=rng)
        counts[d.chosen] += 1
        next(e for e in eps if e.id == d.chosen).inflight += 1
    assert len(counts) == 8 and counts["m/r0"] < 16
    strategy = strategy if isinstance(strategy, Strategy) else PRESETS[strategy]
    if strategy.picker == "max-score":
        loads = [load_estimate(e) for e in eps]
        assert max(loads) - min(loads) <= 2  # water-filling


def test_burst_with_stale_scrape_spreads_on_inflight():
    eps = [ep(i, running=40.0 if i == 0 else 0.0, stale=True) for i in range(4)]
    sched = Scheduler()
    counts: Counter[str] = Counter()
    for k in range(40):
        d = decide(eps, req(request_id=f"r{k}"), sched=sched)
        counts[d.chosen] += 1
        next(e for e in eps if e.id == d.chosen).inflight += 1
    assert set(counts.values()) == {10}


def test_sessions_stick_until_the_load_bound():
    eps = [ep(i) for i in range(4)]
    sched = Scheduler()
    first = decide(eps, req(session_key="alice"), sched=sched).chosen
    for _ in range(3):
        assert decide(eps, req(session_key="alice"), sched=sched).chosen == first


def test_scheduler_is_deterministic_given_the_rng():
    rng_fleet = random.Random(5)
    eps = [ep(i, running=float(rng_fleet.randrange(9)), kv_usage=rng_fleet.random() * 0.9)
           for i in range(16)]
    for name in PRESETS:
        a = [decide(eps, strategy=name, rng=random.Random(9)).chosen for _ in range(3)]
        b = [decide(eps, strategy=name, rng=random.Random(9)).chosen for _ in range(3)]
        assert a == b


def _reference_kept(r: RequestInfo, eps: list[EndpointView], cfg: SchedulerConfig):
    s = [e for e in eps
         if e.model == r.base_model and (r.adapter is None or r.adapter in e.adapters)]
    if not s:
        return []
    h = [e for e in s if e.available] or [e for e in s if e.breaker_state == "open"] or s
    prios = sorted({e.pool_priority for e in h})
    open_ = [p for p in prios if not all(_ref_saturated(e, cfg) for e in h if e.pool_priority == p)]
    p = open_[0] if open_ else prios[0]
    return [e for e in h if e.pool_priority == p]


@settings(max_examples=300, deadline=None)
@given(
    eps=fleets(max_size=12),
    adapter=st.sampled_from([None, "a1"]),
    session=st.sampled_from([None, "s1", "s2"]),
    strategy=st.sampled_from(list(PRESETS)),
    picker=st.sampled_from(list(PICKERS)),
    seed=st.integers(0, 1000),
    limit=st.sampled_from([None, 10.0]),
)
def test_pick_always_comes_from_the_filtered_set(eps, adapter, session, strategy, picker, seed,
                                                  limit):
    cfg = SchedulerConfig(saturation_load=limit, record_candidates=4)
    r = req(model=adapter or "m", adapter=adapter, session_key=session)
    d = Scheduler(cfg).decide(r, eps, resolve(strategy, {"picker": picker}), now=50.0, wall=0.0,
                              rng=random.Random(seed))
    kept = _reference_kept(r, eps, cfg)
    assert d.n_candidates == len(kept)
    assert len(d.dropped) + len(kept) == len(eps)
    assert {x.endpoint_id for x in d.dropped}.isdisjoint(e.id for e in kept)
    if not kept:
        assert d.chosen is None
        return
    assert d.chosen in {e.id for e in kept}
    assert d.chosen in {c.endpoint_id for c in d.candidates}
    over = {e.id for e in kept
            if not e.stale and e.kv_usage is not None and e.kv_usage >= cfg.kv_ceiling}
    if len(over) < len(kept):
        assert d.chosen not in over  # the KV ceiling is a hard limit
    for c in d.candidates:
        assert list(c.scores) == list(resolve(strategy).weights)  # every scorer, in weight order
        assert all(0.0 <= v <= 1.0 + 1e-9 for v in c.scores.values())
        assert -1e-9 <= c.total <= 1.0 + 1e-9
    json.dumps(d.to_json())


@settings(max_examples=100, deadline=None)
@given(eps=fleets(min_size=2, max_size=12, model="m"), seed=st.integers(0, 1000))
def test_max_score_takes_a_best_total(eps, seed):
    eps = [replace(e, available=True, pool_priority=0, max_inflight=None) for e in eps]
    assume(any(e.kv_usage is None or e.stale or e.kv_usage < 0.95 for e in eps))
    d = Scheduler(SchedulerConfig(record_candidates=64)).decide(
        req(), eps, PRESETS["long-context"], now=0.0, wall=0.0, rng=random.Random(seed))
    allowed = [c for c in d.candidates if not c.flags]
    best = max(c.total for c in allowed)
    chosen = next(c for c in d.candidates if c.endpoint_id == d.chosen)
    assert chosen.total == pytest.approx(best)


@settings(max_examples=150, deadline=None)
@given(eps=fleets(max_size=12, model="m"), session=st.sampled_from([None, "s1"]),
       seed=st.integers(0, 1000), tidy=st.booleans())
def test_max_score_shortcut_agrees_with_the_picker(eps, session, seed, tidy):
    """The scheduler answers max-score from the head of its top-k when that head is unique;
    softmax at temperature 0 runs the max-score picker itself: the two must always agree."""
    if tidy:  # no filter drops anything: the fused scan's path
        eps = [replace(e, available=True, stale=False, pool_priority=0,
                       running=e.running or 0.0, waiting=e.waiting or 0.0) for e in eps]
    for name in PRESETS:
        fast = resolve(name, {"picker": "max-score"})
        ref = resolve(name, {"picker": "softmax", "param": 0.0})
        a, b = (Scheduler().decide(req(session_key=session), eps, s, now=50.0, wall=0.0,
                                   rng=random.Random(seed)) for s in (fast, ref))
        assert a.chosen == b.chosen and a.note == b.note
        assert [(c.endpoint_id, c.scores, c.total, c.flags) for c in a.candidates] == \
            [(c.endpoint_id, c.scores, c.total, c.flags) for c in b.candidates]


@settings(max_examples=300, deadline=None)
@given(eps=fleets(max_size=12), adapter=st.sampled_from([None, "a1"]), tidy=st.booleans(),
       spoil=st.sampled_from([None, "model", "adapter", "available", "stale", "pool_priority",
                              "running", "waiting"]))
def test_fused_scan_applies_exactly_when_no_filter_drops_and_computes_the_loads(eps, adapter,
                                                                                 tidy, spoil):
    r = req(model=adapter or "m", adapter=adapter)
    if tidy:
        eps = [replace(e, model="m", adapters=frozenset({"a1"}), available=True, stale=False,
                       pool_priority=10, running=e.running or 1.0, waiting=e.waiting or 0.0)
               for e in eps]
        if spoil is not None:  # break one endpoint in one way
            eps[-1] = replace(eps[-1], **{
                "model": {"model": "other"}, "adapter": {"adapters": frozenset()},
                "available": {"available": False}, "stale": {"stale": True},
                "pool_priority": {"pool_priority": 20}, "running": {"running": None},
                "waiting": {"waiting": None}}[spoil])
    loads = _unfiltered_loads(r, eps)
    cfg = SchedulerConfig()
    nothing_dropped = (serves(r, eps).kept is eps and healthy(eps, 0.0).kept is eps
                       and pool_priority(eps, cfg).kept is eps)
    fresh = all(not e.stale and e.running is not None and e.waiting is not None for e in eps)
    assert (loads is not None) == (nothing_dropped and fresh)
    if loads is not None:
        assert loads == [load_estimate(e) for e in eps] == ctx_for(eps).loads


def test_ties_on_an_idle_fleet_spread_instead_of_piling_on_one_replica():
    eps = [ep(i) for i in range(4)]
    rng = random.Random(7)
    picks = [pick_max_score([0.5] * 4, eps, None, **pick_args(rng=rng)) for _ in range(400)]
    counts = [picks.count(i) for i in range(4)]
    assert min(counts) > 60, counts  # a fixed tie order would give [400, 0, 0, 0]
