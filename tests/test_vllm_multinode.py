"""vLLM multi-node replicas (pure): the command lines of the head (the Ray head, then vllm serve)
and of a worker (ray start --address HEAD), the report's Ray port on the wire, and the control
plane's start order (head first; workers told its Ray address) and restart rules."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from llmgw.daemon.agent.processes import ray_port_of
from llmgw.daemon.agent.ray_launch import split_host_port
from llmgw.daemon.control.plane.groups import head_startable, sync_head
from llmgw.daemon.control.plane.views import _group_detail
from llmgw.fleet.engine_cmd import RAY_LAUNCH_MODULE, build_command, probes_tcp, ray_candidates, ray_group
from llmgw.fleet.group_parts import group_ready, ray_head_address, worker_id
from llmgw.fleet.placement import Demand, Policy
from llmgw.fleet.reconcile import Assignment, ModelDeploy
from llmgw.fleet.types import EngineReport, EngineSpec, GroupLaunch
from llmgw.fleet.wire_fields import WireProtocolError, _report, _spec

from .test_multinode_reconcile import fleet, groups, ids, run

PY = "/usr/bin/python3"


def part(role: str, rank: int, peers: tuple[str, ...] = (), **kw: Any) -> EngineSpec:
    rid = "big/1" if rank == 0 else f"big/1-w{rank}"
    return EngineSpec(replica=rid, model="big", engine="vllm", model_path="/models/big",
                      binary="/opt/vllm/bin/vllm", gpu_indices=(0, 1, 2, 3),
                      group=GroupLaunch(role=role, group="big/1", rank=rank, size=2, peers=peers), **kw)


def test_the_head_starts_ray_then_vllm_serve_with_the_documented_flags() -> None:
    head = part("head", 0)
    assert ray_group(head) and not ray_group(replace(head, simulate=True)) and not ray_group(replace(head, group=None))
    cmd = build_command(head, "10.0.0.1", 8000, PY, ray="/opt/vllm/bin/ray", ray_port=6380)
    sep = cmd.index("--")
    assert cmd[:sep] == [PY, "-m", RAY_LAUNCH_MODULE, "head", "--ray", "/opt/vllm/bin/ray", "--host", "10.0.0.1",
                         "--ray-port", "6380"]
    assert cmd[sep + 1:] == ["/opt/vllm/bin/vllm", "serve", "/models/big", "--host", "10.0.0.1", "--port", "8000",
                             "--served-model-name", "big", "--tensor-parallel-size", "4",
                             "--pipeline-parallel-size", "2", "--distributed-executor-backend", "ray"]
    assert "--rpc" not in cmd and ray_port_of(cmd) == 6380
    # The profile's own parallel flags win (e.g. tensor parallel over all 16 GPUs, as vLLM's docs allow).
    own = build_command(replace(head, args=("--tensor-parallel-size", "8", "--pipeline_parallel_size=1")),
                        "10.0.0.1", 8000, PY, ray="ray", ray_port=6380)
    assert own.count("--tensor-parallel-size") == 1 and "--pipeline-parallel-size" not in own
    with pytest.raises(ValueError, match="without its Ray port"):
        build_command(head, "10.0.0.1", 8000, PY)


def test_a_worker_joins_its_head_s_ray_address() -> None:
    w = part("worker", 1, peers=("10.0.0.1:6380",))
    cmd = build_command(w, "10.0.0.2", 9100, PY, ray="/opt/vllm/bin/ray")
    assert cmd == [PY, "-m", RAY_LAUNCH_MODULE, "worker", "--ray", "/opt/vllm/bin/ray", "--host", "10.0.0.2",
                   "--port", "9100", "--head", "10.0.0.1:6380"]
    assert probes_tcp(w)  # its node manager listens on the agent's port
    with pytest.raises(ValueError, match="without its head's Ray address"):
        build_command(part("worker", 1), "10.0.0.2", 9100, PY)
    assert ray_candidates(w) == ["/opt/vllm/bin/ray", "ray"]
    assert ray_candidates(replace(w, binary=None)) == ["ray"]
    assert split_host_port("[::1]:6380") == ("::1", 6380)
    for bad in ("10.0.0.1", "10.0.0.1:0", "10.0.0.1:x", ":80"):
        with pytest.raises(ValueError):
            split_host_port(bad)


def test_the_ray_port_and_a_worker_s_head_on_the_wire_are_checked() -> None:
    r = EngineReport("big/1", "big", "starting", url="http://10.0.0.1:8000", group_port=6380)
    assert EngineReport.from_wire(r.to_wire()).group_port == 6380
    assert _report(r.to_wire(), "r").group_port == 6380
    for bad in (0, 70000, "6380", 1.5):
        with pytest.raises(WireProtocolError, match="r.group_port"):
            _report(r.to_wire() | {"group_port": bad}, "r")
    w = part("worker", 1, peers=("10.0.0.1:6380",))
    assert _spec(w.to_wire(), "s") == w  # a worker told its head
    with pytest.raises(WireProtocolError, match="a worker has 1 .its head."):
        _spec(replace(w, group=replace(w.group, peers=("a:1", "b:2"))).to_wire(), "s")  # type: ignore[arg-type]
    assert "group_port" not in EngineReport("x", "m", "ready").to_wire()
    for bad in (0, 70000, -1, "6380", True, 1.5, None):
        d = r.to_wire() | {"group_port": bad}
        assert EngineReport.from_wire(d).group_port is None


def big_vllm() -> ModelDeploy:
    return ModelDeploy("big", 1, Demand(gpus=2), EngineSpec("", "big", "vllm", "/models/big"),
                       Policy(nodes=2, keep_within="rack"))


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def write(self, *a: Any) -> None:
        self.calls.append(("write", a[1].replica if hasattr(a[1], "replica") else a[1]))

    def record(self, event: str, **kw: Any) -> None:
        self.calls.append(("record", event))

    def push(self, node: str) -> None:
        self.calls.append(("push", node))


class Plane:
    def __init__(self, asg: dict[str, Assignment]) -> None:
        self.assignments = asg
        self.guard = self.agents = Recorder()
        self.told_workers: dict[str, tuple[int | None, ...]] = {}

    def _row(self, a: Assignment) -> Assignment:
        return a


def report(a: Assignment, state: str, pid: int, port: int, group_port: int | None = None) -> None:
    a.report = EngineReport(a.replica, a.model, state, spec_hash=a.spec.spec_hash(), generation=a.spec.generation,
                            url=f"http://10.0.0.{port % 10}:{port}", pid=pid, group_port=group_port)


def test_the_head_starts_first_and_its_workers_are_told_its_ray_address() -> None:
    nodes, asg = fleet(), {}
    run({"big": big_vllm()}, nodes, asg, ids())
    (gid, _), = groups(asg).items()
    head, w = asg[gid], asg[worker_id(gid, 1)]
    plane = Plane(asg)
    assert head_startable(head) and not head_startable(w)  # the opposite of llama.cpp's order
    assert _group_detail(head, {gid: [w]}) == "starting its Ray head: its 1 workers join once it runs"
    sync_head(plane, head)  # type: ignore[arg-type]
    assert plane.guard.calls == []  # the head has not reported its Ray port
    report(head, "starting", 10, 8001)  # no Ray port yet
    sync_head(plane, head)  # type: ignore[arg-type]
    assert plane.guard.calls == [] and ray_head_address(head) is None
    report(head, "starting", 10, 8001, group_port=6381)
    assert ray_head_address(head) == "10.0.0.1:6381"
    sync_head(plane, head)  # type: ignore[arg-type]
    assert w.spec.group.peers == ("10.0.0.1:6381",) and head_startable(w)  # type: ignore[union-attr]
    assert ("push", w.node) in plane.guard.calls and ("record", "group ready") in plane.guard.calls
    assert _group_detail(head, {gid: [w]}) == "not routed until vLLM serves and its workers run: 0 of 1 ready"
    assert not group_ready(head, [w])
    report(w, "ready", 20, 9002)
    assert not group_ready(head, [w])  # vLLM does not serve yet
    report(head, "ready", 10, 8001, group_port=6381)
    assert group_ready(head, [w])
    plane.guard.calls.clear()
    sync_head(plane, head)  # type: ignore[arg-type]
    assert plane.guard.calls == [] and plane.told_workers == {gid: (10, 20)}  # steady; the group runs
    stale = replace(head.spec, generation=head.spec.generation + 1)
    assert not group_ready(replace(head, spec=stale), [w])  # type: ignore[arg-type]


def test_a_new_worker_process_restarts_the_head_and_a_new_head_restarts_the_workers() -> None:
    nodes, asg = fleet(), {}
    run({"big": big_vllm()}, nodes, asg, ids())
    (gid, _), = groups(asg).items()
    head, w = asg[gid], asg[worker_id(gid, 1)]
    plane = Plane(asg)
    report(head, "ready", 10, 8001, group_port=6381)
    sync_head(plane, head)  # type: ignore[arg-type]
    report(w, "ready", 20, 9002)
    sync_head(plane, head)  # type: ignore[arg-type]
    assert plane.told_workers[gid] == (10, 20)
    # The worker's agent restarted it (a crash): vLLM's actors on it are gone.
    report(w, "ready", 21, 9002)
    sync_head(plane, head)  # type: ignore[arg-type]
    assert head.spec.generation == 1 and w.spec.generation == 1 and w.spec.group.peers == ()  # type: ignore[union-attr]
    assert not head_startable(w) and gid not in plane.told_workers
    assert not group_ready(head, [w])
    # The new head reports its Ray port: the worker is started again, at that address.
    report(head, "starting", 11, 8001, group_port=6381)
    sync_head(plane, head)  # type: ignore[arg-type]
    assert w.spec.group.peers == ("10.0.0.1:6381",) and w.spec.generation == 1  # type: ignore[union-attr]
    report(w, "ready", 22, 9002)
    report(head, "ready", 11, 8001, group_port=6381)
    sync_head(plane, head)  # type: ignore[arg-type]
    assert group_ready(head, [w]) and plane.told_workers[gid] == (11, 22)
    # The head crashed and its agent restarted it: only the workers restart.
    report(head, "starting", 12, 8001, group_port=6381)
    sync_head(plane, head)  # type: ignore[arg-type]
    assert head.spec.generation == 1 and w.spec.generation == 2 and w.spec.group.peers == ()  # type: ignore[union-attr]
