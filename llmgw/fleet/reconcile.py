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
  the skew; at most ``Facility.max_moves`` moves a round (the shell rate-limits the rounds).

The placer (placement.py) is built only when something is to be placed: a steady round is cheap.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field, replace

from llmgw.fleet.nodes import Node
from llmgw.fleet.domains import node_domains
from llmgw.fleet.placement import DEFAULT_POLICY, Demand, Placer, Policy
from llmgw.fleet.group_parts import broken_groups, group_specs, workers_of
from llmgw.fleet.placement_group import place_groups
from llmgw.fleet.spread import worst_skew
from llmgw.fleet.types import EngineReport, EngineSpec

__all__ = ["Assignment", "Desired", "Facility", "Hold", "ModelDeploy", "Plan", "reconcile"]

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
    moving: str = ""  # why it is being replaced elsewhere (rebalancing); not kept in the store
    _match: tuple[object, ...] | None = field(default=None, repr=False, compare=False)

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
    policy: Policy = DEFAULT_POLICY  # spread, declared watts: changing it restarts nothing

    def spec_for(self, replica: str, gpus: tuple[int, ...], generation: int = 0) -> EngineSpec:
        return replace(self.template, replica=replica, gpu_indices=gpus, generation=generation)

    def matches(self, a: Assignment) -> bool:
        # Compared as the spec with its per-replica fields blanked; the answer is cached on the
        # assignment while its spec, the template and the demand are the same objects (a steady
        # round compares every assignment).
        m = a._match
        if m is not None and m[0] is a.spec and m[1] is self.template and m[2] is self.demand \
                and m[3] is a.demand:
            return bool(m[4])
        g = a.spec.group
        ok = (a.demand == self.demand and (g.size if g is not None else 1) == max(1, self.policy.nodes)
              and replace(a.spec, replica="", gpu_indices=(), generation=0, group=None) == self.template)
        a._match = (a.spec, self.template, self.demand, a.demand, ok)
        return ok


@dataclass(frozen=True)
class Hold:
    reason: str = ""
    drain: bool = False  # move the replicas in the domain elsewhere (surge, then drain)


@dataclass
class Facility:
    """The facility's side of a round: holds, power budgets, whether to rebalance."""

    holds: dict[str, Hold] = field(default_factory=dict)  # domain -> hold
    budgets: dict[str, float] = field(default_factory=dict)  # domain -> watts
    rebalance: bool = False
    max_moves: int = 1


@dataclass
class Plan:
    create: list[Assignment] = field(default_factory=list)
    drain: list[tuple[str, str]] = field(default_factory=list)  # (replica, why)
    lost: list[tuple[str, str]] = field(default_factory=list)  # (replica, why)
    unplaceable: dict[str, str] = field(default_factory=dict)  # model -> why
    moving: list[tuple[str, str]] = field(default_factory=list)  # (replica, why) rebalancing started
    warnings: list[str] = field(default_factory=list)  # the placer's (absurd power figures ...)

    def __bool__(self) -> bool:
        return bool(self.create or self.drain or self.lost)


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
            placer_.append(Placer(nodes.values(), ((a.node, a.model, a.demand, a.spec.gpu_indices) for a in live),
                                  holds={d: h.reason for d, h in fac.holds.items()}, budgets=fac.budgets,
                                  policies={n: m.policy for n, m in models.items()}))
            plan.warnings += placer_[0].warnings
        return placer_[0]

    by_model: dict[str, list[Assignment]] = {}
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
            plan.drain.append((a.replica, f"model {a.model}'s profile changed"))
        else:
            by_model.setdefault(a.model, []).append(a)
    draining = _draining_nodes(nodes, fac.holds)
    grouped = workers_of(live) if draining and any(a.spec.group is not None for a in live) else {}
    for name in sorted(models):
        m = models[name]
        running = by_model.get(name, [])
        evict: list[tuple[Assignment, str]] = []
        keep: list[Assignment] = []
        for a in running:
            dom = draining.get(a.node) if draining else None
            if draining and not dom and a.replica in grouped:  # a worker's node in the held domain
                dom = next((draining[w.node] for w in grouped[a.replica] if w.node in draining), None)
            if dom:
                evict.append((a, f"domain {dom} is held with drain"))
            elif a.moving:
                evict.append((a, a.moving))
            else:
                keep.append(a)
        if len(keep) < m.count:
            _create(plan, placer(), m, m.count - len(keep), new_id, now_wall, group_nodes)
            if evict and name in plan.unplaceable:
                plan.unplaceable[name] = _replacements_note(plan.unplaceable[name], m, keep, evict)
        if evict:
            _drain_moving(plan, m, keep, evict)
        if len(keep) > m.count:
            def keep_rank(a: Assignment) -> tuple[int, int, float]:
                node_ok = 1 if nodes[a.node].state == "ready" else 0
                return (node_ok, _NOT_READY_RANK.get(a.engine_state, 0), -a.created_at)
            extra = sorted(keep, key=keep_rank)[:len(keep) - m.count]
            plan.drain += [(a.replica, f"scaled to {m.count}") for a in extra]
    if fac.rebalance and fac.max_moves > 0:
        _rebalance(plan, placer, models, nodes, by_model, busy, fac, new_id, now_wall)
    if any(a.spec.group is not None for a in live):  # a draining head takes its workers along
        parts = workers_of(live)
        plan.drain += [(w.replica, f"its head {rid} drains: {why}") for rid, why in list(plan.drain)
                       for w in parts.get(rid, ()) if w.desired == "run"]
    return plan


def _create(plan: Plan, p: Placer, m: ModelDeploy, n: int, new_id: Callable[[str], str], now_wall: float,
            group_nodes: Collection[str] | None = None) -> None:
    if m.policy.nodes > 1:
        groups, why = place_groups(p, m.name, m.demand, n, group_nodes)
        for group in groups:
            rid = new_id(m.name)
            for part_id, node, gpus, spec in group_specs(m.spec_for(rid, ()), group):
                plan.create.append(Assignment(part_id, m.name, node, spec, m.demand, created_at=now_wall))
        if why:
            plan.unplaceable[m.name] = why
        return
    spots, why = p.place(m.name, m.demand, n)
    for node, gpus in spots:
        rid = new_id(m.name)
        a = Assignment(rid, m.name, node, m.spec_for(rid, gpus), m.demand, created_at=now_wall)
        a._match = (a.spec, m.template, m.demand, a.demand, True)  # made from the template: it matches
        plan.create.append(a)
    if why:
        plan.unplaceable[m.name] = why


def _replacements_note(why: str, m: ModelDeploy, keep: list[Assignment], evict: list[tuple[Assignment, str]]) -> str:
    """The placer counts missing replicas; where they replace replicas that still serve (moving
    out of a domain held with drain, or rebalanced), say so and what still serves: the model is
    not short of replicas, its replacements are."""
    missing = int(why.split(" ", 1)[0]) if why.split(" ", 1)[0].isdigit() else 0
    replacing = min(len(evict), missing)
    if replacing == 0:
        return why
    head = f"{missing} replica{'s' if missing > 1 else ''} "
    rest = why[len(head):] if why.startswith(head) else "cannot be placed: " + why
    reasons = "; ".join(sorted({w for _, w in evict}))
    what = f"{replacing} replacement{'s' if replacing > 1 else ''} for replicas to move ({reasons})"
    if missing > replacing:
        what = f"{missing} replicas ({what})"
    serving = sum(1 for a in keep if a.engine_state == "ready") + sum(1 for a, _ in evict if a.engine_state == "ready")
    return (f"{what} {rest.lstrip()}; {m.name} still serves {serving}/{m.count} ready: the replicas to move keep "
            "serving until their replacements are ready")


def _drain_moving(plan: Plan, m: ModelDeploy, keep: list[Assignment], evict: list[tuple[Assignment, str]]) -> None:
    """Drain moving replicas only as far as their replacements are placed and ready: the model's
    ready replicas stay at its count (or at what they were, when there is no room)."""
    ready_keep = sum(1 for a in keep if a.engine_state == "ready")
    ready_evict = sum(1 for a, _ in evict if a.engine_state == "ready")
    budget = max(0, len(keep) + len(evict) - m.count)  # replacements exist for this many
    ready_budget = max(0, ready_keep + ready_evict - m.count)
    for a, why in sorted(evict, key=lambda aw: (aw[0].engine_state == "ready", aw[0].created_at)):
        if budget <= 0:
            break
        if a.engine_state == "ready":
            if ready_budget <= 0:
                break
            ready_budget -= 1
        budget -= 1
        plan.drain.append((a.replica, why))


def _rebalance(plan: Plan, placer: Callable[[], Placer], models: dict[str, ModelDeploy], nodes: dict[str, Node],
               by_model: dict[str, list[Assignment]], busy: set[str], fac: Facility,
               new_id: Callable[[str], str], now_wall: float) -> None:
    moves = 0
    planned = {a.model for a in plan.create} | busy
    for name in sorted(models):
        m = models[name]
        running = by_model.get(name, [])
        if (moves >= fac.max_moves or name in planned or m.policy.nodes > 1 or len(running) != m.count
                or any(a.moving or a.engine_state != "ready" for a in running)):
            continue
        p = placer()
        fits = p.eligible(m.demand, m.policy, fresh=True)
        doms = {a.replica: node_domains(nodes[a.node].labels) for a in running}
        for rule in m.policy.spread:
            i = rule.index
            eligible = {b.domains[i] for b in fits if b.domains[i]}
            sk, hi, lo = worst_skew((doms[a.replica][i] for a in running), eligible)
            if sk <= rule.max_skew or not lo:
                continue
            src = max((a for a in running if doms[a.replica][i] == hi), key=lambda a: (a.created_at, a.replica))
            spots, _ = p.place(name, m.demand, 1)
            if not spots:
                break
            dest = p.bins[spots[0][0]].domains[i]
            before = sum(1 for a in running if doms[a.replica][i] == dest)
            if before + 1 >= sum(1 for a in running if doms[a.replica][i] == hi):
                break  # the move would not lower the skew (the placer's first choice is the best one)
            rid = new_id(name)
            plan.create.append(Assignment(rid, name, spots[0][0], m.spec_for(rid, spots[0][1]), m.demand,
                                          created_at=now_wall))
            why = f"rebalancing: {hi} holds {sk} more replicas of {name} than {lo} (max skew {rule.max_skew})"
            plan.moving.append((src.replica, why))
            moves += 1
            break
