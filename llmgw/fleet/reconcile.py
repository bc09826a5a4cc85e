"""Reconciliation: from what should run (models and their replica counts) and what does (nodes,
assignments, the agents' reports) to a plan — replicas to create, drain or write off as lost.

The plan is pure data; the control plane applies it (store, agents, scheduler). Rules:
- an assignment on a lost node is lost (its engine is presumed gone) and is replaced;
- an assignment on a not-ready node is kept: a blip moves nothing;
- a model with fewer running assignments than its count gets new ones (placement v1);
- a model with more drains the extras — those on not-ready nodes first, then engines that are not
  ready (crash loop, failed, starting), then the newest;
- an assignment whose model is gone, or whose spec no longer matches the model's (a changed
  profile), is drained; a changed profile is replaced by a new placement (surge, then drain);
- an assignment in a domain held with drain, or chosen by rebalancing, is *moving*: a replacement is
  placed elsewhere first (surge), and the moving one drains only as its replacements are ready, so
  the model's ready replicas never drop below its count (or below what it had, with no room);
  when the replacements cannot be placed, the model's reason says it is replacements that are
  missing and how many of its replicas still serve (it is not short of replicas);
- a multi-node replica (``Policy.nodes > 1``) is a group of assignments, one per node: its head
  (the replica: counted, routed) and its workers, which follow it. The group is whole or gone: a
  part on a lost node, or a part missing, writes the whole group off (lost) and a new group is
  placed; a head that drains takes its workers with it (group_parts.py);
- rebalancing (``Facility.rebalance``): a model whose replicas are all ready and whose spread at a
  level is past its max skew moves one replica from its most-loaded domain, when the move lowers
  the skew; at most ``Facility.max_moves`` moves a round (the shell rate-limits the rounds);
- a disaggregated model's prefill and decode groups (``ModelDeploy.roles``) are each a *unit*:
  counted, matched (against the group's template), created, scaled, surged-then-drained and written
  off per (model, role), so one group's change never touches the other; the placer takes them as
  the model (holds, budgets, hard spread), soft-spreading each group on its own; with
  ``Policy.all_within`` ([models.pd] keep_within) every replica goes into the model's one domain of
  that level (placement_within.py). Their reason names the group (``prefill: 1 replica cannot be
  placed: …``); rebalancing leaves them alone (reconcile_moves.py says why).

The placer (placement.py) is built only when something is to be placed: a steady round is cheap.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable

from llmgw.fleet.domains import LEVELS, node_domains
from llmgw.fleet.group_parts import broken_groups, group_specs, workers_of
from llmgw.fleet.nodes import Node
from llmgw.fleet.placement import Placer
from llmgw.fleet.placement_group import place_groups
from llmgw.fleet.placement_within import home_domain, place_within
from llmgw.fleet.reconcile_moves import drain_moving, rebalance, replacements_note
from llmgw.fleet.reconcile_types import Assignment, DeployUnit, Desired, Facility, Hold, ModelDeploy, Plan

__all__ = ["Assignment", "DeployUnit", "Desired", "Facility", "Hold", "ModelDeploy", "Plan", "reconcile"]

_NOT_READY_RANK = {"ready": 3, "unhealthy": 2, "starting": 1, "pending": 1}


def _draining_nodes(nodes: dict[str, Node], holds: dict[str, Hold]) -> dict[str, str]:
    """node -> the held-with-drain domain it is in (computed once a round, only with such holds)."""
    drains = {d for d, h in holds.items() if h.drain}
    if not drains:
        return {}
    out = {}
    for name, n in nodes.items():
        dom = next((d for d in node_domains(n.labels) if d in drains), "")
        if dom:
            out[name] = dom
    return out


def reconcile(models: dict[str, ModelDeploy], nodes: dict[str, Node], assignments: Iterable[Assignment],
              *, new_id: Callable[[str], str], now_wall: float, facility: Facility | None = None,
              group_nodes: Collection[str] | None = None) -> Plan:
    """`group_nodes`: the nodes whose agents run multi-node replicas' parts (None: every node)."""
    fac = facility or Facility()
    plan = Plan()
    live: list[Assignment] = []
    everything = list(assignments)
    broken = broken_groups(everything, nodes, group_nodes)  # replica -> why its group is written off
    for a in everything:
        node = nodes.get(a.node)
        if node is None or node.state == "lost":
            plan.lost.append((a.replica, f"node {a.node} is lost" if node else f"node {a.node} is unknown"))
        elif a.replica in broken:
            plan.lost.append((a.replica, broken[a.replica]))
        else:
            live.append(a)
    placer_: list[Placer] = []

    def placer() -> Placer:
        if not placer_:
            placer_.append(Placer(nodes.values(),
                                  ((a.node, a.model, a.demand, a.spec.gpu_indices, a.spec.role) for a in live),
                                  holds={d: h.reason for d, h in fac.holds.items()}, budgets=fac.budgets,
                                  policies={n: m.policy for n, m in models.items()}))
            plan.warnings += placer_[0].warnings
        return placer_[0]

    # (model, role) -> its running replicas; a replica of no group under its model's name alone (no
    # tuple made for each of a steady round's replicas)
    by_unit: dict[str | tuple[str, str], list[Assignment]] = {}
    busy: set[str] = set()  # models with a replica draining: not rebalanced this round
    for a in live:
        if a.spec.is_worker:
            continue  # follows its head
        if a.desired != "run":
            busy.add(a.model)
            continue
        m = models.get(a.model)
        if m is None:
            plan.drain.append((a.replica, f"model {a.model} was deleted"))
        elif not m.matches(a):
            plan.drain.append((a.replica, _mismatch(m, a)))
        else:
            by_unit.setdefault((a.model, a.spec.role) if a.spec.role else a.model, []).append(a)
    draining = _draining_nodes(nodes, fac.holds)
    grouped = workers_of(live) if draining and any(a.spec.group is not None for a in live) else {}
    for name in sorted(models):
        m = models[name]
        units: list[tuple[DeployUnit, list[Assignment], list[tuple[Assignment, str]]]] = []
        for u in m.units:
            evict: list[tuple[Assignment, str]] = []
            keep: list[Assignment] = []
            for a in by_unit.get((name, u.role) if u.role else name, ()):
                dom = draining.get(a.node) if draining else None
                if draining and not dom and a.replica in grouped:  # a worker's node in the held domain
                    dom = next((draining[w.node] for w in grouped[a.replica] if w.node in draining), None)
                if dom:
                    evict.append((a, f"domain {dom} is held with drain"))
                elif a.moving:
                    evict.append((a, a.moving))
                else:
                    keep.append(a)
            units.append((u, keep, evict))
        # keep_within: the domain the replicas that stay are in (None: the round's first new one picks)
        level = m.policy.all_within if m.policy.all_within in LEVELS else ""
        home = (home_domain(node_domains(nodes[a.node].labels)[LEVELS.index(level)]
                            for _, keep, _ in units for a in keep) if level else None)
        whys: list[str] = []
        for u, keep, evict in units:
            label = name if not u.role else f"{name}'s {u.role} group"
            if len(keep) < u.count:
                why, home = _create(plan, placer(), m, u, u.count - len(keep), new_id, now_wall, group_nodes,
                                    level, home)
                if why and evict:
                    why = replacements_note(why, label, u.count, keep, evict)
                if why:
                    whys.append(f"{u.role}: {why}" if u.role else why)
            if evict:
                drain_moving(plan, u.count, keep, evict)
            if len(keep) > u.count:
                def keep_rank(a: Assignment) -> tuple[int, int, float]:
                    node_ok = 1 if nodes[a.node].state == "ready" else 0
                    return (node_ok, _NOT_READY_RANK.get(a.engine_state, 0), -a.created_at)
                extra = sorted(keep, key=keep_rank)[:len(keep) - u.count]
                scaled = f"scaled to {u.count}" if not u.role else f"{u.role} group scaled to {u.count}"
                plan.drain += [(a.replica, scaled) for a in extra]
        if whys:
            plan.unplaceable[name] = "; ".join(whys)
    if fac.rebalance and fac.max_moves > 0:
        by_model: dict[str, list[Assignment]] = {}
        for key, running in by_unit.items():
            by_model.setdefault(key if isinstance(key, str) else key[0], []).extend(running)
        rebalance(plan, placer, models, nodes, by_model, busy, fac, new_id, now_wall)
    if any(a.spec.group is not None for a in live):  # a draining head takes its workers along
        parts = workers_of(live)
        plan.drain += [(w.replica, f"its head {rid} drains: {why}") for rid, why in list(plan.drain)
                       for w in parts.get(rid, ()) if w.desired == "run"]
    return plan


def _mismatch(m: ModelDeploy, a: Assignment) -> str:
    role = a.spec.role
    if not role or not m.roles:
        return f"model {a.model}'s profile changed"
    if m.unit(role) is None:
        return f"model {a.model} has no {role} group any more"
    return f"model {a.model}'s {role} group changed"


def _create(plan: Plan, p: Placer, m: ModelDeploy, u: DeployUnit, n: int, new_id: Callable[[str], str],
            now_wall: float, group_nodes: Collection[str] | None, level: str,
            home: str | None) -> tuple[str | None, str | None]:
    """Place n replicas of unit `u`: why not all (None: all placed), and the keep_within home (as
    the first placement chose it, when it was None)."""
    if m.policy.nodes > 1:
        groups, why = place_groups(p, m.name, m.demand, n, group_nodes)
        for group in groups:
            rid = new_id(m.name)
            for part_id, node, gpus, spec in group_specs(u.spec_for(rid, ()), group):
                plan.create.append(Assignment(part_id, m.name, node, spec, m.demand, created_at=now_wall))
        return why, home
    if level:
        spots, why, home = place_within(p, m.name, m.demand, n, level, home, unit=u.role)
    else:
        spots, why = p.place(m.name, m.demand, n, unit=u.role)
    for node, gpus in spots:
        rid = new_id(m.name)
        a = Assignment(rid, m.name, node, u.spec_for(rid, gpus), m.demand, created_at=now_wall)
        a._match = (a.spec, m, a.demand, True)  # made from its unit's template: it matches
        plan.create.append(a)
    return why, home
