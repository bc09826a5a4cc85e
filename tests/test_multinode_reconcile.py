"""Multi-node replicas in reconciliation (pure): a group is placed whole, counts once, and is
written off and re-placed whole when any of its parts is lost or missing — never a partial group.
Also the wire and command-line sides of a group's parts."""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.fleet.engine_cmd import build_command, probes_tcp, rpc_server_candidates
from llmgw.fleet.group_parts import group_ready, head_peers, worker_id
from llmgw.fleet.nodes import Node
from llmgw.fleet.placement import Demand, Policy
from llmgw.fleet.reconcile import Assignment, ModelDeploy, reconcile
from llmgw.fleet.types import EngineReport, EngineSpec, GpuInfo, NodeFacts
from llmgw.fleet.wire_fields import WireProtocolError, _spec


def node(name: str, rack: str, state: str = "ready") -> Node:
    facts = NodeFacts(gpus=tuple(GpuInfo(i, "NVIDIA H100 80GB HBM3", 81559) for i in range(2)))
    return Node(name, state, 0.0, connected=True, agent_labels={"llmgw.io/rack": rack}, facts=facts)  # type: ignore[arg-type]


def fleet() -> dict[str, Node]:
    return {n.name: n for n in (node("a1", "r1"), node("b1", "r2"), node("b2", "r2"), node("c1", "r3"),
                                node("c2", "r3"))}


def big(count: int = 1, size: int = 2) -> ModelDeploy:
    return ModelDeploy("big", count, Demand(gpus=2), EngineSpec("", "big", "llamacpp", "big.gguf", simulate=True),
                       Policy(nodes=size, keep_within="rack"))


def ids() -> Any:
    c = itertools.count()
    return lambda model: f"{model}/{next(c)}"


def run(models: dict[str, ModelDeploy], nodes: dict[str, Node], asg: dict[str, Assignment], new: Any) -> Any:
    plan = reconcile(models, nodes, list(asg.values()), new_id=new, now_wall=0.0)
    for rid, _ in plan.lost:
        asg.pop(rid, None)
    for rid, _ in plan.drain:
        asg.pop(rid, None)  # drained and stopped, for the test's purpose
    for a in plan.create:
        asg[a.replica] = a
    return plan


def groups(asg: dict[str, Assignment]) -> dict[str, list[Assignment]]:
    out: dict[str, list[Assignment]] = {}
    for a in asg.values():
        assert a.spec.group is not None
        out.setdefault(a.spec.group.group, []).append(a)
    return out


def whole(asg: dict[str, Assignment], nodes: dict[str, Node], size: int) -> None:
    for gid, parts in groups(asg).items():
        assert sorted(a.spec.group.rank for a in parts) == list(range(size))  # type: ignore[union-attr]
        assert len({nodes[a.node].labels["llmgw.io/rack"] for a in parts}) == 1
        assert len({a.node for a in parts}) == size
        head = next(a for a in parts if a.spec.group.rank == 0)  # type: ignore[union-attr]
        assert head.replica == gid and not head.spec.is_worker


def test_a_group_is_placed_whole_and_counts_once() -> None:
    nodes, asg, new = fleet(), {}, ids()
    plan = run({"big": big(2)}, nodes, asg, new)
    assert len(plan.create) == 4 and not plan.unplaceable
    whole(asg, nodes, 2)
    assert {worker_id(g, 1) for g in groups(asg)} <= asg.keys()
    assert not run({"big": big(2)}, nodes, asg, new)  # steady: two replicas of two nodes each


def test_a_lost_worker_re_places_the_whole_group() -> None:
    nodes, asg, new = fleet(), {}, ids()
    run({"big": big(1)}, nodes, asg, new)
    (gid, parts), = groups(asg).items()
    worker = next(a for a in parts if a.spec.is_worker)
    nodes[worker.node] = replace(nodes[worker.node], state="lost")
    plan = run({"big": big(1)}, nodes, asg, new)
    assert {rid for rid, _ in plan.lost} == {gid, worker.replica}  # the head on a live node goes too
    assert any("of its 2-node group" in why for _, why in plan.lost)
    assert len(plan.create) == 2 and gid not in asg
    whole(asg, nodes, 2)
    assert worker.node not in {a.node for a in asg.values()}


def test_a_missing_part_writes_the_rest_off() -> None:
    nodes, asg, new = fleet(), {}, ids()
    run({"big": big(1)}, nodes, asg, new)
    (gid, _), = groups(asg).items()
    del asg[worker_id(gid, 1)]
    plan = run({"big": big(1)}, nodes, asg, new)
    assert (gid, f"its 2-node group {gid} is incomplete (rank 1 missing)") in plan.lost
    whole(asg, nodes, 2)


def test_no_room_for_a_whole_group_places_nothing() -> None:
    nodes = {"a1": node("a1", "r1"), "b1": node("b1", "r2")}
    asg: dict[str, Assignment] = {}
    plan = run({"big": big(1)}, nodes, asg, ids())
    assert not plan.create and "no domain has 2 nodes that fit inside one rack" in plan.unplaceable["big"]


def test_a_draining_head_takes_its_workers_and_a_changed_size_replaces_the_group() -> None:
    nodes, asg, new = fleet(), {}, ids()
    run({"big": big(1)}, nodes, asg, new)
    (gid, _), = groups(asg).items()
    plan = reconcile({"big": big(1, size=2)}, nodes, list(asg.values()), new_id=new, now_wall=0.0)
    assert not plan
    plan = reconcile({}, nodes, list(asg.values()), new_id=new, now_wall=0.0)
    assert {rid for rid, _ in plan.drain} == {gid, worker_id(gid, 1)}
    plan = reconcile({"big": big(1, size=3)}, {**nodes, "c3": node("c3", "r3")}, list(asg.values()), new_id=new,
                     now_wall=0.0)
    assert {rid for rid, _ in plan.drain} == {gid, worker_id(gid, 1)} and len(plan.create) == 3


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a1", "b1", "b2", "c1", "c2", "d1", "d2"]),
                          st.sampled_from(["lost", "ready", "not_ready"])), max_size=8),
       st.integers(1, 3))
def test_never_a_partial_group(events: list[tuple[str, str]], count: int) -> None:
    nodes = {**fleet(), "d1": node("d1", "r4"), "d2": node("d2", "r4")}
    asg: dict[str, Assignment] = {}
    new = ids()
    for name, state in [("", ""), *events]:
        if name:
            nodes[name] = replace(nodes[name], state=state)
        run({"big": big(count)}, nodes, asg, new)
        whole(asg, nodes, 2)
        assert all(nodes[a.node].state != "lost" for a in asg.values())
        assert len(groups(asg)) <= count


def test_the_head_is_told_its_ready_workers() -> None:
    nodes, asg, new = fleet(), {}, ids()
    run({"big": big(1, size=3)}, nodes, asg, new)
    if not asg:  # racks of two nodes: three do not fit
        nodes["c3"] = node("c3", "r3")
        run({"big": big(1, size=3)}, nodes, asg, new)
    (gid, _), = groups(asg).items()
    head = asg[gid]
    ws = [asg[worker_id(gid, 1)], asg[worker_id(gid, 2)]]
    assert head_peers(head, ws) is None and not group_ready(head, ws)
    ws[0].report = EngineReport(ws[0].replica, "big", "ready", url="http://10.0.0.2:5001")
    ws[1].report = EngineReport(ws[1].replica, "big", "starting", url="http://10.0.0.3:5002")
    assert head_peers(head, ws) is None
    ws[1].report = EngineReport(ws[1].replica, "big", "ready", url="http://[fd00::3]:5002")
    assert head_peers(head, ws) == ("10.0.0.2:5001", "[fd00::3]:5002")
    assert not group_ready(head, ws)  # not yet told
    head.spec = replace(head.spec, group=replace(head.spec.group, peers=("10.0.0.2:5001", "[fd00::3]:5002")))  # type: ignore[arg-type]
    head.report = EngineReport(gid, "big", "ready", spec_hash="old", generation=0)
    assert not group_ready(head, ws)  # the head's process predates being told
    head.report = EngineReport(gid, "big", "ready", spec_hash=head.spec.spec_hash(), generation=0)
    assert group_ready(head, ws)
    head.spec = replace(head.spec, generation=1)  # restarted: the old process's report is not it
    assert not group_ready(head, ws)
    ws[0].report = EngineReport(ws[0].replica, "big", "ready", url="ftp://x:1")
    assert head_peers(head, ws) is None


def test_commands_of_a_group() -> None:
    nodes, asg, new = fleet(), {}, ids()
    run({"big": big(1)}, nodes, asg, new)
    (gid, _), = groups(asg).items()
    head, w = asg[gid], asg[worker_id(gid, 1)]
    assert build_command(w.spec, "10.0.0.2", 5001, "py") == ["py", "-m", "llmgw", "sim", "worker", "--host",
                                                             "10.0.0.2", "--port", "5001"]
    with pytest.raises(ValueError, match="without its workers' addresses"):
        build_command(head.spec, "10.0.0.1", 5000, "py")
    told = replace(head.spec, group=replace(head.spec.group, peers=("10.0.0.2:5001",)))  # type: ignore[arg-type]
    cmd = build_command(told, "10.0.0.1", 5000, "py")
    assert cmd[cmd.index("--rpc") + 1] == "10.0.0.2:5001"
    real_w = replace(w.spec, simulate=False, binary="/opt/llama/llama-server")
    assert build_command(real_w, "10.0.0.2", 5001, "py") == ["/opt/llama/ggml-rpc-server", "-H", "10.0.0.2", "-p",
                                                             "5001"]
    assert build_command(real_w, "h", 1, "py", rpc_server="/usr/bin/rpc-server")[0] == "/usr/bin/rpc-server"
    assert rpc_server_candidates(real_w) == ["/opt/llama/ggml-rpc-server", "/opt/llama/rpc-server", "ggml-rpc-server",
                                             "rpc-server"]
    assert probes_tcp(real_w) and not probes_tcp(w.spec)
    real_head = replace(told, simulate=False)
    cmd = build_command(real_head, "10.0.0.1", 5000, "py")
    assert cmd[0] == "llama-server" and cmd[cmd.index("--rpc") + 1] == "10.0.0.2:5001"
    with pytest.raises(ValueError, match="vLLM multi-node replica without its Ray port"):
        build_command(replace(told, engine="vllm", simulate=False), "h", 1, "py")


def test_group_on_the_wire_is_checked_and_bounded() -> None:
    nodes, asg, new = fleet(), {}, ids()
    run({"big": big(1)}, nodes, asg, new)
    (gid, _), = groups(asg).items()
    wire = asg[gid].spec.to_wire()
    assert _spec(wire, "s") == asg[gid].spec
    assert EngineSpec.from_wire(wire) == asg[gid].spec
    assert "group" not in EngineSpec("r", "m", "vllm", "m").to_wire()  # single-node specs hash as before

    def bad(**g: Any) -> str:
        with pytest.raises(WireProtocolError) as e:
            _spec({**wire, "group": {**wire["group"], **g}}, "s")
        return str(e.value)

    assert "s.group.role: expected head or worker" in bad(role="boss")
    assert "s.group.size: 65 is not in 0..64" in bad(size=65)
    assert "does not fit role head" in bad(rank=1)
    assert "s.group.peers[0]: expected host:port" in bad(peers=["a,b:1"])
    assert "a head of 2 nodes has 1" in bad(peers=["a:1", "b:2"])
    assert "s.group.peers: 65 items, at most 64" in bad(peers=["a:1"] * 65)


def test_a_hold_with_drain_on_a_worker_s_domain_moves_the_group() -> None:
    from llmgw.fleet.reconcile import Facility, Hold

    nodes = {n.name: n for n in (node("b1", "r2"), node("b2", "r2"), node("c1", "r3"), node("c2", "r3"))}
    nodes = {k: replace(n, agent_labels={**n.agent_labels, "llmgw.io/pdu": f"p-{k}"}) for k, n in nodes.items()}
    asg: dict[str, Assignment] = {}
    new = ids()
    run({"big": big(1)}, nodes, asg, new)
    (gid, _), = groups(asg).items()
    w = asg[worker_id(gid, 1)]
    fac = Facility(holds={f"pdu=p-{w.node}": Hold(drain=True)})
    plan = reconcile({"big": big(1)}, nodes, list(asg.values()), new_id=new, now_wall=0.0, facility=fac)
    assert len(plan.create) == 2 and w.node not in {a.node for a in plan.create}  # surge: a whole new group
    assert not plan.drain  # the old one drains once the new one is ready
    for a in plan.create:
        asg[a.replica] = a
    for a in asg.values():
        a.report = EngineReport(a.replica, "big", "ready")
    plan = reconcile({"big": big(1)}, nodes, list(asg.values()), new_id=new, now_wall=0.0, facility=fac)
    assert {rid for rid, _ in plan.drain} == {gid, w.replica}


def test_a_group_counts_ready_only_when_whole_and_the_head_says_why_not() -> None:
    from llmgw.config import model_from_dict
    from llmgw.daemon.control.plane.views import model_views, replica_views

    class Router:
        def replica_state(self, rid: str) -> None:
            return None

    nodes, asg, new = fleet(), {}, ids()
    run({"big": big(1)}, nodes, asg, new)
    (gid, _), = groups(asg).items()
    head, w = asg[gid], asg[worker_id(gid, 1)]
    m = {"big": model_from_dict({"name": "big", "engine": "llamacpp", "deploy": {"nodes": 2, "simulate": True}})}

    def counts() -> tuple[int | None, int]:
        (v,) = model_views(m, {}, asg.values(), {})
        return v.replicas, v.ready

    def detail() -> str:
        return next(v.detail for v in replica_views(asg.values(), Router()) if v.replica == gid)  # type: ignore[arg-type]

    assert counts() == (1, 0) and detail() == "waiting for its workers: 0 of 1 ready"
    head.report = EngineReport(gid, "big", "ready", detail="")
    assert counts() == (1, 0)  # the head alone is not the replica
    w.report = EngineReport(w.replica, "big", "ready", url="http://10.0.0.2:5001")
    head.spec = replace(head.spec, group=replace(head.spec.group, peers=("10.0.0.2:5001",)))  # type: ignore[arg-type]
    assert counts() == (1, 0)  # still the process started before it was told
    head.report = EngineReport(gid, "big", "ready", spec_hash=head.spec.spec_hash())
    assert counts() == (1, 1) and detail() == ""
    w.report = EngineReport(w.replica, "big", "crashed", detail="exited with status 1")
    assert counts() == (1, 0) and detail() == "not routed until its workers: 0 of 1 ready"


def test_groups_go_only_to_agents_that_run_their_parts() -> None:
    nodes, asg, new = fleet(), {}, ids()
    plan = reconcile({"big": big(1)}, nodes, [], new_id=new, now_wall=0.0, group_nodes={"a1", "b1", "c1", "c2"})
    assert {a.node for a in plan.create} == {"c1", "c2"}  # rack r2 has only one capable node
    plan = reconcile({"big": big(1)}, nodes, [], new_id=new, now_wall=0.0, group_nodes={"a1", "b1", "c1"})
    assert not plan.create
    assert "(2 nodes with an agent too old to run multi-node replicas left out)" in plan.unplaceable["big"]
    run({"big": big(1)}, nodes, asg, new)
    (gid, _), = groups(asg).items()
    w = asg[worker_id(gid, 1)]
    everyone = set(nodes)
    plan = reconcile({"big": big(1)}, nodes, list(asg.values()), new_id=new, now_wall=0.0,
                     group_nodes=everyone - {w.node})  # its agent came back as an older release
    assert {rid for rid, _ in plan.lost} == {gid, w.replica}
    assert any("agent does not run multi-node replicas" in why for _, why in plan.lost)
    away = {**nodes, w.node: replace(nodes[w.node], connected=False)}
    assert not reconcile({"big": big(1)}, away, list(asg.values()), new_id=new, now_wall=0.0,
                         group_nodes=everyone - {w.node}).lost  # not back yet: not judged


def test_the_plane_tells_the_head_and_restarts_it_when_a_worker_is_a_new_process() -> None:
    from llmgw.daemon.control.plane.groups import head_startable, sync_head

    class Recorder:
        def __init__(self) -> None:
            self.calls: list[tuple[Any, ...]] = []

        def write(self, *a: Any) -> None:
            self.calls.append(("write", a[0]))

        def record(self, event: str, **kw: Any) -> None:
            self.calls.append(("record", event))

        def push(self, node: str) -> None:
            self.calls.append(("push", node))

    class Plane:
        def __init__(self, asg: dict[str, Assignment]) -> None:
            self.assignments = asg
            self.guard = self.agents = Recorder()
            self.told_workers: dict[str, tuple[int | None, ...]] = {}

        def _row(self, a: Assignment) -> str:
            return a.replica

    nodes, asg, new = fleet(), {}, ids()
    run({"big": big(1)}, nodes, asg, new)
    (gid, _), = groups(asg).items()
    head, w = asg[gid], asg[worker_id(gid, 1)]
    plane = Plane(asg)
    assert not head_startable(head) and head_startable(w)
    sync_head(plane, head)  # type: ignore[arg-type]
    assert plane.guard.calls == []  # the worker is not ready: nothing to tell
    w.report = EngineReport(w.replica, "big", "ready", url="http://10.0.0.2:5001", pid=100)
    sync_head(plane, head)  # type: ignore[arg-type]
    assert head.spec.group.peers == ("10.0.0.2:5001",) and head_startable(head)  # type: ignore[union-attr]
    assert ("push", head.node) in plane.guard.calls and ("record", "group ready") in plane.guard.calls
    plane.guard.calls.clear()
    sync_head(plane, head)  # type: ignore[arg-type]
    assert plane.guard.calls == [] and head.spec.generation == 0  # steady
    w.report = EngineReport(w.replica, "big", "ready", url="http://10.0.0.2:5001", pid=200)  # restarted, same port
    sync_head(plane, head)  # type: ignore[arg-type]
    assert head.spec.generation == 1 and ("push", head.node) in plane.guard.calls
    w.report = EngineReport(w.replica, "big", "ready", url="http://10.0.0.2:5009", pid=300)  # another port
    sync_head(plane, head)  # type: ignore[arg-type]
    assert head.spec.group.peers == ("10.0.0.2:5009",)  # type: ignore[union-attr]
    fresh = Plane(asg)  # a restarted router: what runs is taken as told, nothing restarted
    sync_head(fresh, head)  # type: ignore[arg-type]
    assert fresh.guard.calls == [] and fresh.told_workers == {gid: (300,)}


def test_the_agent_finds_llama_cpp_s_rpc_worker_under_either_name(tmp_path: Any, monkeypatch: Any) -> None:
    from llmgw.daemon.agent.processes import find_rpc_server

    spec = EngineSpec("m/1-w1", "m", "llamacpp", "m.gguf", binary=str(tmp_path / "llama-server"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert find_rpc_server(spec) is None
    old = tmp_path / "rpc-server"
    old.write_text("#!/bin/sh\n")
    assert find_rpc_server(spec) is None  # not executable
    old.chmod(0o755)
    assert find_rpc_server(spec) == str(old)
    new = tmp_path / "ggml-rpc-server"
    new.write_text("#!/bin/sh\n")
    new.chmod(0o755)
    assert find_rpc_server(spec) == str(new)  # the verified build's name first
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_rpc_server(replace(spec, binary=None)) == "ggml-rpc-server"
