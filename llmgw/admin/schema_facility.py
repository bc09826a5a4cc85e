"""The admin API's facility types (docs/placement.md): failure domains with their holds, replicas
and power, the body of a hold, and a placement's explanation."""

from __future__ import annotations

from dataclasses import dataclass

from llmgw.admin.schema import Problem
from llmgw.admin.typeinfo import prop

__all__ = ["MAX_HOLD_REASON", "DomainView", "FacilityView", "HoldBody", "HoldView", "PlacementCandidate",
           "PlacementExplanation", "PlacementRecord"]

MAX_HOLD_REASON = 500


@dataclass(slots=True)
class HoldView:
    domain: str = prop("LEVEL=VALUE, e.g. rack=r12")
    reason: str
    drain: bool = prop("its replicas are moved elsewhere (surge, then drain)")
    created_at: float = prop("Unix time it was set")
    replicas: int = prop("replicas still running in the domain")


@dataclass(slots=True)
class DomainView:
    domain: str = prop("LEVEL=VALUE, e.g. pdu=p7")
    level: str = prop("site, room, row, rack or pdu")
    parent: str | None = prop("the next enclosing domain its nodes are in, when they agree")
    nodes: int
    ready_nodes: int
    replicas: int = prop("replicas assigned to its nodes (running or draining)")
    held: bool
    hold_reason: str
    hold_drain: bool
    draw_w: float = prop("watts its nodes draw with their replicas: per node the largest of declared, derived "
                         "(GPU table) and measured")
    cap_w: float | None = prop("its power budget ([facility.budgets]); null: none")
    unknown_power_nodes: int = prop("nodes with no power figure at all (counted as 0 W)")


@dataclass(slots=True)
class FacilityView:
    domains: list[DomainView] = prop("every domain a node is in, outermost level first")
    holds: list[HoldView]
    budgets_without_nodes: list[str] = prop("budgets naming a domain no node is in (yet)")
    warnings: list[str] = prop("measured power figures ignored as absurd, and the like")


@dataclass(slots=True)
class HoldBody:
    """Hold a facility domain: nothing new is placed in it."""
    reason: str = prop("why, shown with the hold", default="", maxLength=MAX_HOLD_REASON)
    drain: bool = prop("also move its replicas elsewhere: each is stopped once a replacement is ready "
                       "and its in-flight requests have ended", default=False)

    def problems(self) -> list[Problem]:
        if any(not c.isprintable() for c in self.reason):
            return [Problem("reason", "must be printable text (no control characters)")]
        return []


@dataclass(slots=True)
class PlacementCandidate:
    node: str
    verdict: str = prop("chosen, fits (ranks lower), held, selector, gpus, gpu_memory, memory, power, spread, "
                        "keep_within (outside the one domain a disaggregated model is kept in), not_ready or lost")
    detail: str = prop("the rule's figures, or the ranking: the model's replicas in each domain")
    domains: list[str]


@dataclass(slots=True)
class PlacementRecord:
    at: float = prop("Unix time the replica was placed")
    node: str = prop("where it was placed")
    why: str = prop("where it went, and how many nodes each rule refused then")
    counts: dict[str, int] = prop("nodes per verdict then, over every node")
    truncated: int = prop("candidates left out of the list (counted in counts)")
    candidates: list[PlacementCandidate] = prop("the chosen node first, then the refused ones, then those that "
                                                "fitted but ranked lower (at most 20)")


@dataclass(slots=True)
class PlacementExplanation:
    model: str
    replica: str | None = prop("the placed replica explained; null: where the model's next replica would go")
    node: str | None = prop("the chosen node; null: no node can take it")
    domains: list[str] = prop("the chosen node's domains, outermost first")
    why: str
    counts: dict[str, int] = prop("nodes per verdict, over every node")
    truncated: int = prop("candidates left out of the list (counted in counts)")
    warnings: list[str]
    candidates: list[PlacementCandidate] = prop("the chosen node first, then the others, best first")
    at_placement: PlacementRecord | None = prop(
        "a placed replica: the verdicts when it was placed, kept beside now's (which the rest of this answer is). "
        "null: not kept — a model's next replica, a replica placed before this router started, or one of the "
        "oldest past the 4,096 records kept", None)
