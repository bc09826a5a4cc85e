"""Engines an agent runs that the store does not know: what a deleted, replaced or restored-from-an-
older-backup store looks like from the fleet.

Before, the router's desired set for that node simply left them out and the agent stopped them: a
lost store restarted the whole fleet (minutes of downtime with real vLLM). Now an engine the
agent reports is told apart:

- **known**: an assignment of this node — the normal case;
- **removed**: the router placed it once and removed it (it is in this run's list of removed
  replicas, or the store's history has it and its newest event is not "engine unknown"): left out
  of the desired set, so the agent stops it, as before;
- **unknown**: nobody here has heard of it. Without ``--adopt`` it is *kept*: its spec (which the
  agent's hello carries) stays in the node's desired set so the agent leaves it running, it is not
  routed (the router does not know it is wanted), and nothing new is placed on its node — the
  node's GPUs are taken by engines outside placement's books — until it is adopted or gone. A loud
  warning says so and names ``--adopt``. With ``--adopt`` the control plane adopts it as an
  assignment instead (`adopt`), and its model from the config, the store, or — for a model
  neither defines — from the engine's own spec (`adopted_model`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

import trio

from llmgw.config import ConfigError, ModelConfig, model_from_dict, model_to_dict
from llmgw.daemon.control.store.port import FleetStore
from llmgw.daemon.control.store.guard import StoreGuard, StoreUnavailable
from llmgw.fleet.placement import Demand
from llmgw.fleet.reconcile import Assignment
from llmgw.fleet.types import EngineReport, EngineSpec

log = logging.getLogger("llmgw.control")

__all__ = ["KEPT_STATES", "MAX_PER_NODE", "UNKNOWN_EVENT", "UnknownEngine", "UnknownEngines", "adopt",
           "adopted_model"]

UNKNOWN_EVENT = "engine unknown"  # the history event; it alone does not make a replica known
KEPT_STATES = frozenset({"starting", "ready", "unhealthy", "crashed", "failed", "crashloop"})
MAX_REMOVED = 100_000  # replica ids removed in this run, remembered (oldest forgotten first)
MAX_PER_NODE = 256  # engines kept (or adopted) per node: an agent's reports cannot grow the router without bound


@dataclass
class UnknownEngine:
    node: str
    spec: EngineSpec
    report: EngineReport


class UnknownEngines:
    def __init__(self, guard: StoreGuard) -> None:
        self.guard = guard
        self.engines: dict[str, UnknownEngine] = {}  # replica -> the engine kept running, unrouted
        self._removed: dict[str, None] = {}  # an ordered set

    # -- what the router removed -------------------------------------------------------------------
    def removed(self, replica: str) -> None:
        self._removed[replica] = None
        if len(self._removed) > MAX_REMOVED:
            del self._removed[next(iter(self._removed))]

    def was_removed(self, replica: str) -> bool:
        """Did this router (this run, or an earlier one per the store's history) remove it? A store
        that cannot be read answers no: keeping an engine running is the safe mistake."""
        if replica in self._removed:
            return True

        def newest(st: FleetStore) -> Any:
            return st.history(limit=1, replica=replica)

        try:
            rows = self.guard.read("history", newest)
        except StoreUnavailable:
            return False
        if rows and rows[0].event != UNKNOWN_EVENT:
            self.removed(replica)
            return True
        return False

    # -- kept engines ------------------------------------------------------------------------------
    def report(self, node: str, report: EngineReport) -> bool:
        """An engine the router has no assignment for. True when it is (still) kept running."""
        rid = report.replica
        if report.state not in KEPT_STATES:
            self.engines.pop(rid, None)  # stopping/stopped: going away on its own
            return False
        entry = self.engines.get(rid)
        if entry is not None and entry.node == node:
            entry.report = report
            if report.spec is not None:
                entry.spec = report.spec
            return True
        if self.was_removed(rid):
            return False
        if report.spec is not None and (report.spec.replica, report.spec.model) != (rid, report.model):
            log.warning("node %s: the spec it reports for engine %s is another engine's; ignored", node, rid)
            report.spec = None
        if sum(1 for e in self.engines.values() if e.node == node) >= MAX_PER_NODE:
            log.warning("node %s runs more than %d engines the store does not know: %s is not kept", node,
                        MAX_PER_NODE, rid)
            return False
        if report.spec is None:
            log.warning("node %s runs engine %s (model %s) that the store does not know, and its agent did not "
                        "send its spec (an older agent?): it cannot be kept and will be stopped", node, rid,
                        report.model)
            return False
        self.engines[rid] = UnknownEngine(node, report.spec, report)
        self.guard.record(UNKNOWN_EVENT, replica=rid, model=report.model, node=node,
                          detail="not in the store: left running, not routed")
        return True

    def warn(self, node: str, fresh_store: bool) -> None:
        """One loud line per hello for the node's kept engines."""
        mine = sorted(r for r, e in self.engines.items() if e.node == node)
        if not mine:
            return
        why = ("the store was created at this start: if it was deleted or moved, "
               if fresh_store else "if the store was replaced or restored from an older backup, ")
        log.error("node %s runs %d engine%s the store does not know (%s): left running, not routed, and nothing "
                  "new is placed on %s. %srestart the router with `llmgw daemon --adopt` to adopt them as "
                  "replicas (to stop them instead: adopt them and scale or delete their model, or stop that "
                  "node's agent)", node, len(mine), "" if len(mine) == 1 else "s", ", ".join(mine), node, why)

    def node_gone(self, node: str, keep: set[str] | None = None) -> None:
        """The node's agent left, was lost, or said hello without some of them (`keep`: the ones it
        still runs)."""
        for rid in [r for r, e in self.engines.items() if e.node == node and (keep is None or r not in keep)]:
            del self.engines[rid]

    def specs_for(self, node: str) -> list[EngineSpec]:
        return [e.spec for e in self.engines.values() if e.node == node]

    def held_nodes(self) -> set[str]:
        return {e.node for e in self.engines.values()}

    def by_node(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for rid, e in sorted(self.engines.items()):
            out.setdefault(e.node, []).append(rid)
        return out


def adopted_model(spec: EngineSpec, count: int, pools: Any) -> ModelConfig | None:
    """A model definition rebuilt from an adopted engine's spec, for a model that neither the
    config nor the store defines (an API-made model lost with the store): the same command line,
    so the adopted engines match it. What the spec does not carry takes its default (GPU memory,
    host memory, node selector, pool, weight): check it with `llmgw ctl models NAME`."""
    deploy: dict[str, Any] = {"count": count, "model_path": spec.model_path, "simulate": spec.simulate,
                              "args": list(spec.args), "env": [f"{k}={v}" for k, v in spec.env],
                              "gpus": len(spec.gpu_indices), "health_timeout_s": spec.health_timeout_s}
    if spec.binary:
        deploy["binary"] = spec.binary
    model: dict[str, Any] = {"name": spec.model, "engine": spec.engine, "deploy": deploy}
    if spec.lora is not None:  # the adapters it started with (vLLM's on-demand ones are not in a spec)
        static = {"static": True} if spec.engine == "vllm" else {}
        model["adapters"] = [{"name": n, "source": s, **static} for n, s in spec.lora.adapters]
        if spec.engine == "vllm":
            model["max_loaded_adapters"], model["max_lora_rank"] = spec.lora.max_loras, spec.lora.max_rank
    try:
        return model_from_dict(model, f"adopted model {spec.model}", pools=pools)
    except ConfigError as e:
        log.error("engine of model %s cannot be adopted: its spec is not a valid model: %s", spec.model, e)
        return None


class AdoptHost(Protocol):
    """What `adopt` reads and calls of the control plane (plane/plane.py)."""
    cfg: Any  # the pools an adopted model's rebuilt definition may name
    models: dict[str, ModelConfig]
    sources: dict[str, str]
    deploys: dict[str, Any]
    assignments: dict[str, Assignment]
    urls: dict[str, str]
    unknown: UnknownEngines
    guard: StoreGuard
    agents: Any  # AgentSessions: push
    _wake: trio.Event

    def _set_model(self, m: ModelConfig, source: str) -> None: ...

    def _row(self, a: Assignment) -> Any: ...

    def _on_report(self, node: str, report: EngineReport | None, a: Assignment | None = None) -> None: ...


def adopt(plane: AdoptHost, node: str, report: EngineReport) -> bool:
    """`--adopt`: an engine the store does not know becomes an assignment (its model from the
    config or the store, or rebuilt from its spec). False if it cannot be (it is then kept or
    stopped as without --adopt)."""
    spec = report.spec
    if spec is None or report.state not in KEPT_STATES or (spec.replica, spec.model) != (report.replica,
                                                                                         report.model):
        return False
    if plane.unknown.was_removed(report.replica):
        return False
    if sum(1 for a in plane.assignments.values() if a.node == node) >= MAX_PER_NODE:
        log.warning("node %s: engine %s not adopted: the node has %d replicas already", node, report.replica,
                    MAX_PER_NODE)
        return False
    m = plane.models.get(spec.model)
    if spec.role and (m is None or plane.sources.get(spec.model) == "adopted"):
        # a prefill/decode group's engine: one engine's spec cannot tell the model's groups
        log.warning("node %s: engine %s not adopted: it is a %s replica of model %s, which neither the config "
                    "nor the store defines (define the model with its groups, then adopt)", node, report.replica,
                    spec.role, spec.model)
        return False
    if m is None or plane.sources.get(spec.model) == "adopted":
        count = 1 + sum(1 for a in plane.assignments.values() if a.model == spec.model and a.desired == "run")
        rebuilt = adopted_model(spec, count, plane.cfg.pools)
        if rebuilt is None:
            return False
        plane._set_model(rebuilt, "adopted")
        plane.guard.write("put_model", rebuilt.name, {"source": "adopted", "model": model_to_dict(rebuilt)})
        m = rebuilt
    dep = plane.deploys.get(m.name)
    demand = dep.demand if dep is not None else Demand(gpus=len(spec.gpu_indices))
    a = Assignment(spec.replica, spec.model, node, spec, demand, created_at=time.time())
    plane.assignments[a.replica] = a
    plane.unknown.engines.pop(a.replica, None)
    if report.url:
        plane.urls[a.replica] = report.url
    plane.guard.write("put_assignment", plane._row(a))
    plane.guard.record("replica adopted", replica=a.replica, model=a.model, node=node,
                      detail=f"{report.state} at {report.url or '?'} (pid {report.pid})")
    log.warning("adopted engine %s of model %s on %s (%s; pid %s) as a replica", a.replica, a.model, node,
                report.state, report.pid)
    plane._on_report(node, report, a)
    plane.agents.push(node)
    plane._wake.set()
    return True
