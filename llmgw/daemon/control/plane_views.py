"""The control plane's state as the admin API shows it: nodes, replicas (placed on agents) and
models, built from the plane's tables at the time of asking."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from llmgw.admin.schema import ModelView, NodeView, ReplicaView
from llmgw.admin.views import node_facts_view
from llmgw.config import ModelConfig, model_to_dict
from llmgw.daemon.router.control_port import RouterPort
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


def replica_views(assignments: Iterable[Assignment], router: RouterPort) -> list[ReplicaView]:
    out = []
    for a in sorted(assignments, key=lambda a: a.replica):
        r = a.report
        st = router.replica_state(a.replica)
        out.append(ReplicaView(
            replica=a.replica, model=a.model, node=a.node, desired=a.desired,
            state=a.engine_state, url=r.url if r else None, pid=r.pid if r else None,
            restarts=r.restarts if r else 0, detail=r.detail if r else "",
            log_tail=list(r.log_tail) if r else [], adopted=r.adopted if r else False,
            gpus=list(a.spec.gpu_indices), generation=a.spec.generation, reason=a.reason,
            routable=st is not None and st.routable,
            inflight=st.inflight if st else 0, created_at=a.created_at,
        ))
    return out


def model_views(models: Mapping[str, ModelConfig], sources: Mapping[str, str], assignments: Iterable[Assignment],
                unplaceable: Mapping[str, str]) -> list[ModelView]:
    by_model: dict[str, list[Assignment]] = {}
    for a in assignments:
        if not a.spec.is_worker:  # a multi-node replica counts once: its head
            by_model.setdefault(a.model, []).append(a)
    out = []
    for name in sorted(models):
        m = models[name]
        mine = by_model.get(name, [])
        out.append(ModelView(
            name=name, engine=m.engine, source=sources.get(name, "api"),
            desired_replicas=m.deploy.count if m.deploy else None,
            replicas=len([a for a in mine if a.desired == "run"]),
            ready=len([a for a in mine if a.engine_state == "ready" and a.desired == "run"]),
            static_replicas=len(m.replicas), unplaceable=unplaceable.get(name),
            definition=model_to_dict(m),
        ))
    return out
