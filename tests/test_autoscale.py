"""The autoscaler's pure core (llmgw.fleet.autoscale): each metric's arithmetic, the trend, panic, the
delays, idle to zero, cold demand, pinned, blocked, the bounds, the growth bound, capacity learning,
the wire and the persisted state — then the rule's properties with hypothesis, run against a small
simulated fleet (replicas that start after a cold start, a closed-loop load)."""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.fleet.autoscale import INPUT_KEYS, TTFT_BUCKETS, Autoscaler, Decision, RouterLoad, Rule, Sample, merge
from llmgw.fleet.autoscale_load import quantile, slope, ttft_counts
from llmgw.route.counters import LATENCY_BUCKETS

N = len(TTFT_BUCKETS) + 1


def feed(a: Autoscaler, t0: float, t1: float, step: float = 1.0, **kw: object) -> float:
    """Samples from t0 to t1 (excluded) every `step`, the same figures each; returns t1."""
    t = t0
    while t < t1:
        a.observe(Sample(t=t, **{"ready": 1, "starting": 0, **kw}))  # type: ignore[arg-type]
        t += step
    return t1


def run(a: Autoscaler, t0: float, t1: float, current: int, **kw: object) -> list[Decision]:
    """A sample and a decision every second from t0 to t1 (excluded), the count staying `current`."""
    out = []
    for t in range(int(t0), int(t1)):
        a.observe(Sample(t=float(t), **{"ready": current, "starting": 0, **kw}))  # type: ignore[arg-type]
        out.append(a.decide(float(t), current))
    return out


def hist(ttft: float, n: int) -> list[int]:
    h = [0] * N
    h[bisect_left(TTFT_BUCKETS, ttft)] += n
    return h


def simulate(a: Autoscaler, load: Callable[[float], int], t0: float, t1: float, count: int, *, cold: float = 5.0,
             cap: float = 4.0, pinned: int | None = None) -> list[Decision]:
    """A model under `load(t)` clients (closed loop) on replicas that each take `cap` requests before
    the engine queues (engine_waiting) and TTFT grows (0.2 s, then 2 s more per cap beyond it).
    The count in force is what the autoscaler decides; a new replica is ready `cold` seconds later,
    a removed one goes at once (starting ones first). One sample and one decision a second."""
    ready, starting, ttft, arrivals, out = count, [], [0] * N, 0, []
    t = t0
    while t < t1:
        ready += sum(1 for x in starting if x <= t)
        starting = [x for x in starting if x > t]
        c = load(t)
        arrivals += c
        if ready:
            per = c / ready
            ttft[bisect_left(TTFT_BUCKETS, 0.2 + max(0.0, per - cap) / cap * 2)] += c
            s = Sample(t, ready, len(starting), inflight=c, arrivals=arrivals, engine_waiting=max(0.0, c - ready * cap),
                       kv_usage=min(1.0, per / (2 * cap)), ttft=tuple(ttft))
        else:
            s = Sample(t, 0, len(starting), queued=c, cold_waiting=c, arrivals=arrivals, ttft=tuple(ttft))
        a.observe(s)
        d = a.decide(t, count, pinned=pinned)
        if d.desired > count:
            starting += [t + cold] * (d.desired - count)
        for _ in range(count - d.desired):
            if starting:
                starting.pop()
            else:
                ready -= 1
        count = d.desired
        out.append(d)
        t += 1.0
    return out


# -- the wire and the merge -------------------------------------------------------------------------------
def test_ttft_buckets_are_the_routers() -> None:
    assert TTFT_BUCKETS == LATENCY_BUCKETS


def test_router_load_round_trips_and_refuses_garbage() -> None:
    load = RouterLoad(inflight=3, queued=2, cold_waiting=1, arrivals=40, engine_waiting=1.5, kv_usage=0.4,
                      ttft=tuple(range(N)))
    assert RouterLoad.from_wire(load.to_wire()) == load
    assert RouterLoad.from_wire({}) == RouterLoad()
    assert RouterLoad.from_wire({"inflight": 1, "new_field": "x"}).inflight == 1
    assert RouterLoad.from_wire({"kv_usage": 1.0000000000000002}).kv_usage == 1.0
    for bad, field in [([], "object"), ({"inflight": -1}, "inflight"), ({"queued": 1.5}, "queued"),
                       ({"arrivals": True}, "arrivals"), ({"engine_waiting": "3"}, "engine_waiting"),
                       ({"engine_waiting": math.nan}, "engine_waiting"), ({"kv_usage": 1.5}, "kv_usage"),
                       ({"ttft": [1] * (N + 1)}, "ttft"), ({"ttft": [1, -1]}, "ttft"), ({"ttft": "x"}, "ttft")]:
        with pytest.raises(ValueError, match=field):
            RouterLoad.from_wire(bad)


def test_merge_sums_the_routers_and_takes_the_engines_figures_once() -> None:
    a = RouterLoad(inflight=3, queued=1, cold_waiting=1, arrivals=10, engine_waiting=4.0, kv_usage=0.5, ttft=(1, 2))
    b = RouterLoad(inflight=2, queued=0, arrivals=5, engine_waiting=3.0, kv_usage=None, ttft=())
    s = merge(7.0, [a, b], ready=2, starting=1)
    assert (s.t, s.ready, s.starting, s.inflight, s.queued, s.cold_waiting, s.arrivals) == (7.0, 2, 1, 5, 1, 1, 15)
    assert (s.engine_waiting, s.kv_usage) == (4.0, 0.5)
    assert s.ttft == (1, 2) + (0,) * (N - 2)
    assert merge(0.0, [], 0, 0) == Sample(0.0, 0, 0)


def test_window_arithmetic() -> None:
    assert slope([(0, 1), (1, 3), (2, 5)]) == pytest.approx(2.0)
    assert slope([(0, 1)]) == 0.0 and slope([(1, 1), (1, 5)]) == 0.0
    # p90 of 10 TTFTs in (0.5, 1.0]: 0.5 + 0.5 × 9/10; in +Inf: the last bound; nothing: None
    assert quantile(hist(0.7, 10), 0.9) == pytest.approx(0.95)
    assert quantile(hist(1000.0, 3), 0.9) == TTFT_BUCKETS[-1]
    assert quantile([0] * N, 0.9) is None
    # growth step by step; a counter that goes back (a router restarted) counts as no change
    samples = [Sample(0, 1, 0, ttft=tuple(hist(0.3, 5))), Sample(1, 1, 0, ttft=()),
               Sample(2, 1, 0, ttft=tuple(hist(0.3, 2))), Sample(3, 1, 0, ttft=tuple(hist(0.3, 6)))]
    assert sum(ttft_counts(samples)) == 6


# -- each metric's arithmetic -----------------------------------------------------------------------------
def test_concurrency_is_in_flight_plus_queued_over_the_target() -> None:
    a = Autoscaler(Rule(max=10, target=4.0, down_delay_s=0), now=0.0)
    feed(a, 0, 60, ready=2, inflight=8, queued=2)
    d = a.decide(59.0, current=2)
    assert (d.raw, d.desired, d.mode, d.inputs["concurrency"]) == (3, 3, "stable", 10.0)
    assert "concurrency 10 / target 4" in d.rule and d.reason == "concurrency 10 against target 4"
    assert a.history[-1] is d and a.last is d and d.direction == "up"
    assert set(d.inputs) == set(INPUT_KEYS) and set(a.decide(500.0, 3).inputs) == set(INPUT_KEYS)


def test_a_rising_trend_scales_ahead_by_the_cold_start() -> None:
    a = Autoscaler(Rule(max=40, target=4.0, cold_start_s=30), now=0.0)
    for t in range(60):
        a.observe(Sample(float(t), 2, 0, inflight=t))
    d = a.decide(59.0, current=8)
    assert d.inputs["slope_per_s"] == pytest.approx(1.0)
    assert d.inputs["concurrency_predicted"] == pytest.approx(56.5 + 30)  # C_p (54..59) + slope × cold start
    assert d.raw == 22  # ceil(86.5 / 4), not ceil(C_w / 4) = 8
    a.cold_start_measured(10.0)
    assert a.decide(59.0, current=8).raw == math.ceil((56.5 + 10) / 4)
    # a step that has levelled off is the level it reached: no ramp extrapolated from the window
    c = Autoscaler(Rule(max=40, target=4.0, cold_start_s=30), now=0.0)
    for t in range(60):
        c.observe(Sample(float(t), 2, 0, inflight=0 if t < 40 else 12))
    d = c.decide(59.0, current=3)
    assert 11 < d.inputs["concurrency_predicted"] <= 12.0 and d.raw == 3  # the level reached, no ramp added
    # falling: the mean over the window, no prediction
    b = Autoscaler(Rule(max=20, target=4.0), now=0.0)
    for t in range(60):
        b.observe(Sample(float(t), 2, 0, inflight=60 - t))
    d = b.decide(59.0, current=8)
    assert d.inputs["concurrency_predicted"] == d.inputs["concurrency"] and d.raw == math.ceil(d.inputs["concurrency"] / 4)


def test_a_noisy_plateau_is_not_projected() -> None:
    # a plateau of ~21 whose last few seconds swell to 23.5 by chance, the window's slope faintly up:
    # the level is the window's line (~22.2), not the panic window's swell — 6 replicas, not 7
    vals = [19, 22, 22, 19, 20, 22, 21, 22, 18, 22, 18, 21, 20, 22, 19, 19, 23, 24, 23, 24]
    a = Autoscaler(Rule(max=20, target=4.0, cold_start_s=6.5, window_s=20, panic_window_s=4), now=0.0)
    for t, v in enumerate(vals):
        a.observe(Sample(float(t), 6, 0, inflight=v))
    d = a.decide(19.0, current=5)
    assert d.inputs["slope_per_s"] > 0 and d.inputs["concurrency_panic"] == 23.5
    assert d.inputs["concurrency_predicted"] < 23.5 and d.raw == 6, d


def test_a_lone_request_into_an_idle_model_predicts_no_crowd() -> None:
    # what a follower's cold start looked like at the leader: one request, a steep slope over a short
    # window, a cold start of 30 s (none measured yet): the projection is capped at one growth step
    a = Autoscaler(Rule(min=0, max=4, target=4.0, cold_start_s=30, idle_to_zero_s=600), now=7.0)
    for t in range(7, 12):  # a leader a few seconds old: a short window
        a.observe(Sample(float(t), 0, 0))
    a.observe(Sample(12.0, 0, 0, queued=1, cold_waiting=1, arrivals=1))
    d = a.decide(12.0, current=0)
    assert d.desired == 1 and d.mode == "cold"
    a.observe(Sample(13.0, 0, 1, queued=1, cold_waiting=1, arrivals=1))
    d = a.decide(13.0, current=1)
    assert d.inputs["slope_per_s"] > 0
    assert d.inputs["concurrency_predicted"] <= 2 * 1  # max(C_p, C now) × max_scale_up_rate
    assert d.desired == 1, d


def test_kv_usage_is_the_cache_in_use_over_the_target() -> None:
    a = Autoscaler(Rule(max=10, metric="kv_usage", target=0.6), now=0.0)
    feed(a, 0, 60, ready=2, inflight=5, kv_usage=0.9)
    assert a.decide(59.0, current=2).raw == 3  # ceil(2 × 0.9 / 0.6)
    b = Autoscaler(Rule(max=10, metric="kv_usage", target=0.6), now=0.0)
    feed(b, 0, 60, ready=2, inflight=5)
    assert b.decide(59.0, current=2).raw == 2  # no KV figure: hold


def test_queue_breach_asks_ready_times_the_ratio_and_learns_the_capacity() -> None:
    a = Autoscaler(Rule(max=10, metric="queue", target=2.0), now=0.0)
    feed(a, 0, 60, ready=2, inflight=10, engine_waiting=6.0, queued=2)
    d = a.decide(59.0, current=2)
    assert d.inputs["queue_per_replica"] == 4.0 and d.raw == 4  # ceil(2 × 4 / 2)
    assert a.capacity == pytest.approx(12 / 2 * 0.9)  # C per replica below the breach


def test_ttft_p90_breach_and_the_band_and_the_learned_capacity() -> None:
    rule = Rule(max=10, metric="ttft_p90", target=1.0, down_delay_s=0)
    a = Autoscaler(rule, now=0.0)
    ttft = [0] * N
    for t in range(60):
        ttft = [x + y for x, y in zip(ttft, hist(2.0, 10))]
        a.observe(Sample(float(t), 2, 0, inflight=10, ttft=tuple(ttft)))
    d = a.decide(59.0, current=2)
    p90 = quantile(hist(2.0, 1), 0.9)
    assert d.inputs["ttft_p90_s"] == pytest.approx(p90) and d.raw == math.ceil(2 * p90)
    assert a.capacity == pytest.approx(4.5)
    # inside the band (0.9–1.1 × target): hold; no TTFT at all and no capacity learned: hold; no load: 0
    b = Autoscaler(rule, now=0.0)
    ttft = [0] * N
    for t in range(60):
        ttft = [x + y for x, y in zip(ttft, hist(0.97, 10))]
        b.observe(Sample(float(t), 3, 0, inflight=10, ttft=tuple(ttft)))
    assert quantile(hist(0.97, 1), 0.9) == pytest.approx(0.95)
    assert b.decide(59.0, current=3).raw == 3
    c = Autoscaler(rule, now=0.0)
    feed(c, 0, 60, ready=3, inflight=5)
    assert c.decide(59.0, current=3).raw == 3
    feed(c, 60, 180, ready=3)
    assert c.decide(179.0, current=3).raw == 0


@pytest.mark.parametrize("metric,target", [("ttft_p90", 1.0), ("queue", 1.0)])
def test_a_breach_then_a_steady_load_settles_without_flapping(metric: str, target: float) -> None:
    a = Autoscaler(Rule(max=10, metric=metric, target=target, window_s=30, panic_window_s=3, down_delay_s=30), 0.0)
    out = simulate(a, lambda t: 18, 0.0, 900.0, count=2, cap=4.0)
    tail = {d.desired for d in out[-300:]}
    assert len(tail) == 1, f"the count still moves at the end: {sorted(tail)}"
    final = tail.pop()
    # enough for the SLO (the plant: TTFT ≤ 1 s up to 1.4 × cap per replica; queue ≤ 1 per replica), not wasteful
    assert 18 / final <= 4.0 * 1.4 and final <= 6, final
    assert a.capacity is not None
    assert sum(1 for x, y in zip(out, out[1:]) if x.desired != y.desired) <= 8


# -- panic, delays, trend ---------------------------------------------------------------------------------
def test_a_burst_panics_past_the_up_delay_and_does_not_scale_down_in_panic() -> None:
    a = Autoscaler(Rule(max=20, target=4.0, up_delay_s=30, down_delay_s=0), now=0.0)
    feed(a, 0, 60, ready=2, inflight=8)
    assert a.decide(59.0, current=2).desired == 2
    for t in range(60, 66):
        a.observe(Sample(float(t), 2, 0, inflight=100))
        d = a.decide(float(t), current=2)
        if d.changed():
            break
    assert d.mode == "panic" and d.desired == 4 and t <= 65  # ceil(2 × 2.0): the growth bound
    assert "max scale-up rate ×2 (4)" in d.limited_by
    feed(a, t + 1, t + 30, ready=4, inflight=4)  # the burst is over
    d = a.decide(t + 29.0, current=4)
    assert d.mode == "panic" and d.desired == 4 and "panic: no scale-down" in d.limited_by
    feed(a, t + 30, t + 80, ready=4, inflight=4)
    d = a.decide(t + 79.0, current=4)
    assert d.mode == "stable" and d.desired == 1


def test_up_and_down_delays() -> None:
    a = Autoscaler(Rule(max=10, target=4.0, up_delay_s=10, down_delay_s=20, window_s=10, panic_window_s=2,
                        panic_threshold=5.0), now=0.0)
    assert all(d.desired == 2 for d in run(a, 0, 30, 2, inflight=8))
    for d in run(a, 30, 39, 2, inflight=16):
        assert d.desired == 2 and "up delay 10s" in d.limited_by, (d.t, d.raw)
    ups = run(a, 39, 50, 2, inflight=16)
    first = next(d for d in ups if d.changed())
    assert first.desired == 4 and first.t == 30 + 10  # asked for 4 (the trend) since 30: up after 10 s
    current, downs = 4, []
    for t in range(50, 90):  # the load falls to 4: the window's raw says 4 until 52, 3 from 53, 2 from 56, 1 from 59
        a.observe(Sample(float(t), current, 0, inflight=4))
        d = a.decide(float(t), current)
        if d.changed():
            downs.append((d.t, d.desired))
        current = d.desired
    assert downs == [(73.0, 3), (76.0, 2), (79.0, 1)]  # each 20 s after the raw fell below the count


def test_a_new_autoscaler_watches_for_the_down_delay_before_scaling_down() -> None:
    a = Autoscaler(Rule(max=10, target=4.0, down_delay_s=60), now=100.0)
    out = run(a, 100, 161, 5)
    assert all(d.raw == 0 and d.desired == 5 and "down delay 60s" in d.limited_by for d in out[:60])
    assert out[60].desired == 1


def test_no_sample_in_the_window_holds() -> None:
    a = Autoscaler(Rule(), now=0.0)
    d = a.decide(5.0, current=3)
    assert d.desired == 3 and "no load sample" in d.rule
    feed(a, 0, 5, ready=3)
    assert a.decide(500.0, current=3).desired == 3


# -- zero, cold, pinned, blocked, bounds ------------------------------------------------------------------
def test_idle_to_zero_and_the_floor_before_it() -> None:
    a = Autoscaler(Rule(min=0, max=4, idle_to_zero_s=30, down_delay_s=0), now=0.0)
    a.observe(Sample(0.0, 2, 0, arrivals=4))
    a.observe(Sample(1.0, 2, 0, arrivals=5))  # an arrival at 1 (answered between samples)
    for t in range(1, 31):
        a.observe(Sample(float(t), 2, 0, arrivals=5))
        d = a.decide(float(t), current=2 if t == 1 else 1)
        assert d.desired == 1 and d.mode == "stable", t
    assert "min 1 until idle for 30s" in d.limited_by
    a.observe(Sample(31.0, 1, 0, arrivals=5))
    d = a.decide(31.0, current=1)
    assert (d.desired, d.mode) == (0, "idle") and "idle for 30s" in d.reason
    a.observe(Sample(32.0, 0, 0, arrivals=5))
    assert (a.decide(32.0, current=0).desired, a.last.mode) == (0, "idle")
    a.observe(Sample(33.0, 0, 0, arrivals=6))  # an arrival, already answered or rejected: still demand
    d = a.decide(33.0, current=0)
    assert (d.desired, d.mode) == (1, "cold")


def test_cold_waiters_at_zero_start_a_replica_at_once_even_with_an_up_delay() -> None:
    a = Autoscaler(Rule(min=0, max=4, idle_to_zero_s=60, up_delay_s=30), now=0.0)
    a.observe(Sample(0.0, 0, 0, queued=1, cold_waiting=1, arrivals=1))
    d = a.decide(0.0, current=0)
    assert (d.desired, d.mode, d.raw) == (1, "cold", 1) and "cold start" in d.reason
    a.observe(Sample(1.0, 0, 1, queued=3, cold_waiting=3, arrivals=3))
    assert a.decide(1.0, current=1).desired == 1  # the starting one counts


def test_pinned_overrides_the_rule_and_the_bounds() -> None:
    a = Autoscaler(Rule(max=4, target=4.0), now=0.0)
    feed(a, 0, 60, ready=2, inflight=40)
    d = a.decide(59.0, current=2, pinned=7)
    assert (d.desired, d.mode, d.raw) == (7, "pinned", 10)
    assert d.limited_by == ("pinned at 7 (llmgw ctl scale)",) and "pinned at 7" in d.reason
    d = a.decide(60.0, current=7, pinned=7, blocked="hold on rack r1")
    assert not d.changed() and d.limited_by == ("pinned at 7 (llmgw ctl scale)", "placement: hold on rack r1")


def test_blocked_is_reported_and_stops_the_count_rising() -> None:
    a = Autoscaler(Rule(max=10, target=4.0), now=0.0)
    feed(a, 0, 60, ready=2, inflight=20)
    d = a.decide(59.0, current=3, blocked="power budget of pdu p1: 4800 W of 5000 W")
    assert d.desired == 3 and "placement: power budget of pdu p1: 4800 W of 5000 W" in d.limited_by
    b = Autoscaler(Rule(min=0, idle_to_zero_s=60), now=0.0)
    b.observe(Sample(0.0, 0, 0, queued=1, cold_waiting=1))
    assert b.decide(0.0, current=0, blocked="no room").desired == 1  # a cold start still asks


def test_bounds_and_the_growth_rate() -> None:
    a = Autoscaler(Rule(min=2, max=5, target=1.0), now=0.0)
    feed(a, 0, 60, ready=1, inflight=100)
    d = a.decide(59.0, current=1)
    assert d.desired == 2 and "max scale-up rate ×2 (2)" in d.limited_by
    d = a.decide(59.0, current=3)
    assert d.desired == 5 and "max 5" in d.limited_by
    b = Autoscaler(Rule(min=2, max=5, target=1.0, down_delay_s=0), now=0.0)
    feed(b, 0, 60, ready=3)
    d = b.decide(59.0, current=3)
    assert d.desired == 2 and "min 2" in d.limited_by
    c = Autoscaler(Rule(max=50, target=1.0, max_scale_up_rate=1.0), now=0.0)
    feed(c, 0, 60, ready=3, inflight=40)
    assert c.decide(59.0, current=3).desired == 4  # rate 1: still one more a decision


@pytest.mark.parametrize("metric", ["concurrency", "queue", "ttft_p90"])
def test_a_starting_replica_counts_as_coming_capacity(metric: str) -> None:
    """12 clients on replicas that take 4 each: 3 are needed. Nothing becomes ready during the test: the
    queue and the TTFT stay breached, yet nothing more is asked than the first decision asked (reached
    in steps of the growth bound). The SLO metrics' ceil(ready × r) overshoots (queue 8, TTFT 5): the
    learned capacity brings that down once the replicas are ready (test_a_breach_then_...)."""
    rule = Rule(max=10, metric=metric, target=4.0 if metric == "concurrency" else 1.0)
    a = Autoscaler(rule, now=0.0)
    out = simulate(a, lambda t: 12, 0.0, 100.0, count=1, cold=200.0)
    ups = [(d.t, d.current, d.desired) for d in out if d.direction == "up"]
    assert [u[2] for u in ups] == {"concurrency": [2, 3], "queue": [2, 4, 8], "ttft_p90": [2, 4, 5]}[metric], ups
    assert ups[-1][0] <= 3 and out[-1].ready == 1 and out[-1].starting == out[-1].desired - 1
    # after a step, the windows catching up are the only reason for more: nothing once a whole window saw it
    b = Autoscaler(rule, now=0.0)
    out = simulate(b, lambda t: 2 if t < 60 else 12, 0.0, 200.0, count=1, cold=500.0)
    assert max(d.desired for d in out) <= (4 if metric == "concurrency" else 5)
    assert not [d for d in out if d.changed() and d.t >= 60 + rule.window_s]


# -- rule, state ------------------------------------------------------------------------------------------
def test_rule_checks_name_the_field_and_from_config_is_duck_typed() -> None:
    for kw, field in [({"min": -1}, "min"), ({"max": 0}, "max"), ({"min": 3, "max": 2}, "max"),
                      ({"metric": "rps"}, "metric"), ({"target": 0}, "target"),
                      ({"metric": "kv_usage", "target": 1.5}, "target"), ({"window_s": 0}, "window_s"),
({"tolerance": 1.0}, "tolerance"),
                      ({"max_scale_up_rate": 0.5}, "max_scale_up_rate"), ({"min": 0}, "idle_to_zero_s"),
                      ({"idle_to_zero_s": 10}, "idle_to_zero_s"), ({"cold_start_s": math.inf}, "cold_start_s"),
                      ({"down_delay_s": True}, "down_delay_s")]:
        with pytest.raises(ValueError, match=field):
            Rule(**kw)  # type: ignore[arg-type]
    cfg = SimpleNamespace(min=0, max=8, metric="ttft_p90", target=0.5, window_s=30, panic_window_s=3,
                          panic_threshold=3.0, up_delay_s=5, down_delay_s=60, tolerance=0.2,
                          max_scale_up_rate=4.0, idle_to_zero_s=300, cold_start_s=20, extra="ignored")
    rule = Rule.from_config(cfg)
    assert rule.settings() == {k: v for k, v in vars(cfg).items() if k != "extra"}
    assert Rule.from_config(SimpleNamespace(max=6)) == Rule(max=6)


def test_the_configs_autoscale_section_makes_a_rule() -> None:
    from llmgw.config.autoscale import AutoscaleConfig
    assert Rule.from_config(AutoscaleConfig()) == Rule()
    c = AutoscaleConfig(min=0, max=9, metric="ttft_p90", target=0.8, window_s=5, panic_window_s=10,
                        idle_to_zero_s=60, tolerance=0.9, cold_start_s=0.5)
    assert Rule.from_config(c).settings() == {k: getattr(c, k) for k in Rule().settings()}


def test_cold_start_is_the_median_of_the_last_five() -> None:
    a = Autoscaler(Rule(cold_start_s=30), now=0.0)
    assert a.cold_start_s == 30.0
    for x in (100, 10, 12, 11, 14, 13):
        a.cold_start_measured(x)
    assert a.cold_start_s == 12.0 and a.cold_starts == (10, 12, 11, 14, 13)
    with pytest.raises(ValueError):
        a.cold_start_measured(-1)


def test_state_round_trips_and_a_new_metric_drops_the_capacity() -> None:
    rule = Rule(metric="queue", target=2.0, max=10)
    a = Autoscaler(rule, now=0.0)
    feed(a, 0, 60, ready=2, inflight=10, engine_waiting=8.0)
    a.decide(59.0, current=2)
    a.cold_start_measured(12.5)
    b = Autoscaler.from_doc(rule, a.to_doc(), now=1000.0)
    assert (b.capacity, b.cold_starts) == (a.capacity, a.cold_starts) and b.capacity is not None
    assert Autoscaler.from_doc(Rule(metric="queue", target=3.0, max=10), a.to_doc(), 0.0).capacity is None
    assert Autoscaler.from_doc(rule, {}, 0.0).capacity is None
    a.rule = Rule(metric="ttft_p90", target=1.0, max=10)
    assert a.capacity is None and a.cold_starts == (12.5,)


# -- properties -------------------------------------------------------------------------------------------
json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
                           lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=12), kids, max_size=4),
                           max_leaves=10)
docs = st.fixed_dictionaries({}, optional={"v": json_values, "cold_starts": json_values, "capacity": json_values,
                                           "capacity_for": json_values})


@settings(max_examples=200, deadline=None)
@given(doc=json_values | docs)
def test_garbage_docs_load_or_raise_value_error(doc: object) -> None:
    try:
        Autoscaler.from_doc(Rule(metric="queue", target=2.0), doc, 0.0)
    except ValueError:
        pass
    try:
        RouterLoad.from_wire(doc)
    except ValueError:
        pass


@pytest.mark.parametrize("doc", [None, [], {"cold_starts": "x"}, {"cold_starts": [1, "x"]}, {"cold_starts": [-1]},
                                 {"capacity": "big"}, {"capacity": 0}, {"capacity": math.inf}, {"capacity_for": "queue"}])
def test_garbage_docs_raise_value_error(doc: object) -> None:
    with pytest.raises(ValueError):
        Autoscaler.from_doc(Rule(), doc, 0.0)


@settings(max_examples=60, deadline=None)
@given(colds=st.lists(st.floats(0, 1e4), max_size=8), metric=st.sampled_from(["concurrency", "queue", "ttft_p90"]),
       load=st.integers(1, 40))
def test_state_round_trip(colds: list[float], metric: str, load: int) -> None:
    rule = Rule(metric=metric, target=1.0, max=10)
    a = Autoscaler(rule, 0.0)
    simulate(a, lambda t: load, 0.0, 40.0, count=1)
    for x in colds:
        a.cold_start_measured(x)
    b = Autoscaler.from_doc(rule, a.to_doc(), 5.0)
    assert (b.capacity, b.cold_starts, b.cold_start_s) == (a.capacity, a.cold_starts, a.cold_start_s)
    assert b.to_doc() == a.to_doc()


rules = st.builds(
    lambda lo, span, metric, window, panic, down, up, target: Rule(
        min=lo, max=max(lo, 1) + span, metric=metric, target=target if metric != "kv_usage" else min(target, 1.0) / 2,
        window_s=window, panic_window_s=min(panic, window), down_delay_s=down, up_delay_s=up,
        idle_to_zero_s=20.0 if lo == 0 else 0.0),
    st.integers(0, 3), st.integers(0, 6), st.sampled_from(["concurrency", "queue", "kv_usage", "ttft_p90"]),
    st.integers(5, 30), st.integers(1, 6), st.integers(0, 30), st.integers(0, 5), st.floats(0.5, 8.0))
samples = st.builds(lambda ready, starting, inflight, queued, cold, ew, kv: Sample(
    0.0, ready, starting, inflight=inflight, queued=queued, cold_waiting=min(cold, queued), engine_waiting=ew,
    kv_usage=kv), st.integers(0, 8), st.integers(0, 4), st.integers(0, 100), st.integers(0, 50), st.integers(0, 50),
    st.floats(0, 100), st.none() | st.floats(0, 1))


@settings(max_examples=150, deadline=None)
@given(rule=rules, seq=st.lists(st.tuples(samples, st.integers(0, 12), st.none() | st.text(min_size=1, max_size=5)),
                                min_size=1, max_size=40))
def test_never_below_min_nor_above_max(rule: Rule, seq: list[tuple[Sample, int, str | None]]) -> None:
    a = Autoscaler(rule, 0.0)
    for i, (s, current, blocked) in enumerate(seq):
        a.observe(Sample(float(i), **{k: getattr(s, k) for k in vars(s) if k != "t"}))
        d = a.decide(float(i), current, blocked=blocked)
        assert rule.min <= d.desired <= rule.max and d.mode in ("stable", "panic", "cold", "idle")


@settings(max_examples=40, deadline=None)
@given(rule=rules, load=st.integers(1, 60), start=st.integers(0, 9), cold=st.integers(0, 10))
def test_a_steady_load_gives_a_steady_count(rule: Rule, load: int, start: int, cold: int) -> None:
    """After window_s + down_delay_s (and the replicas' start) the count no longer moves — for the
    figures that do not depend on the count (concurrency, kv); the SLO metrics converge in a few
    breaches (test_a_breach_then_a_steady_load_settles_without_flapping) and then hold too."""
    start = min(max(start, rule.min, 1), rule.max)
    a = Autoscaler(rule, 0.0)
    settle = rule.window_s + rule.down_delay_s + 2 * cold + rule.up_delay_s + 1
    length = settle + 3 * rule.window_s if rule.metric in ("concurrency", "kv_usage") else 1200
    out = simulate(a, lambda t: load, 0.0, float(length), count=start, cold=float(cold))
    tail = out[int(settle):] if rule.metric in ("concurrency", "kv_usage") else out[-int(rule.window_s + rule.down_delay_s + 1):]
    assert len({d.desired for d in tail}) == 1, [(d.t, d.desired, d.raw, d.mode) for d in out if d.changed()]


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 4), factor=st.floats(2.0, 6.0), threshold=st.floats(1.2, 3.0), up=st.integers(0, 60),
       panic=st.integers(2, 10))
def test_a_burst_scales_up_within_the_panic_window(n: int, factor: float, threshold: float, up: int, panic: int) -> None:
    factor = max(factor, threshold)
    rule = Rule(max=64, target=4.0, panic_threshold=threshold, up_delay_s=up, panic_window_s=panic)
    a = Autoscaler(rule, 0.0)
    feed(a, 0, 60, ready=n, inflight=4 * n)
    assert a.decide(59.0, current=n).desired == n
    burst = math.ceil(factor * 4 * n)
    for t in range(60, 60 + panic):
        a.observe(Sample(float(t), n, 0, inflight=burst))
        if a.decide(float(t), current=n).desired > n:
            return
    pytest.fail(f"no scale-up within the panic window ({panic}s) for a burst ×{factor:.2f}")


@settings(max_examples=60, deadline=None)
@given(idle=st.integers(1, 100), start=st.integers(1, 4), active=st.integers(0, 50))
def test_no_demand_for_idle_to_zero_s_scales_to_zero(idle: int, start: int, active: int) -> None:
    a = Autoscaler(Rule(min=0, max=4, idle_to_zero_s=idle, down_delay_s=10), 0.0)
    out = simulate(a, lambda t: 3 if t < active else 0, 0.0, float(active + idle + 1), count=start)
    assert out[-1].desired == 0 and out[-1].mode == "idle"
    assert all(d.desired >= 1 for d in out if d.t < active + idle - 1)


@settings(max_examples=100, deadline=None)
@given(rule=rules, s=samples, arrived=st.booleans())
def test_demand_at_zero_gets_a_replica_at_the_next_decision(rule: Rule, s: Sample, arrived: bool) -> None:
    a = Autoscaler(rule, 0.0)
    a.observe(Sample(0.0, 0, 0, arrivals=10))
    demand = Sample(1.0, 0, 0, queued=s.queued, cold_waiting=s.cold_waiting, arrivals=11 if arrived else 10)
    a.observe(demand)
    if not (demand.queued or arrived):
        demand = Sample(1.0, 0, 0, queued=1, cold_waiting=1)
        a.observe(Sample(1.5, 0, 0, queued=1, cold_waiting=1))
    assert a.decide(2.0, current=0).desired >= 1


@settings(max_examples=40, deadline=None)
@given(metric=st.sampled_from(["concurrency", "queue", "ttft_p90"]), load=st.integers(5, 40), cold=st.integers(10, 40))
def test_no_second_scale_up_for_the_same_load_while_one_starts(metric: str, load: int, cold: int) -> None:
    """A steady load on replicas still starting: the count never goes past what the first scale-up asked
    (however the queue or the TTFT grow meanwhile)."""
    rule = Rule(max=64, metric=metric, target=4.0 if metric == "concurrency" else 1.0)
    a = Autoscaler(rule, 0.0)
    out = simulate(a, lambda t: load, 0.0, float(cold), count=1, cold=float(cold))
    ups = [d for d in out if d.direction == "up"]
    if ups:
        first = max(ups[0].raw, int(ups[0].inputs["raw_panic"] or 0))
        assert all(d.desired <= first for d in out), [(d.t, d.current, d.desired, d.mode, d.rule) for d in ups]
