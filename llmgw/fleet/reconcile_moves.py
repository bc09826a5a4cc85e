"""Replicas that move (reconcile.py): out of a domain held with drain, or chosen by rebalancing.
A replacement is placed elsewhere first (surge); the moving replica drains only as replacements
are ready, so the ready replicas of its unit (the model's, or one prefill/decode group's) never drop
below the unit's count — or below what they were, with no room."""

from __future__ import annotations

from collections.abc import Callable

from llmgw.fleet.domains import node_domains
from llmgw.fleet.nodes import Node
from llmgw.fleet.placement import Placer
from llmgw.fleet.reconcile_types import Assignment, Facility, ModelDeploy, Plan
from llmgw.fleet.spread import worst_skew

__all__ = ["drain_moving", "rebalance", "replacements_note"]


def replacements_note(why: str, label: str, count: int, keep: list[Assignment],
                      evict: list[tuple[Assignment, str]]) -> str:
    """The placer counts missing replicas; where they replace replicas that still serve (moving
    out of a domain held with drain, or rebalanced), say so and what still serves: the model (or
    the group: `label`) is not short of replicas, its replacements are."""
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
    return (f"{what} {rest.lstrip()}; {label} still serves {serving}/{count} ready: the replicas to move keep "
            "serving until their replacements are ready")


def drain_moving(plan: Plan, count: int, keep: list[Assignment], evict: list[tuple[Assignment, str]]) -> None:
    """Drain moving replicas only as far as their replacements are placed and ready: the unit's
    ready replicas stay at its count (or at what they were, when there is no room)."""
    ready_keep = sum(1 for a in keep if a.engine_state == "ready")
    ready_evict = sum(1 for a, _ in evict if a.engine_state == "ready")
    budget = max(0, len(keep) + len(evict) - count)  # replacements exist for this many
    ready_budget = max(0, ready_keep + ready_evict - count)
    for a, why in sorted(evict, key=lambda aw: (aw[0].engine_state == "ready", aw[0].created_at)):
        if budget <= 0:
            break
        if a.engine_state == "ready":
            if ready_budget <= 0:
                break
            ready_budget -= 1
        budget -= 1
        plan.drain.append((a.replica, why))


def rebalance(plan: Plan, placer: Callable[[], Placer], models: dict[str, ModelDeploy], nodes: dict[str, Node],
              by_model: dict[str, list[Assignment]], busy: set[str], fac: Facility,
              new_id: Callable[[str], str], now_wall: float) -> None:
    """A model whose replicas are all ready and whose spread at a level is past its max skew moves
    one replica from its most-loaded domain, when the move lowers the skew; at most
    ``fac.max_moves`` a round. A disaggregated model's groups are not rebalanced: a move is judged
    by the model's skew and would trade one group's replica for a replacement of the other's
    count, and with keep_within there is one domain to be in (holds with drain still move them)."""
    moves = 0
    planned = {a.model for a in plan.create} | busy
    for name in sorted(models):
        m = models[name]
        running = by_model.get(name, [])
        if (moves >= fac.max_moves or name in planned or m.policy.nodes > 1 or m.roles or len(running) != m.count
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
