"""Windowed cache-hit counters: prefix decisions and the engines' own hit rates, per model and replica."""

from __future__ import annotations

import pytest

from llmgw.route.cache_stats import CacheStats


def test_decisions_per_replica_and_model_with_a_series() -> None:
    cs = CacheStats(window_s=60, bucket_s=10)
    for t, rep, hit in ((1, "a/0", True), (2, "a/0", False), (3, "a/1", True), (15, "a/0", True), (16, "b/0", False)):
        cs.decision(rep.split("/")[0], rep, hit, t)
    s = cs.summary(now=19)
    assert (s["window_s"], s["bucket_s"]) == (60, 10)
    assert (s["total"]["prefix_hits"], s["total"]["prefix_misses"]) == (3, 2)
    models = {m["model"]: m for m in s["models"]}
    assert models["a"]["prefix_hit_rate"] == pytest.approx(0.75) and models["b"]["prefix_hit_rate"] == 0
    reps = {r["replica"]: r for r in s["replicas"]}
    assert reps["a/0"]["model"] == "a" and (reps["a/0"]["prefix_hits"], reps["a/0"]["prefix_misses"]) == (2, 1)
    # six buckets, oldest first; the two last hold the data, the others are empty
    assert reps["a/0"]["prefix_hit_rate_series"] == [None, None, None, None, 0.5, 1.0]
    assert s["total"]["engine_hit_rate"] is None and reps["a/0"]["engine_hit_rate_series"] == [None] * 6
    short = cs.summary(now=19, window_s=5)  # rounded up to whole buckets: the open one
    assert short["window_s"] == 10 and (short["total"]["prefix_hits"], short["total"]["prefix_misses"]) == (1, 1)


def test_old_buckets_leave_the_window_and_silent_replicas_are_dropped() -> None:
    cs = CacheStats(window_s=30, bucket_s=10)
    cs.decision("a", "a/0", True, 0)
    cs.decision("a", "a/0", False, 25)
    assert cs.summary(now=25)["total"]["prefix_hits"] == 1
    assert cs.summary(now=31)["total"]["prefix_hits"] == 0  # its bucket [0, 10) is out
    assert cs.summary(now=31)["total"]["prefix_misses"] == 1
    assert cs.summary(now=200)["replicas"] == []  # silent for a whole window: forgotten


def test_engine_rates_come_from_counter_deltas() -> None:
    cs = CacheStats(window_s=60, bucket_s=10)
    cs.engine("a", "a/0", hits_total=1000, queries_total=5000, now=1)  # a baseline, not a delta
    assert cs.summary(now=1)["total"]["engine_query_tokens"] == 0
    cs.engine("a", "a/0", 1060, 5100, now=2)
    cs.engine("a", "a/0", 1100, 5200, now=12)
    r = cs.summary(now=12)["replicas"][0]
    assert (r["engine_hit_tokens"], r["engine_query_tokens"]) == (100, 200)
    assert r["engine_hit_rate"] == pytest.approx(0.5)
    assert r["engine_hit_rate_series"][-2:] == [pytest.approx(0.6), pytest.approx(0.4)]
    cs.engine("a", "a/0", 30, 40, now=13)  # the engine restarted: its counters count from zero
    assert cs.summary(now=13)["replicas"][0]["engine_query_tokens"] == 240
    cs.forget("a/0")
    assert cs.summary(now=13)["replicas"] == []


def test_a_replica_id_reused_by_another_model_starts_over() -> None:
    cs = CacheStats()
    cs.decision("a", "x/0", True, 0)
    cs.decision("b", "x/0", False, 1)
    s = cs.summary(now=1)
    assert [(m["model"], m["prefix_hits"], m["prefix_misses"]) for m in s["models"]] == [("b", 0, 1)]


def test_bad_settings() -> None:
    with pytest.raises(ValueError):
        CacheStats(window_s=5, bucket_s=10)
