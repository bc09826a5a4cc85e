"""Reconciliation: from what should run (models and their replica counts) and what does (nodes,
assignments, the agents' reports) to a plan — replicas to create, drain or write off as lost.

The plan is pure data; the control plane applies it (store, agents, scheduler). Rules:
- an assignment on a lost node is lost (its engine is presumed gone) and is replaced;
- an assignment on a not-ready node is kept: a blip moves nothing;
- a model with fewer running assignments than its count gets new ones (placement v1);
- a model with more drains the extras — those on not-ready nodes first, then engines that are not
  ready (crash loop, failed, starting), then the newest;
- an assignment whose model is gone, or whose spec no longer matches the model's (a changed
  profile), is drained; a changed profile is replaced by a new placement (surge, then drain).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from llmgw.fleet.nodes import Node
from llmgw.fleet.placement import Demand, Placer
from llmgw.fleet.types import EngineReport, EngineSpec

__all__ = ["Assignment", "Desired", "ModelDeploy", "Plan", "reconcile"]

Desired = str  # "run" | "drain" | "stop"


@dataclass
class Assignment:
    replica: str
    model: str
    node: str
    spec: EngineSpec
    demand: Demand
    desired: Desired = "run"
    created_at: float = 0.0  # wall clock
    report: EngineReport | None = None  # the agent's latest word on it
    drain_since: float | None = None  # monotonic, when draining began
    reason: str = ""  # why it is draining / stopping

    @property
    def engine_state(self) -> str:
        if self.report is None:
            return "pending"
        return self.report.state


@dataclass(frozen=True)
class ModelDeploy:
    """A model's managed replicas: how many, what each needs, and the engine spec to run.
    `template.replica` and `template.gpu_indices` are filled per assignment."""

    name: str
    count: int
    demand: Demand
    template: EngineSpec

    def spec_for(self, replica: str, gpus: tuple[int, ...], generation: int = 0) -> EngineSpec:
        return replace(self.template, replica=replica, gpu_indices=gpus, generation=generation)

    def matches(self, a: Assignment) -> bool:
        return a.demand == self.demand and a.spec == self.spec_for(a.replica, a.spec.gpu_indices,
                                                                  a.spec.generation)


@dataclass
class Plan:
    create: list[Assignment] = field(default_factory=list)
    drain: list[tuple[str, str]] = field(default_factory=list)  # (replica, why)
    lost: list[tuple[str, str]] = field(default_factory=list)  # (replica, why)
    unplaceable: dict[str, str] = field(default_factory=dict)  # model -> why

    def __bool__(self) -> bool:
        return bool(self.create or self.drain or self.lost)


_NOT_READY_RANK = {"ready": 3, "unhealthy": 2, "starting": 1, "pending": 1}


def reconcile(models: dict[str, ModelDeploy], nodes: dict[str, Node], assignments: Iterable[Assignment],
              *, new_id: Callable[[str], str], now_wall: float) -> Plan:
    plan = Plan()
    live: list[Assignment] = []
    for a in assignments:
        node = nodes.get(a.node)
        if node is None or node.state == "lost":
            plan.lost.append((a.replica, f"node {a.node} is lost" if node else f"node {a.node} is unknown"))
        else:
            live.append(a)
    placer = Placer(nodes.values(), ((a.node, a.model, a.demand, a.spec.gpu_indices) for a in live))
    by_model: dict[str, list[Assignment]] = {}
    for a in live:
        if a.desired != "run":
            continue
        m = models.get(a.model)
        if m is None:
            plan.drain.append((a.replica, f"model {a.model} was deleted"))
        elif not m.matches(a):
            plan.drain.append((a.replica, f"model {a.model}'s profile changed"))
        else:
            by_model.setdefault(a.model, []).append(a)
    for name in sorted(models):
        m = models[name]
        running = by_model.get(name, [])
        if len(running) < m.count:
            spots, why = placer.place(name, m.demand, m.count - len(running))
            for node, gpus in spots:
                rid = new_id(name)
                plan.create.append(Assignment(rid, name, node, m.spec_for(rid, gpus), m.demand,
                                              created_at=now_wall))
            if why:
                plan.unplaceable[name] = why
        elif len(running) > m.count:
            def keep_rank(a: Assignment) -> tuple[int, int, float]:
                node_ok = 1 if nodes[a.node].state == "ready" else 0
                return (node_ok, _NOT_READY_RANK.get(a.engine_state, 0), -a.created_at)
            extra = sorted(running, key=keep_rank)[:len(running) - m.count]
            plan.drain += [(a.replica, f"scaled to {m.count}") for a in extra]
    return plan
