"""The reconciler's data (reconcile.py): what runs (assignments), what should (each model's deploy
and its units), the facility's side of a round (holds, budgets), and the plan a round makes.

A model's replicas come in *units*: replicas alike, counted, matched and scaled together. A model
without prefill/decode groups has one unit (role ""), of its deploy count; a disaggregated model
([[models.deploy.roles]]) has one per group — its role, its count, its engine template (the
profile's, with the group's args and env appended). The placer sees every unit of a model as the
model (its resources, holds, power budgets and spread are the model's).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property

from llmgw.fleet.placement import DEFAULT_POLICY, Demand, Policy
from llmgw.fleet.types import EngineReport, EngineSpec

__all__ = ["Assignment", "DeployUnit", "Desired", "Facility", "Hold", "ModelDeploy", "Plan"]

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
class DeployUnit:
    """One unit of a model's replicas: its role ("" for a model without groups), how many, and the
    engine spec each runs (`replica`, `gpu_indices` and `generation` filled per assignment)."""

    role: str
    count: int
    template: EngineSpec

    def spec_for(self, replica: str, gpus: tuple[int, ...], generation: int = 0) -> EngineSpec:
        return replace(self.template, replica=replica, gpu_indices=gpus, generation=generation)


@dataclass(frozen=True)
class ModelDeploy:
    """A model's managed replicas: how many, what each needs, and the engine spec to run.
    `template.replica` and `template.gpu_indices` are filled per assignment. With `roles` (a
    disaggregated model's prefill and decode groups) `count` is their sum and `template` the
    profile's, which no replica runs as is: each runs its group's."""

    name: str
    count: int
    demand: Demand
    template: EngineSpec
    policy: Policy = DEFAULT_POLICY  # spread, declared watts: changing it restarts nothing
    roles: tuple[DeployUnit, ...] = ()  # prefill/decode groups, in the config's order; () : none

    @cached_property
    def units(self) -> tuple[DeployUnit, ...]:
        """The groups, or the one unit of a model without them (role "", `count` alike replicas)."""
        return self.roles or (DeployUnit("", self.count, self.template),)

    def unit(self, role: str) -> DeployUnit | None:
        return next((u for u in self.units if u.role == role), None)

    def spec_for(self, replica: str, gpus: tuple[int, ...], generation: int = 0) -> EngineSpec:
        return replace(self.template, replica=replica, gpu_indices=gpus, generation=generation)

    def matches(self, a: Assignment) -> bool:
        # Compared as the spec with its per-replica fields blanked against its own unit's template
        # (a group replica against its group's); the answer is cached on the assignment while its
        # spec, its demand and this deploy (frozen: its templates with it) are the same objects (a
        # steady round compares every assignment).
        m = a._match
        if m is not None and m[0] is a.spec and m[1] is self and m[2] is a.demand:
            return bool(m[3])
        u = self.unit(a.spec.role)
        g = a.spec.group
        ok = (u is not None  # None: its group is gone (or the model's groups came or went)
              and a.demand == self.demand and (g.size if g is not None else 1) == max(1, self.policy.nodes)
              and replace(a.spec, replica="", gpu_indices=(), generation=0, group=None) == u.template)
        a._match = (a.spec, self, a.demand, ok)
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
