"""The router's tier-2 index fed by kv_events: only from the node that runs the replica, emptied
when the replica leaves routing or its agent's stream ends, and its metrics."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from llmgw.daemon.router.kv_index import KvIndexMetrics, RouterKvIndex
from llmgw.fleet.nodes import Node
from llmgw.fleet.placement import Demand
from llmgw.fleet.reconcile import Assignment
from llmgw.fleet.types import EngineSpec
from llmgw.fleet.wire import KvEvents

from .admin_support import admin_stack

pytestmark = pytest.mark.anyio


def kv(replica: str, *hashes: int, reset: bool = False) -> KvEvents:
    return KvEvents(replica, 1, reset, tuple((None, h) for h in hashes), ())


def scrape(kv_index: RouterKvIndex) -> str:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(KvIndexMetrics(kv_index))
    return generate_latest(reg).decode()


def assign(control, rid: str, node: str) -> None:  # type: ignore[no-untyped-def]
    spec = EngineSpec(replica=rid, model="m", engine="vllm", model_path="m")
    control.assignments[rid] = Assignment(rid, "m", node, spec, Demand())


async def test_events_only_from_the_node_that_runs_the_replica(tmp_path: Path) -> None:
    async with admin_stack(tmp_path) as s:
        c = s.control
        assign(c, "m/a", "gpu-1")
        assert c.kv_events("gpu-1", kv("m/a", 1, 2, 3, reset=True))
        assert s.router.kv.size("m/a") == 3
        assert not c.kv_events("gpu-2", kv("m/a", 4))  # another node's replica
        assert not c.kv_events("gpu-1", kv("m/zzz", 5))  # no such replica
        assert s.router.kv.size("m/a") == 3 and "m/zzz" not in s.router.kv.index.replicas()
        text = scrape(s.router.kv)
        assert 'llmgw_kv_index_blocks{endpoint="m/a"} 3.0' in text
        assert 'llmgw_kv_events_refused_total{reason="other_node"} 1.0' in text
        assert 'llmgw_kv_events_refused_total{reason="unknown_replica"} 1.0' in text


async def test_index_dropped_when_the_replica_leaves_routing_or_its_agent_goes(tmp_path: Path) -> None:
    async with admin_stack(tmp_path) as s:
        c = s.control
        assign(c, "m/a", "gpu-1")
        assign(c, "m/b", "gpu-1")
        assert c.kv_events("gpu-1", kv("m/a", 1)) and c.kv_events("gpu-1", kv("m/b", 2))
        c._route(c.assignments["m/a"])  # no ready report: out of routing
        assert "m/a" not in s.router.kv.index.replicas() and s.router.kv.size("m/b") == 1
        c.agent_disconnected(Node("gpu-1", "ready", 0.0), "agent", "stream closed")
        assert s.router.kv.index.replicas() == []


async def test_the_agents_counters_reach_the_metrics_once(tmp_path: Path) -> None:
    async with admin_stack(tmp_path) as s:
        c = s.control
        assign(c, "m/a", "gpu-1")
        text = scrape(s.router.kv)
        assert 'llmgw_kv_replays_total{outcome="ok",reason="gap"} 0.0' in text and "llmgw_kv_gaps_total 0.0" in text
        assert c.kv_events("gpu-1", kv("m/a", 1, reset=True))
        for counts in ((("gaps", 2), ("replay_gap_ok", 1), ("replay_gap_missed", 1)),
                       (("gaps", 1), ("replay_start_ok", 1), ("bad_frames", 3), ("from_a_newer_agent", 9))):
            assert c.kv_events("gpu-1", KvEvents("m/a", 1, False, (), (), counts))
        assert not c.kv_events("gpu-2", KvEvents("m/a", 1, False, (), (), (("gaps", 100),)))  # refused: not counted
        text = scrape(s.router.kv)
        for line in ('llmgw_kv_replays_total{outcome="ok",reason="gap"} 1.0',
                     'llmgw_kv_replays_total{outcome="missed",reason="gap"} 1.0',
                     'llmgw_kv_replays_total{outcome="ok",reason="start"} 1.0',
                     'llmgw_kv_replays_total{outcome="timeout",reason="gap"} 0.0',
                     "llmgw_kv_gaps_total 3.0", "llmgw_kv_bad_frames_total 3.0"):
            assert line in text, line
        assert "from_a_newer_agent" not in text
        assert s.router.kv.replica_counts["m/a"]["gaps"] == 3
        s.router.kv.remove("m/a")
        assert "m/a" not in s.router.kv.replica_counts and "llmgw_kv_gaps_total 3.0" in scrape(s.router.kv)


async def test_a_stopped_engines_last_counts_are_counted_without_recreating_its_replica(tmp_path: Path) -> None:
    async with admin_stack(tmp_path) as s:
        c = s.control
        assign(c, "m/a", "gpu-1")
        assert c.kv_events("gpu-1", KvEvents("m/a", None, False, (), (), (("replay_gap_timeout", 1),)))
        assert "m/a" not in s.router.kv.index.replicas() and "m/a" not in s.router.kv.replica_counts
        assert 'llmgw_kv_replays_total{outcome="timeout",reason="gap"} 1.0' in scrape(s.router.kv)

class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_feed_per_replica_gaps_and_lag() -> None:
    clock = Clock()
    k = RouterKvIndex(clock=clock)
    k.apply(kv("m/a", 1, 2, reset=True))  # a new engine: a reset of an empty index is no gap
    clock.now = 101.0
    k.apply(kv("m/a", 3))
    k.apply(kv("m/a", 4, reset=True))  # a reset that drops blocks: events were lost
    feed = k.feeds["m/a"]
    assert (feed.messages, feed.block_events, feed.resets, feed.gaps, feed.last_at) == (3, 4, 2, 1, 101.0)
    clock.now = 104.5
    text = scrape(k)
    assert 'llmgw_kv_events_lag_seconds{endpoint="m/a"} 3.5' in text
    assert "llmgw_kv_index_gaps_total 1.0" in text and "llmgw_kv_index_bytes 77.0" in text
    k.session_started("m/a")  # an agent's new session replaced its live connection: a full copy follows
    k.apply(kv("m/a", 4, 5, reset=True))
    assert (feed.resets, feed.gaps) == (3, 1)
    k.apply(kv("m/a", 6, reset=True))  # a later reset that drops blocks is lost events again
    assert (feed.resets, feed.gaps, k.gaps) == (4, 2, 2)
    k.remove("m/a")
    assert 'lag_seconds{endpoint="m/a"}' not in scrape(k) and k.feeds["m/a"].messages == 5


def test_the_parity_alarm_is_logged_and_exported(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="llmgw.router.kv")
    clock = Clock()
    k = RouterKvIndex(clock=clock)
    k.apply(kv("m/a", 900, reset=True))
    for i in range(3):
        cid = k.check_open("m/a", "m", [i + 1], clock.now)
        k.check_end(cid, clock.now, ok=True)
        k.apply(kv("m/a", 1000 + i))  # the engine stores other hashes
        clock.now += 5.0
        k.parity.tick(clock.now)
        k._log_parity()
    warn = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warn) == 1 and "replica m/a (model m)" in warn[0].getMessage()
    assert "PYTHONHASHSEED" in warn[0].getMessage() and "sha256_cbor" in warn[0].getMessage()
    text = scrape(k)
    assert 'llmgw_kv_parity_alarm{endpoint="m/a",model="m"} 1.0' in text
    assert 'llmgw_kv_parity_checks_total{endpoint="m/a",model="m",outcome="fail"} 3.0' in text
    assert k.check_open("m/a", "m", [900], clock.now) is None  # in the index: a pass, the alarm clears
    assert 'llmgw_kv_parity_alarm{endpoint="m/a",model="m"} 0.0' in scrape(k)
    assert "match the router's hashes again" in caplog.records[-1].getMessage()


def test_the_kv_view_without_an_index() -> None:
    from llmgw.daemon.router.kv_view import kv_summary
    from llmgw.route.kv_scorer import KvDecisionStats

    st = KvDecisionStats()
    st.by_replica["m/a"] = [2, 5]
    v = kv_summary(None, st, [("m/a", "m", "n1")], 0.0)
    assert not v.enabled and v.blocks == 0 and v.models == []
    (r,) = v.replicas
    assert (r.replica, r.node, r.tier1_decisions, r.tier2_decisions, r.lag_s) == ("m/a", "n1", 2, 5, None)
    assert r.parity.status == "unchecked" and r.parity.mismatch_rate is None
