"""Scale to zero in the router's pure core: a request for an autoscaled model with no replica waits
for one (bounded by cold_start_wait_s, then 503 with Retry-After and the reason), is let through
when one is routed, and is counted in the load report the autoscaler reads."""

from __future__ import annotations

import random

import pytest

from llmgw.config import parse_config
from llmgw.route.adapters import Load
from llmgw.route.admission import Ticket
from llmgw.route.attempt import Attempt
from llmgw.route.cache_stats import CacheStats
from llmgw.route.counters import LATENCY_BUCKETS
from llmgw.route.dispatch import RouterCore
from llmgw.route.openai_req import ApiError
from llmgw.route.replicas import ReplicaTable
from llmgw.route.readiness import readiness

CFG = """
[router]
queue_timeout_s = 5.0
[[models]]
name = "m"
engine = "vllm"
[models.deploy]
simulate = true
[models.autoscale]
min = 0
max = 3
idle_to_zero_s = 60
cold_start_wait_s = 30
[[models]]
name = "plain"
engine = "vllm"
[models.deploy]
simulate = true
count = 0
"""
BODY = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'


def core() -> RouterCore:
    cfg = parse_config(CFG)
    return RouterCore(cfg, ReplicaTable(cfg), cache_stats=CacheStats(), wall=lambda: 0.0, rng=random.Random(0))


def test_a_request_waits_for_a_cold_start_and_goes_when_a_replica_comes() -> None:
    c = core()
    p = c.plan("chat", BODY, "a", strategy=None, session=None, now=0.0)
    t = c.next(p, 0.0, 0.0)
    assert isinstance(t, Ticket) and t.deadline == 30.0 and p.cold  # cold_start_wait_s, not queue_timeout_s
    load = c.autoscale_load()["m"]
    assert (load["arrivals"], load["queued"], load["cold_waiting"], load["cold_waits"]) == (1, 1, 1, 1)
    assert p.trace is not None and "cold start" in p.trace.marks[-1][3]
    cfg = parse_config(CFG)
    _, woken = c.add_replica(cfg.models[0], "m/r1", "http://127.0.0.1:9", pool="default", weight=1.0)
    assert woken == [t]
    a = c.next(p, 5.0, 0.0)
    assert isinstance(a, Attempt) and a.replica.id == "m/r1"
    c.finish(p, a, 6.0, None, first_byte_at=5.5, status=200)
    load = c.autoscale_load()["m"]
    assert (load["inflight"], load["queued"], load["cold_waiting"]) == (0, 0, 0)
    assert sum(load["ttft"]) == 1 and len(load["ttft"]) == len(LATENCY_BUCKETS) + 1


def test_past_cold_start_wait_s_the_answer_is_503_with_retry_after_and_the_reason() -> None:
    c = core()
    p = c.plan("chat", BODY, "a", strategy=None, session=None, now=0.0)
    assert isinstance(c.next(p, 0.0, 0.0), Ticket)
    with pytest.raises(ApiError) as e:
        c.left_queue(p, 30.0, timed_out=True)
    err = e.value
    assert err.status == 503 and err.counted and err.code == "cold_start"
    assert "is starting (a cold start)" in err.message and "30s" in err.message
    assert dict(err.headers)["retry-after"] == "8"
    assert c.autoscale_load()["m"]["queued"] == 0


def test_a_model_that_is_not_autoscaled_answers_503_at_once_as_before() -> None:
    c = core()
    p = c.plan("chat", BODY.replace(b'"m"', b'"plain"'), "a", strategy=None, session=None, now=0.0)
    with pytest.raises(ApiError) as e:
        c.next(p, 0.0, 0.0)
    assert e.value.status == 503 and not p.cold


def test_a_draining_replica_does_not_count_and_a_scaled_to_zero_model_is_not_waited_for() -> None:
    c = core()
    cfg = parse_config(CFG)
    rep, _ = c.add_replica(cfg.models[0], "m/r1", "http://127.0.0.1:9", pool="default", weight=1.0)
    rep.draining = True  # the last replica leaves (scaled down to zero): new requests wait for the next
    p = c.plan("chat", BODY, "a", strategy=None, session=None, now=0.0)
    assert isinstance(c.next(p, 0.0, 0.0), Ticket)
    # min = 0: the router is ready with the model at zero replicas (nothing to wait for)
    r = readiness(c.table)
    assert r.ready and "m" not in {m.model for m in r.models}


def test_the_eval_runners_requests_are_not_arrivals() -> None:
    c = core()
    c.plan("chat", BODY, "a", strategy=None, session=None, now=0.0, internal=True)
    c.plan("chat", BODY, "b", strategy=None, session=None, now=0.0)
    assert c.autoscale_load()["m"]["arrivals"] == 1


def test_an_adapters_request_is_its_models_load_and_waits_for_its_cold_start() -> None:
    cfg_text = CFG.replace('engine = "vllm"\n[models.deploy]\nsimulate = true\n[models.autoscale]',
                           'engine = "vllm"\nmax_loaded_adapters = 2\n[models.deploy]\nsimulate = true\n'
                           '[models.autoscale]', 1).replace(
        '[[models]]\nname = "plain"', '[[models.adapters]]\nname = "sql"\nsource = "/adapters/sql"\n'
                                     '[[models]]\nname = "plain"')
    cfg = parse_config(cfg_text)
    c = RouterCore(cfg, ReplicaTable(cfg), cache_stats=CacheStats(), wall=lambda: 0.0, rng=random.Random(0))
    p = c.plan("chat", BODY.replace(b'"m"', b'"sql"'), "a", strategy=None, session=None, now=0.0)
    t = c.next(p, 0.0, 0.0)
    assert isinstance(t, Ticket) and p.cold and t.deadline == 30.0  # at zero: the adapter waits like its model
    load = c.autoscale_load()
    assert (load["m"]["arrivals"], load["m"]["cold_waiting"]) == (1, 1) and "sql" not in load
    _, woken = c.add_replica(cfg.models[0], "m/r1", "http://127.0.0.1:9", pool="default", weight=1.0)
    assert woken == [t]
    ld = c.next(p, 1.0, 0.0)  # on demand: loaded onto the replica that came, once it is there
    assert isinstance(ld, Load) and ld.replica == "m/r1" and ld.adapter == "sql"
    c.adapters.load_done(ld, 2.0, None)
    c.adapters.waited(p, 2.0)
    a = c.next(p, 2.0, 0.0)
    assert isinstance(a, Attempt) and a.replica.id == "m/r1"
    assert c.autoscale_load()["m"]["inflight"] == 1  # in flight on the base model's replica: its load
