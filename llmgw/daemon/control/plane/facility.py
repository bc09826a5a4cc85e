"""The control plane's facility side (docs/placement.md): holds (kept in the store), the power
budgets of [facility.budgets], rebalancing's rate limit, the facility listing and placement
explanations. The placement rules themselves are the pure core's (llmgw.fleet.placement)."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from llmgw.admin.schema_facility import (
    MAX_HOLD_REASON,
    DomainView,
    FacilityView,
    HoldView,
)
from llmgw.config import FacilityConfig
from llmgw.daemon.control.store.port import FleetStore
from llmgw.daemon.control.store.guard import StoreGuard
from llmgw.fleet.domains import LEVELS, node_domains, parse_domain
from llmgw.fleet.nodes import Node
from llmgw.fleet.placement import Placer
from llmgw.fleet.placement_explain import AtPlacement, Explanation, at_placement, explain
from llmgw.fleet.reconcile import Assignment, Facility, Hold, ModelDeploy

log = logging.getLogger("llmgw.control")

__all__ = ["FacilityControl"]

MAX_WARNINGS_KEPT = 256  # distinct warnings remembered (each is logged once)
MAX_PLACED_RECORDS = 4096  # placement-time records kept in memory; the oldest placements' go first


class FacilityControl:
    def __init__(self, cfg: FacilityConfig, guard: StoreGuard, store: FleetStore) -> None:
        self.cfg = cfg
        self.guard = guard
        self.budgets = dict(cfg.budgets)
        self.holds: dict[str, tuple[Hold, float]] = {}  # domain -> (hold, created_at)
        for d, row in store.holds().items():
            self.holds[d] = (Hold(row.reason, row.drain), row.created_at)
        self._next_rebalance: float | None = None  # the first round only starts the clock
        self.warnings: dict[str, None] = {}  # ordered set: the latest distinct ones
        # replica -> the verdicts when it was placed (in memory, bounded: docs/placement.md), oldest first
        self.placed: dict[str, AtPlacement] = {}

    def reconfigure(self, cfg: FacilityConfig) -> None:
        """A reloaded config's [facility]: budgets and rebalancing from the next reconcile round."""
        self.cfg = cfg
        self.budgets = dict(cfg.budgets)

    # -- a reconcile round -----------------------------------------------------------------------
    def round(self, now: float) -> Facility:
        """The facility for a reconcile round. Rebalancing is due one interval after the first round
        (a router that just started moves nothing while its agents come back), then every interval."""
        if self._next_rebalance is None:
            self._next_rebalance = now + self.cfg.rebalance_interval_s
        due = self.cfg.rebalance and now >= self._next_rebalance
        if due:
            self._next_rebalance = now + self.cfg.rebalance_interval_s
        return Facility(holds={d: h for d, (h, _) in self.holds.items()}, budgets=self.budgets,
                        rebalance=due, max_moves=self.cfg.rebalance_max_moves)

    def warn(self, warnings: Iterable[str]) -> None:
        """Log each distinct warning once (they come back every round the cause stays)."""
        for w in warnings:
            if w not in self.warnings:
                log.warning("%s", w)
                self.warnings[w] = None
                while len(self.warnings) > MAX_WARNINGS_KEPT:
                    del self.warnings[next(iter(self.warnings))]

    def record_placements(self, created: Iterable[Assignment], nodes: Mapping[str, Node],
                          before: Iterable[Assignment], deploys: Mapping[str, ModelDeploy], now_wall: float) -> None:
        """Keep each new replica's placement-time record: one explanation per model, from the state
        as the round began (`before`: what ran; `nodes` as the round saw them)."""
        heads = [a for a in created if not a.spec.is_worker]
        if not heads:
            return
        p = self.placer(nodes.values(), [a for a in before if a.desired in ("run", "drain")], deploys)
        by_model: dict[str, Explanation] = {}
        for a in heads:
            e = by_model.get(a.model)
            if e is None:
                e = by_model[a.model] = explain(p, a.model, a.demand)
            self.placed.pop(a.replica, None)
            self.placed[a.replica] = at_placement(e, a.node, now_wall)
        while len(self.placed) > MAX_PLACED_RECORDS:
            del self.placed[next(iter(self.placed))]

    # -- operator actions --------------------------------------------------------------------------
    def hold(self, text: str, reason: str, drain: bool, nodes: Iterable[Node], now_wall: float) -> HoldView:
        """Raises DomainError (bad or unknown domain: the message names the known ones), ValueError
        (a bad reason) or StoreUnavailable; nothing changes then."""
        domain = parse_domain(text, known_domains(nodes))
        if len(reason) > MAX_HOLD_REASON or any(not c.isprintable() for c in reason):
            raise ValueError(f"reason: at most {MAX_HOLD_REASON} printable characters")
        created = self.holds[domain][1] if domain in self.holds else now_wall
        self.guard.must_write("put_hold", domain, reason=reason, drain=drain, now=created)
        self.holds[domain] = (Hold(reason, drain), created)
        self.guard.record("domain held", detail=f"{domain}{' with drain' if drain else ''}"
                                                f"{': ' + reason if reason else ''}")
        log.info("domain %s held%s%s", domain, " with drain" if drain else "", f" ({reason})" if reason else "")
        return HoldView(domain, reason, drain, created, 0)

    def release(self, text: str) -> str:
        """Raises DomainError (bad syntax), KeyError (not held) or StoreUnavailable."""
        domain = parse_domain(text)
        if domain not in self.holds:
            raise KeyError(domain)
        self.guard.must_write("delete_hold", domain)
        del self.holds[domain]
        self.guard.record("domain released", detail=domain)
        log.info("domain %s released", domain)
        return domain

    # -- views -------------------------------------------------------------------------------------
    def placer(self, nodes: Iterable[Node], assignments: Iterable[Assignment],
               deploys: Mapping[str, ModelDeploy]) -> Placer:
        return Placer(nodes, ((a.node, a.model, a.demand, a.spec.gpu_indices, a.spec.role)
                              for a in assignments),
                      holds={d: h.reason for d, (h, _) in self.holds.items()}, budgets=self.budgets,
                      policies={n: m.policy for n, m in deploys.items()})

    def view(self, nodes: Mapping[str, Node], assignments: Iterable[Assignment],
             deploys: Mapping[str, ModelDeploy]) -> FacilityView:
        live = [a for a in assignments if a.desired in ("run", "drain")]
        p = self.placer(nodes.values(), live, deploys)
        self.warn(p.warnings)
        per_dom: dict[str, dict[str, Any]] = {}
        parents: dict[str, set[str]] = {}
        doms_of = {name: node_domains(n.labels) for name, n in nodes.items()}
        replicas = Counter(a.node for a in live)
        for name, n in nodes.items():
            doms = doms_of[name]
            outer = ""
            b = p.bins.get(name) or p.others.get(name)
            unknown = b is None or b.power.source == "unknown"
            for i, d in enumerate(doms):
                if not d:
                    continue
                e = per_dom.setdefault(d, {"level": LEVELS[i], "nodes": 0, "ready": 0, "replicas": 0,
                                           "unknown": 0})
                e["nodes"] += 1
                e["ready"] += n.state == "ready"
                e["replicas"] += replicas[name]
                e["unknown"] += unknown
                parents.setdefault(d, set()).add(outer)
                outer = d
        out = []
        for d, e in sorted(per_dom.items(), key=lambda de: (LEVELS.index(de[1]["level"]), de[0])):
            hold = self.holds.get(d)
            ps = parents.get(d, set())
            out.append(DomainView(domain=d, level=e["level"], parent=next(iter(ps)) or None if len(ps) == 1 else None,
                                  nodes=e["nodes"], ready_nodes=e["ready"], replicas=e["replicas"],
                                  held=hold is not None, hold_reason=hold[0].reason if hold else "",
                                  hold_drain=hold[0].drain if hold else False, draw_w=round(p.draw[d], 1),
                                  cap_w=self.budgets.get(d), unknown_power_nodes=e["unknown"]))
        holds = [HoldView(d, h.reason, h.drain, created, per_dom.get(d, {}).get("replicas", 0))
                 for d, (h, created) in sorted(self.holds.items())]
        return FacilityView(domains=out, holds=holds,
                            budgets_without_nodes=sorted(set(self.budgets) - set(per_dom)),
                            warnings=list(self.warnings)[-20:])

    def explain(self, target: str, nodes: Mapping[str, Node], assignments: Mapping[str, Assignment],
                deploys: Mapping[str, ModelDeploy]) -> Explanation:
        """A replica id or a model name; KeyError for neither (or a model without a deploy profile)."""
        live = [a for a in assignments.values() if a.desired in ("run", "drain")]
        a = assignments.get(target)
        if a is not None:
            g = a.spec.group
            group = g.group if g is not None else None
            p = self.placer(nodes.values(), [x for x in live if x.replica != target], deploys)
            e = explain(p, a.model, a.demand, replica=a.replica, node=a.node)
            if g is not None:  # a part of a multi-node replica: name the group's nodes
                parts = sorted((x for x in assignments.values() if x.spec.group is not None
                                and x.spec.group.group == group), key=lambda x: x.spec.group.rank)  # type: ignore[union-attr]
                pol = deploys[a.model].policy if a.model in deploys else None
                within = f", all inside one {pol.keep_within}" if pol is not None and pol.keep_within else ""
                e.why += (f"; {'the head' if g.role == 'head' else f'worker {g.rank}'} of a {g.size}-node replica "
                          f"on {', '.join(x.node for x in parts)}{within} (placed together, all or nothing)")
            e.at_placement = self.placed.get(target)
            return e
        m = deploys.get(target)
        if m is None:
            raise KeyError(target)
        return explain(self.placer(nodes.values(), live, deploys), m.name, m.demand)

    def held_domains(self, labels: dict[str, str]) -> list[str]:
        return [d for d in node_domains(labels) if d and d in self.holds]


def known_domains(nodes: Iterable[Node]) -> set[str]:
    return {d for n in nodes for d in node_domains(n.labels) if d}
