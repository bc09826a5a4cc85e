"""What an operator asks of the control plane through the admin API: define, scale and delete
models, restart a replica, label nodes. Changes that must persist are written to the store first
(``StoreGuard.must_write``: a store that cannot write refuses them and nothing changes); a restart
is an action, done even then and written back later. The plane holds one (``plane.actions``);
it reaches the plane's state only through :class:`ActionsHost`."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Protocol

import trio

from llmgw.config import ModelConfig, model_from_dict, model_to_dict
from llmgw.daemon.control.model_deploy import ModelError
from llmgw.fleet.group_parts import worker_id
from llmgw.fleet.types import NodeFacts
from llmgw.lifecycle.config_diff import ScaleOverride

__all__ = ["ActionsHost", "OperatorActions"]


class ActionsHost(Protocol):
    """What the operator's actions read and call of the control plane (plane/plane.py)."""
    cfg: Any  # the pools a model may name
    models: dict[str, ModelConfig]
    sources: dict[str, str]
    scale_overrides: dict[str, ScaleOverride]
    deploys: dict[str, Any]
    assignments: dict[str, Any]
    guard: Any  # StoreGuard: must_write, write, record
    nodes: Any  # NodeRegistry
    agents: Any  # AgentSessions: push
    lifecycle: Any  # Lifecycle: model_deleted
    facility: Any  # FacilityControl
    autoscaling: Any  # Autoscaling: pins and releases (daemon/control/autoscaling.py)
    _wake: trio.Event

    def _set_model(self, m: ModelConfig, source: str) -> None: ...

    def _row(self, a: Any) -> Any: ...


class OperatorActions:
    def __init__(self, plane: ActionsHost) -> None:
        self.plane = plane

    def model_record(self, name: str, m: ModelConfig, source: str) -> dict[str, Any]:
        """A model as the store keeps it: with an operator's scale of a config-file model."""
        p = self.plane
        rec: dict[str, Any] = {"source": source, "model": model_to_dict(m)}
        ov = p.scale_overrides.get(name)
        if ov is not None and source == "config":
            rec["scaled"] = {"count": ov.count, "file_count": ov.file_count}
        return rec

    def put_model(self, data: Any, *, source: str = "api") -> ModelConfig:
        """Create or replace a model from plain data; raises ConfigError naming bad fields."""
        p = self.plane
        m = model_from_dict(data, "model", pools=p.cfg.pools)
        if p.sources.get(m.name) == "config" and source != "config":
            raise ModelError(f"model {m.name} is defined in the config file; change it there, then "
                             "`llmgw ctl config reload`")
        self.save_model(m, source)
        return m

    def scale(self, name: str, count: int) -> ModelConfig:
        """Set a model's replica count. For a model the config file defines this is an operator
        override, kept in the store until the file's count for the model changes (then the file's
        new count wins: plane/config_reload.py, docs/admin-api.md)."""
        p = self.plane
        m = p.models.get(name)
        if m is None:
            raise KeyError(name)
        if m.deploy is None:
            raise ModelError(f"model {name} has no [models.deploy] profile: its replicas are static")
        if m.deploy.roles:
            raise ModelError(f"model {name} has prefill/decode groups ([[models.deploy.roles]]): each group's count "
                             "is in its definition (`llmgw ctl models update`); scaling a group is not supported yet")
        if m.autoscale is not None:  # the autoscaler's: pinned at `count` until released
            p.autoscaling.pin(name, count)
            return m
        scaled = replace(m, deploy=replace(m.deploy, count=count))
        source = p.sources.get(name, "api")
        before = p.scale_overrides.get(name)
        if source == "config":
            file_count = before.file_count if before is not None else m.deploy.count
            if count == file_count:
                p.scale_overrides.pop(name, None)  # back to the file's own count
            else:
                p.scale_overrides[name] = ScaleOverride(count, file_count)
        try:
            self.save_model(scaled, source)
        except BaseException:
            if before is None:
                p.scale_overrides.pop(name, None)
            else:
                p.scale_overrides[name] = before
            raise
        return scaled

    def release_scale(self, name: str) -> ModelConfig:
        """An autoscaled model's pin (``ctl scale``) goes: the autoscaler decides its count again."""
        p = self.plane
        m = p.models.get(name)
        if m is None:
            raise KeyError(name)
        if m.autoscale is None:
            raise ModelError(f"model {name} has no [models.autoscale]: its count is what `llmgw ctl scale` sets")
        p.autoscaling.release(name)
        return m

    def save_model(self, m: ModelConfig, source: str) -> None:
        p = self.plane
        # Written first: a store that cannot write raises StoreUnavailable and nothing changes.
        p.guard.must_write("put_model", m.name, self.model_record(m.name, m, source))
        p.guard.record("model saved", model=m.name, detail=source)
        p._set_model(m, source)
        p._wake.set()

    def delete_model(self, name: str) -> None:
        p = self.plane
        if name not in p.models:
            raise KeyError(name)
        if p.sources.get(name) == "config":
            raise ModelError(f"model {name} is defined in the config file; remove it there, then "
                             "`llmgw ctl config reload`")
        p.guard.must_write("delete_model", name)
        p.guard.record("model deleted", model=name)
        p.lifecycle.model_deleted(name)  # its candidate goes too
        p.autoscaling.model_deleted(name)
        del p.models[name]
        p.sources.pop(name, None)
        p.deploys.pop(name, None)
        p._wake.set()

    def restart_replica(self, rid: str) -> None:
        """Restart an engine (also how an operator clears a crash loop). A multi-node replica's head
        restarts with its workers: the group is one replica; a worker's id restarts that worker."""
        p = self.plane
        head = p.assignments[rid]
        g = head.spec.group
        parts = [head]
        if g is not None and g.role == "head":
            parts += [w for r in range(1, g.size) if (w := p.assignments.get(worker_id(rid, r))) is not None]
        for a in parts:
            a.spec = replace(a.spec, generation=a.spec.generation + 1)
            # An action, not configuration: done even while the store cannot write (written back after).
            p.guard.write("put_assignment", p._row(a))
            p.guard.record("replica restart requested", replica=a.replica, model=a.model, node=a.node)
            p.agents.push(a.node)

    def set_labels(self, node: str, labels: dict[str, str]) -> None:
        p = self.plane
        p.guard.must_write("set_node_labels", node, labels)  # first: nothing changes if it cannot
        n = p.nodes.nodes.get(node)
        merged = {**(n.operator_labels if n else {}), **labels}
        if n is None:
            p.nodes.remember(node, agent_labels={}, operator_labels=merged, facts=NodeFacts(),
                                now=trio.current_time())
        p.nodes.set_operator_labels(node, merged)
        p._wake.set()

    # -- the facility (plane/facility.py) ----------------------------------------------------------
    def hold(self, domain: str, reason: str, drain: bool) -> Any:
        """Hold a domain (DomainError: bad, or no node is in it; StoreUnavailable: nothing changed)."""
        p = self.plane
        view = p.facility.hold(domain, reason, drain, p.nodes.nodes.values(), time.time())
        p._wake.set()
        return view

    def release(self, domain: str) -> str:
        p = self.plane
        out = p.facility.release(domain)
        p._wake.set()
        return out

    def facility_view(self) -> Any:
        p = self.plane
        return p.facility.view(p.nodes.nodes, p.assignments.values(), p.deploys)

    def explain_placement(self, target: str) -> Any:
        p = self.plane
        return p.facility.explain(target, p.nodes.nodes, p.assignments, p.deploys)

    def remove_labels(self, node: str, keys: list[str]) -> None:
        p = self.plane
        p.guard.must_write("remove_node_labels", node, keys)
        n = p.nodes.nodes.get(node)
        if n is not None:
            p.nodes.set_operator_labels(node, {k: v for k, v in n.operator_labels.items() if k not in set(keys)})
        p._wake.set()
