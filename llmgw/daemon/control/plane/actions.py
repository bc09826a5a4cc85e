"""What an operator asks of the control plane through the admin API: define, scale and delete
models, restart a replica, label nodes. Changes that must persist are written to the store first
(``StoreGuard.must_write``: a store that cannot write refuses them and nothing changes); a restart
is an action, done even then and written back later. A mixin of :class:`.plane.ControlPlane`,
whose state it works on."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import trio

from llmgw.config import ModelConfig, model_from_dict, model_to_dict
from llmgw.daemon.control.model_deploy import ModelError
from llmgw.fleet.group_parts import worker_id
from llmgw.fleet.types import NodeFacts
from llmgw.lifecycle.config_diff import ScaleOverride

__all__ = ["OperatorActions"]


class OperatorActions:
    # The ControlPlane's state these work on (set in its __init__).
    cfg: Any
    models: dict[str, ModelConfig]
    sources: dict[str, str]
    scale_overrides: dict[str, ScaleOverride]
    deploys: dict[str, Any]
    assignments: dict[str, Any]
    guard: Any
    nodes: Any
    agents: Any
    lifecycle: Any
    _wake: trio.Event

    def _set_model(self, m: ModelConfig, source: str) -> None:
        raise NotImplementedError

    def _row(self, a: Any) -> Any:
        raise NotImplementedError

    def model_record(self, name: str, m: ModelConfig, source: str) -> dict[str, Any]:
        """A model as the store keeps it: with an operator's scale of a config-file model."""
        rec: dict[str, Any] = {"source": source, "model": model_to_dict(m)}
        ov = self.scale_overrides.get(name)
        if ov is not None and source == "config":
            rec["scaled"] = {"count": ov.count, "file_count": ov.file_count}
        return rec

    def put_model(self, data: Any, *, source: str = "api") -> ModelConfig:
        """Create or replace a model from plain data; raises ConfigError naming bad fields."""
        m = model_from_dict(data, "model", pools=self.cfg.pools)
        if self.sources.get(m.name) == "config" and source != "config":
            raise ModelError(f"model {m.name} is defined in the config file; change it there, then "
                             "`llmgw ctl config reload`")
        self._save_model(m, source)
        return m

    def scale(self, name: str, count: int) -> ModelConfig:
        """Set a model's replica count. For a model the config file defines this is an operator
        override, kept in the store until the file's count for the model changes (then the file's
        new count wins: plane/config_reload.py, docs/admin-api.md)."""
        m = self.models.get(name)
        if m is None:
            raise KeyError(name)
        if m.deploy is None:
            raise ModelError(f"model {name} has no [models.deploy] profile: its replicas are static")
        scaled = replace(m, deploy=replace(m.deploy, count=count))
        source = self.sources.get(name, "api")
        before = self.scale_overrides.get(name)
        if source == "config":
            file_count = before.file_count if before is not None else m.deploy.count
            if count == file_count:
                self.scale_overrides.pop(name, None)  # back to the file's own count
            else:
                self.scale_overrides[name] = ScaleOverride(count, file_count)
        try:
            self._save_model(scaled, source)
        except BaseException:
            if before is None:
                self.scale_overrides.pop(name, None)
            else:
                self.scale_overrides[name] = before
            raise
        return scaled

    def _save_model(self, m: ModelConfig, source: str) -> None:
        # Written first: a store that cannot write raises StoreUnavailable and nothing changes.
        self.guard.must_write("put_model", m.name, self.model_record(m.name, m, source))
        self.guard.record("model saved", model=m.name, detail=source)
        self._set_model(m, source)
        self._wake.set()

    def delete_model(self, name: str) -> None:
        if name not in self.models:
            raise KeyError(name)
        if self.sources.get(name) == "config":
            raise ModelError(f"model {name} is defined in the config file; remove it there, then "
                             "`llmgw ctl config reload`")
        self.guard.must_write("delete_model", name)
        self.guard.record("model deleted", model=name)
        self.lifecycle.model_deleted(name)  # its candidate goes too
        del self.models[name]
        self.sources.pop(name, None)
        self.deploys.pop(name, None)
        self._wake.set()

    def restart_replica(self, rid: str) -> None:
        """Restart an engine (also how an operator clears a crash loop). A multi-node replica's head
        restarts with its workers: the group is one replica; a worker's id restarts that worker."""
        head = self.assignments[rid]
        g = head.spec.group
        parts = [head]
        if g is not None and g.role == "head":
            parts += [w for r in range(1, g.size) if (w := self.assignments.get(worker_id(rid, r))) is not None]
        for a in parts:
            a.spec = replace(a.spec, generation=a.spec.generation + 1)
            # An action, not configuration: done even while the store cannot write (written back after).
            self.guard.write("put_assignment", self._row(a))
            self.guard.record("replica restart requested", replica=a.replica, model=a.model, node=a.node)
            self.agents.push(a.node)

    def set_labels(self, node: str, labels: dict[str, str]) -> None:
        self.guard.must_write("set_node_labels", node, labels)  # first: nothing changes if it cannot
        n = self.nodes.nodes.get(node)
        merged = {**(n.operator_labels if n else {}), **labels}
        if n is None:
            self.nodes.remember(node, agent_labels={}, operator_labels=merged, facts=NodeFacts(),
                                now=trio.current_time())
        self.nodes.set_operator_labels(node, merged)
        self._wake.set()

    # -- the facility (plane/facility.py) -----------------------------------------------------------------
    facility: Any

    def hold(self, domain: str, reason: str, drain: bool) -> Any:
        """Hold a domain (DomainError: bad, or no node is in it; StoreUnavailable: nothing changed)."""
        view = self.facility.hold(domain, reason, drain, self.nodes.nodes.values(), time.time())
        self._wake.set()
        return view

    def release(self, domain: str) -> str:
        out = self.facility.release(domain)
        self._wake.set()
        return out

    def facility_view(self) -> Any:
        return self.facility.view(self.nodes.nodes, self.assignments.values(), self.deploys)

    def explain_placement(self, target: str) -> Any:
        return self.facility.explain(target, self.nodes.nodes, self.assignments, self.deploys)

    def remove_labels(self, node: str, keys: list[str]) -> None:
        self.guard.must_write("remove_node_labels", node, keys)
        n = self.nodes.nodes.get(node)
        if n is not None:
            self.nodes.set_operator_labels(node, {k: v for k, v in n.operator_labels.items() if k not in set(keys)})
        self._wake.set()
