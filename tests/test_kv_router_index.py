"""The router's tier-2 index fed by kv_events: only from the node that runs the replica, emptied
when the replica leaves routing or its agent's stream ends, and its metrics."""

from __future__ import annotations

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
        assert c.kv_index.size("m/a") == 3
        assert not c.kv_events("gpu-2", kv("m/a", 4))  # another node's replica
        assert not c.kv_events("gpu-1", kv("m/zzz", 5))  # no such replica
        assert c.kv_index.size("m/a") == 3 and "m/zzz" not in c.kv_index.index.replicas()
        text = scrape(c.kv_index)
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
        assert "m/a" not in c.kv_index.index.replicas() and c.kv_index.size("m/b") == 1
        c.agent_disconnected(Node("gpu-1", "ready", 0.0), "agent", "stream closed")
        assert c.kv_index.index.replicas() == []


async def test_the_agents_counters_reach_the_metrics_once(tmp_path: Path) -> None:
    async with admin_stack(tmp_path) as s:
        c = s.control
        assign(c, "m/a", "gpu-1")
        text = scrape(c.kv_index)
        assert 'llmgw_kv_replays_total{outcome="ok",reason="gap"} 0.0' in text and "llmgw_kv_gaps_total 0.0" in text
        assert c.kv_events("gpu-1", kv("m/a", 1, reset=True))
        for counts in ((("gaps", 2), ("replay_gap_ok", 1), ("replay_gap_missed", 1)),
                       (("gaps", 1), ("replay_start_ok", 1), ("bad_frames", 3), ("from_a_newer_agent", 9))):
            assert c.kv_events("gpu-1", KvEvents("m/a", 1, False, (), (), counts))
        assert not c.kv_events("gpu-2", KvEvents("m/a", 1, False, (), (), (("gaps", 100),)))  # refused: not counted
        text = scrape(c.kv_index)
        for line in ('llmgw_kv_replays_total{outcome="ok",reason="gap"} 1.0',
                     'llmgw_kv_replays_total{outcome="missed",reason="gap"} 1.0',
                     'llmgw_kv_replays_total{outcome="ok",reason="start"} 1.0',
                     'llmgw_kv_replays_total{outcome="timeout",reason="gap"} 0.0',
                     "llmgw_kv_gaps_total 3.0", "llmgw_kv_bad_frames_total 3.0"):
            assert line in text, line
        assert "from_a_newer_agent" not in text
        assert c.kv_index.replica_counts["m/a"]["gaps"] == 3
        c.kv_index.remove("m/a")
        assert "m/a" not in c.kv_index.replica_counts and "llmgw_kv_gaps_total 3.0" in scrape(c.kv_index)


async def test_a_stopped_engines_last_counts_are_counted_without_recreating_its_replica(tmp_path: Path) -> None:
    async with admin_stack(tmp_path) as s:
        c = s.control
        assign(c, "m/a", "gpu-1")
        assert c.kv_events("gpu-1", KvEvents("m/a", None, False, (), (), (("replay_gap_timeout", 1),)))
        assert "m/a" not in c.kv_index.index.replicas() and "m/a" not in c.kv_index.replica_counts
        assert 'llmgw_kv_replays_total{outcome="timeout",reason="gap"} 1.0' in scrape(c.kv_index)
