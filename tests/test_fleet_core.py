"""The fleet's pure core: node timeouts and the partition guard, placement v1, reconciliation."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from llmgw.fleet.facts import parse_meminfo_mb, parse_nvidia_smi
from llmgw.fleet.nodes import Node, NodeRegistry, NodeTimeouts, location
from llmgw.fleet.placement import Demand, Placer
from llmgw.fleet.reconcile import Assignment, ModelDeploy, reconcile
from llmgw.fleet.types import EngineReport, EngineSpec, GpuInfo, NodeFacts

T = NodeTimeouts(not_ready_after_s=5, lost_after_s=30, max_lost_fraction=0.5)


def reg(*names: str, now: float = 0.0) -> NodeRegistry:
    r = NodeRegistry(T, now)
    for n in names:
        r.connected(n, f"agent-{n}", labels={}, facts=NodeFacts(), now=now)
    return r


def states(r: NodeRegistry) -> dict[str, str]:
    return {n.name: n.state for n in r.nodes.values()}


# -- nodes ------------------------------------------------------------------------------------
def test_late_heartbeats_make_a_node_not_ready_then_lost() -> None:
    r = reg("a", "b", "c", "d")
    for n in "bcd":
        r.heard(n, f"agent-{n}", 4.0)
    assert r.tick(4.0) == []
    [t] = r.tick(5.5)
    assert (t.node, t.old, t.new) == ("a", "ready", "not_ready") and "no heartbeat" in t.reason
    for n in "bcd":
        r.heard(n, f"agent-{n}", 30.0)
    assert r.tick(35.0) == []  # not ready for 29.5 s: not lost yet
    for n in "bcd":
        r.heard(n, f"agent-{n}", 35.4)
    [t] = r.tick(35.6)
    assert (t.node, t.new) == ("a", "lost")


def test_a_blip_shorter_than_the_lost_timeout_moves_nothing() -> None:
    r = reg("a", "b", "c")
    r.disconnected("a", "agent-a", "stream closed", 1.0)
    assert states(r)["a"] == "not_ready"
    r.tick(10.0)
    r.connected("a", "agent-a2", labels={}, facts=NodeFacts(), now=12.0)
    assert states(r)["a"] == "ready"
    assert all(t.new != "lost" for t in r.tick(100.0) if t.node == "a") or states(r)["a"] != "lost"


def test_an_old_connection_closing_does_not_unready_its_replacement() -> None:
    r = reg("a")
    r.connected("a", "agent-new", labels={}, facts=NodeFacts(), now=1.0)
    assert r.disconnected("a", "agent-a", "replaced", 1.5) == []
    assert states(r)["a"] == "ready"


def test_a_majority_falling_silent_at_once_is_a_partition_not_a_loss() -> None:
    r = reg("a", "b", "c", "d", "e")
    for n in "abc":
        r.disconnected(n, f"agent-{n}", "cut", 1.0)
    for n in "de":
        r.heard(n, f"agent-{n}", 100.0)
    assert r.tick(100.0) == [] and r.partition_suspected
    assert set(states(r).values()) == {"ready", "not_ready"}
    r.connected("a", "agent-a", labels={}, facts=NodeFacts(), now=101.0)
    r.connected("b", "agent-b", labels={}, facts=NodeFacts(), now=101.0)
    for n in "de":
        r.heard(n, f"agent-{n}", 101.0)
    ts = r.tick(101.0)
    assert not r.partition_suspected and [(t.node, t.new) for t in ts] == [("c", "lost")]


def test_lost_nodes_do_not_hold_the_partition_guard_shut() -> None:
    r = reg("a", "b", "c", "d")
    for n in "ab":  # decommissioned long ago
        r.disconnected(n, f"agent-{n}", "gone", 0.0)
    for n in "cd":
        r.heard(n, f"agent-{n}", 31.0)
    r.tick(31.0)  # 2 of 4 silent = 0.5: not above the fraction
    assert states(r)["a"] == "lost"
    r.disconnected("c", "agent-c", "crash", 40.0)
    r.heard("d", "agent-d", 71.0)
    r.tick(71.0)  # c is 1 of the 2 not-lost nodes silent: 0.5, not above
    assert states(r)["c"] == "lost"


def test_nodes_known_from_the_store_wait_for_their_agents() -> None:
    r = NodeRegistry(T, 0.0)
    r.remember("a", agent_labels={"x": "1"}, operator_labels={"x": "2"}, facts=NodeFacts(), now=0.0)
    assert states(r) == {"a": "not_ready"} and r.nodes["a"].labels == {"x": "2"}
    assert r.tick(29.0) == []
    r.connected("a", "agent-a", labels={"x": "1", "y": "3"}, facts=NodeFacts(), now=29.0)
    assert r.nodes["a"].labels == {"x": "2", "y": "3"}  # operator labels win


def test_location_is_the_facility_path() -> None:
    assert location({"llmgw.io/rack": "r1", "llmgw.io/site": "fra", "other": "x"}) == "fra/r1"


# -- placement --------------------------------------------------------------------------------
def node(name: str, gpus: list[int] = (), mem: int = 0, rack: str = "", **labels: str) -> Node:
    lab = dict(labels)
    if rack:
        lab["llmgw.io/rack"] = rack
    facts = NodeFacts(memory_mb=mem, gpus=tuple(GpuInfo(i, "g", m) for i, m in enumerate(gpus)))
    return Node(name, "ready", 0.0, connected=True, agent_labels=lab, facts=facts)


def test_replicas_spread_over_nodes_then_racks() -> None:
    nodes = [node("a1", rack="r1"), node("a2", rack="r1"), node("b1", rack="r2")]
    spots, why = Placer(nodes).place("m", Demand(), 2)
    assert why is None and sorted(n for n, _ in spots) == ["a1", "b1"]  # one per rack first
    spots, _ = Placer(nodes).place("m", Demand(), 4)
    assert sorted(n for n, _ in spots) == ["a1", "a2", "b1", "b1"] or sorted(n for n, _ in spots).count("b1") == 2


def test_gpus_are_taken_best_fit_and_memory_is_respected() -> None:
    nodes = [node("a", gpus=[80000, 24000, 24000], mem=64000)]
    spots, why = Placer(nodes).place("m", Demand(gpus=1, gpu_memory_mb=20000, memory_mb=30000), 3)
    assert [g for _, g in spots] == [(1,), (2,)]  # the 80 GB GPU stays for something larger...
    assert why is not None and "too little free memory" in why  # ...and memory ran out at two


def test_unplaceable_reasons_are_counted() -> None:
    nodes = [node("a", gpus=[24000]), node("b", gpus=[16000, 16000]), node("c", gpu="x")]
    nodes.append(Node("d", "not_ready", 0.0))
    _, why = Placer(nodes).place("m", Demand(gpus=2, gpu_memory_mb=20000), 1)
    assert why is not None
    assert "1 replica cannot be placed (each needs 2 GPUs of ≥20000 MB)" in why
    assert "2 have too few free GPUs" in why and "1 have too few free GPUs with enough memory" in why
    assert "1 not ready" in why
    _, why = Placer([node("a")]).place("m", Demand(selector=(("gpu", "h100"),)), 1)
    assert "lack the selector labels" in why  # type: ignore[operator]
    _, why = Placer([]).place("m", Demand(), 1)
    assert "no nodes have joined" in why  # type: ignore[operator]


def test_existing_placements_occupy_capacity() -> None:
    nodes = [node("a", gpus=[24000, 24000])]
    p = Placer(nodes, [("a", "x", Demand(gpus=1), (0,))])
    spots, _ = p.place("m", Demand(gpus=1), 2)
    assert spots == [("a", (1,))]


# -- reconcile --------------------------------------------------------------------------------
def deploy(name: str = "m", count: int = 2, **dem: int) -> ModelDeploy:
    return ModelDeploy(name, count, Demand(**dem), EngineSpec("", name, "vllm", name, simulate=True))


def ids() -> Any:
    c = itertools.count()
    return lambda model: f"{model}/{next(c)}"


def apply(plan: Any, assignments: dict[str, Assignment]) -> None:
    for rid, _ in plan.lost:
        del assignments[rid]
    for a in plan.create:
        assignments[a.replica] = a
    for rid, _ in plan.drain:
        assignments[rid].desired = "drain"


def test_reconcile_places_then_is_quiet() -> None:
    nodes = {n.name: n for n in (node("a"), node("b"))}
    asg: dict[str, Assignment] = {}
    new = ids()
    plan = reconcile({"m": deploy()}, nodes, asg.values(), new_id=new, now_wall=1.0)
    assert sorted(a.node for a in plan.create) == ["a", "b"]
    apply(plan, asg)
    assert not reconcile({"m": deploy()}, nodes, asg.values(), new_id=new, now_wall=2.0)


def test_reconcile_keeps_replicas_of_not_ready_nodes_and_replaces_lost_ones() -> None:
    nodes = {n.name: n for n in (node("a"), node("b"), node("c"))}
    asg: dict[str, Assignment] = {}
    new = ids()
    apply(reconcile({"m": deploy()}, nodes, asg.values(), new_id=new, now_wall=1.0), asg)
    on_a = next(a for a in asg.values() if a.node == "a")
    nodes["a"].state = "not_ready"
    assert not reconcile({"m": deploy()}, nodes, asg.values(), new_id=new, now_wall=2.0)
    nodes["a"].state = "lost"
    plan = reconcile({"m": deploy()}, nodes, asg.values(), new_id=new, now_wall=3.0)
    assert plan.lost == [(on_a.replica, "node a is lost")]
    assert [a.node for a in plan.create] == ["c"]


def test_scale_down_drains_the_least_useful_first() -> None:
    nodes = {n.name: n for n in (node("a"), node("b"), node("c"))}
    asg: dict[str, Assignment] = {}
    new = ids()
    apply(reconcile({"m": deploy(count=3)}, nodes, asg.values(), new_id=new, now_wall=1.0), asg)
    for a in asg.values():
        a.report = EngineReport(a.replica, "m", "ready")
    by_node = {a.node: a for a in asg.values()}
    by_node["b"].report = EngineReport(by_node["b"].replica, "m", "crashloop")
    nodes["c"].state = "not_ready"
    plan = reconcile({"m": deploy(count=1)}, nodes, asg.values(), new_id=new, now_wall=2.0)
    assert sorted(rid for rid, _ in plan.drain) == sorted([by_node["b"].replica, by_node["c"].replica])
    assert all(why == "scaled to 1" for _, why in plan.drain)


def test_deleted_model_and_changed_profile_are_drained() -> None:
    nodes = {n.name: n for n in (node("a"), node("b"))}
    asg: dict[str, Assignment] = {}
    new = ids()
    apply(reconcile({"m": deploy(count=1), "x": deploy("x", 1)}, nodes, asg.values(), new_id=new, now_wall=1.0),
          asg)
    changed = ModelDeploy("m", 1, Demand(), EngineSpec("", "m", "vllm", "m", simulate=True, args=("--new",)))
    plan = reconcile({"m": changed}, nodes, asg.values(), new_id=new, now_wall=2.0)
    whys = sorted(w for _, w in plan.drain)
    assert whys == ["model m's profile changed", "model x was deleted"]
    assert [a.spec.args for a in plan.create] == [("--new",)]


def test_reconcile_is_deterministic_given_ids() -> None:
    nodes = {f"n{i}": node(f"n{i}", rack=f"r{i % 3}") for i in range(9)}
    a = reconcile({"m": deploy(count=5)}, nodes, [], new_id=ids(), now_wall=0.0)
    b = reconcile({"m": deploy(count=5)}, nodes, [], new_id=ids(), now_wall=0.0)
    assert [x.node for x in a.create] == [x.node for x in b.create]
    assert len({nodes[x.node].labels["llmgw.io/rack"] for x in a.create}) == 3


# -- facts ------------------------------------------------------------------------------------
def test_nvidia_smi_and_meminfo_parsers() -> None:
    text = "0, NVIDIA H100 80GB HBM3, 81559\n1, NVIDIA A100-SXM4-40GB, 40960\n2, [N/A], [N/A]\n"
    gpus = parse_nvidia_smi(text)
    assert gpus == (GpuInfo(0, "NVIDIA H100 80GB HBM3", 81559), GpuInfo(1, "NVIDIA A100-SXM4-40GB", 40960))
    assert parse_meminfo_mb("MemTotal:       24576000 kB\nMemFree: 1 kB\n") == 24000
    assert parse_meminfo_mb("garbage") == 0


@pytest.mark.parametrize("n", [0, 1])
def test_spec_hash_ignores_generation(n: int) -> None:
    s = EngineSpec("m/1", "m", "vllm", "m")
    from dataclasses import replace
    assert replace(s, generation=n).spec_hash() == s.spec_hash()
    assert replace(s, args=("--x",)).spec_hash() != s.spec_hash()
