"""The control plane's state as the admin API shows it: nodes, replicas (placed on agents) and
models, built from the plane's tables at the time of asking."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from llmgw.admin.schema import ModelView, NodeView, ReplicaView, RoleGroupView
from llmgw.admin.views import node_facts_view
from llmgw.config import ModelConfig, model_to_dict
from llmgw.daemon.router.control_port import RouterPort
from llmgw.fleet.engine_cmd import ray_group
from llmgw.fleet.group_parts import group_ready, workers_of
from llmgw.fleet.nodes import Node, location
from llmgw.fleet.reconcile import Assignment

__all__ = ["model_views", "node_views", "replica_views"]


def node_views(nodes: Iterable[Node], assignments: Iterable[Assignment], now: float,
               held: Callable[[dict[str, str]], list[str]] = lambda labels: []) -> list[NodeView]:
    """`held`: a node's labels -> the held facility domains it is in."""
    by_node: dict[str, list[str]] = {}
    for a in assignments:
        by_node.setdefault(a.node, []).append(a.replica)
    out = []
    for n in sorted(nodes, key=lambda n: n.name):
        out.append(NodeView(
            name=n.name, state=n.state, since_s=round(now - n.since, 3), reason=n.reason,
            connected=n.connected, agent_id=n.agent_id,
            last_seen_s=None if n.last_seen is None else round(now - n.last_seen, 3),
            labels=n.labels, agent_labels=n.agent_labels, operator_labels=n.operator_labels,
            location=location(n.labels), facts=node_facts_view(n.facts),
            replicas=sorted(by_node.get(n.name, [])), held=held(n.labels),
        ))
    return out


def _group_detail(a: Assignment, workers: Mapping[str, list[Assignment]]) -> str:
    """A multi-node head's word on its workers, when the group is not (yet) whole and ready."""
    g = a.spec.group
    if g is None or g.role != "head":
        return ""
    ws = workers.get(a.replica, [])
    if group_ready(a, ws):
        return ""
    ready = sum(1 for w in ws if w.engine_state == "ready")
    if ray_group(a.spec):  # vLLM on Ray: the head runs first, its workers join its Ray head
        told = sum(1 for w in ws if w.spec.group is not None and len(w.spec.group.peers) == 1)
        if told < g.size - 1:
            return f"starting its Ray head: its {g.size - 1} workers join once it runs"
        return f"not routed until vLLM serves and its workers run: {ready} of {g.size - 1} ready"
    waiting = "waiting for" if len(g.peers) != g.size - 1 else "not routed until"
    return f"{waiting} its workers: {ready} of {g.size - 1} ready"


def replica_views(assignments: Iterable[Assignment], router: RouterPort) -> list[ReplicaView]:
    out = []
    assignments = list(assignments)
    workers = workers_of(assignments) if any(a.spec.group is not None for a in assignments) else {}
    for a in sorted(assignments, key=lambda a: a.replica):
        r = a.report
        st = router.replica_state(a.replica)
        out.append(ReplicaView(
            replica=a.replica, model=a.model, node=a.node, desired=a.desired,
            state=a.engine_state, url=r.url if r else None, pid=r.pid if r else None,
            restarts=r.restarts if r else 0,
            detail=_group_detail(a, workers) or (r.detail if r else "") if workers else (r.detail if r else ""),
            log_tail=list(r.log_tail) if r else [], adopted=r.adopted if r else False,
            gpus=list(a.spec.gpu_indices), generation=a.spec.generation, reason=a.reason,
            routable=st is not None and st.routable,
            inflight=st.inflight if st else 0, created_at=a.created_at, role=a.spec.role or "both",
        ))
    return out


def model_views(models: Mapping[str, ModelConfig], sources: Mapping[str, str], assignments: Iterable[Assignment],
                unplaceable: Mapping[str, str]) -> list[ModelView]:
    by_model: dict[str, list[Assignment]] = {}
    assignments = list(assignments)
    workers = workers_of(assignments) if any(a.spec.group is not None for a in assignments) else {}
    for a in assignments:
        if not a.spec.is_worker:  # a multi-node replica counts once: its head
            by_model.setdefault(a.model, []).append(a)
    out = []
    for name in sorted(models):
        m = models[name]
        mine = [a for a in by_model.get(name, []) if a.desired == "run"]
        # a multi-node replica is ready when its whole group is
        ready = [a for a in mine if a.engine_state == "ready"
                 and (a.spec.group is None or group_ready(a, workers.get(a.replica, [])))]
        out.append(ModelView(
            name=name, engine=m.engine, source=sources.get(name, "api"),
            desired_replicas=m.deploy.replicas if m.deploy else None,
            replicas=len(mine), ready=len(ready),
            static_replicas=len(m.replicas), unplaceable=unplaceable.get(name),
            definition=model_to_dict(m), groups=_role_groups(m, mine, ready),
        ))
    return out


def _role_groups(m: ModelConfig, mine: list[Assignment], ready: list[Assignment]) -> list[RoleGroupView]:
    """A disaggregated model's roles: its deploy groups (in the definition's order), then the roles
    only static endpoints have; none for a model whose replicas all do both."""
    static = {r.role: sum(1 for x in m.replicas if x.role == r.role) for r in m.replicas if r.role != "both"}
    groups = m.deploy.roles if m.deploy else ()
    out = [RoleGroupView(role=g.role, desired=g.count, replicas=sum(1 for a in mine if a.spec.role == g.role),
                         ready=sum(1 for a in ready if a.spec.role == g.role), static=static.pop(g.role, 0))
           for g in groups]
    out += [RoleGroupView(role=role, desired=0, replicas=0, ready=0, static=n) for role, n in sorted(static.items())]
    return out
