"""Placement: which node runs a new replica — facility-aware (docs/placement.md).

A node is refused, by the first rule that fails, when it is in a **held** domain, lacks the model's
**selector** labels, has too few free **GPUs** (or too few with enough **GPU memory**), too little
host **memory**, or when one more replica would take an enclosing domain past its **power** budget;
a **hard spread** rule refuses a node whose domain would hold too many more of the model's replicas
than the least-loaded eligible domain (spread.py). Among the nodes left, replicas spread: fewest
of the model in the node's domain at each spread level, outermost first (soft spread; ties go to
the domain with the fewest replicas of any model), then fewest of the model on the node, then the
least-loaded node, then the name (so placement is deterministic). GPUs are taken best-fit: the
smallest free ones that are large enough, so large GPUs stay free for large models.

A disaggregated model's prefill and decode groups (a `unit` of `place`) are the model to every rule
(a hard spread rule counts all its replicas); the soft spread ranks by the fewest of the *group*
first, then of the model, so each group spreads over the domains on its own — a lost rack does not
take all of one role — and the groups sit apart where there is room. A placement may be confined to
some nodes (`only`): keep_within (placement_within.py) keeps a model inside one domain that way,
without it being part of what a replica demands (a stored assignment never mismatches over it).

A tree of domains with a lazy heap at each level keeps placing many replicas cheap
(placement_tree.py). Multi-node replicas (``Policy.nodes > 1``) are placed all-or-nothing inside
one domain of ``keep_within`` (placement_group.py); a placement's explanation is
placement_explain.py.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from llmgw.fleet.domains import LEVELS, node_domains
from llmgw.fleet.nodes import Node
from llmgw.fleet.placement_tree import DomainTree, Skeleton, UnitTree
from llmgw.fleet.power import NodePower, node_power, replica_watts
from llmgw.fleet.spread import DEFAULT_SPREAD, MinCount, SpreadRule

__all__ = ["RACK_KEY", "Demand", "Placer", "Policy"]

RACK_KEY = "llmgw.io/rack"


@dataclass(frozen=True)
class Demand:
    gpus: int = 0
    gpu_memory_mb: int = 0  # on each GPU
    memory_mb: int = 0
    selector: tuple[tuple[str, str], ...] = ()

    def describe(self) -> str:
        parts = []
        if self.gpus:
            parts.append(f"{self.gpus} GPU{'s' if self.gpus > 1 else ''}"
                         + (f" of ≥{self.gpu_memory_mb} MB" if self.gpu_memory_mb else ""))
        if self.memory_mb:
            parts.append(f"{self.memory_mb} MB of memory")
        if self.selector:
            parts.append("labels " + ",".join(f"{k}={v}" for k, v in self.selector))
        return ", ".join(parts) or "nothing"

    def to_wire(self) -> dict[str, Any]:
        """As the store keeps it, next to the assignment's spec (``spec["demand"]``)."""
        return {"gpus": self.gpus, "gpu_memory_mb": self.gpu_memory_mb, "memory_mb": self.memory_mb,
                "selector": [list(kv) for kv in self.selector]}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Demand:
        return cls(int(d.get("gpus", 0)), int(d.get("gpu_memory_mb", 0)), int(d.get("memory_mb", 0)),
                   tuple(tuple(kv) for kv in d.get("selector", ())))  # type: ignore[misc]


@dataclass(frozen=True)
class Policy:
    """How a model's replicas are placed beyond what each one demands of its node. Changing it
    moves nothing that runs (spread is corrected by rebalancing, not by restarts)."""

    spread: tuple[SpreadRule, ...] = DEFAULT_SPREAD
    watts: int = 0  # declared draw of one replica (on each of its nodes)
    nodes: int = 1  # nodes per replica
    keep_within: str = ""  # a level of LEVELS: all of a multi-node replica's nodes in one domain of it
    all_within: str = ""  # a level of LEVELS: all of the model's replicas in one domain of it ([models.pd] keep_within)


DEFAULT_POLICY = Policy()

# The rules a node can be refused by, in the order they are checked, and how a count of them reads.
RULES = ("held", "selector", "gpus", "gpu_memory", "memory", "power", "spread")
_WHY = {"held": "are in a held domain", "selector": "lack the selector labels", "gpus": "have too few free GPUs",
        "gpu_memory": "have too few free GPUs with enough memory", "memory": "have too little free memory",
        "power": "would take a domain past its power budget", "spread": "would break a hard spread rule"}


# A replica already placed: (node, model, demand, gpu indices[, role of its prefill/decode group]).
Placed = tuple[str, str, Demand, tuple[int, ...]] | tuple[str, str, Demand, tuple[int, ...], str]


@dataclass
class _Bin:
    name: str
    labels: dict[str, str]
    domains: tuple[str, ...]  # per level of LEVELS ("" where none)
    free_gpus: dict[int, int]  # index -> memory MB
    memory_free: int | None  # None: the node did not say
    power: NodePower
    held: str = ""  # the held domain it is in, if any
    capped: tuple[str, ...] = ()  # its domains with a power budget
    max_over: float = 0.0  # the most one of its GPUs adds under load
    replicas_w: float = 0.0  # what the replicas placed on it add to its draw
    per_model: Counter[str] = field(default_factory=Counter)
    per_unit: Counter[tuple[str, str]] = field(default_factory=Counter)  # (model, role): a group's replicas
    total: int = 0

    @property
    def rack(self) -> str:
        return self.labels.get(RACK_KEY, "")

    def gpus_for(self, d: Demand) -> tuple[int, ...] | None:
        if not d.gpus:
            return ()
        big = sorted((m, i) for i, m in self.free_gpus.items() if m >= d.gpu_memory_mb)
        return tuple(sorted(i for _, i in big[:d.gpus])) if len(big) >= d.gpus else None

    def draw(self) -> float:
        return self.power.draw(self.replicas_w)


class Placer:
    """Capacity, holds and power of the nodes for one reconciliation round; `place` consumes it."""

    def __init__(self, nodes: Iterable[Node],
                 placed: Iterable[Placed] = (), *, holds: dict[str, str] | None = None, budgets: dict[str, float] | None = None,
                 policies: dict[str, Policy] | None = None) -> None:
        """nodes: all known nodes; placed: (node, model, demand, gpu indices[, role]) already there
        (role: its prefill/decode group, "" or left out for none); holds: held domain -> reason;
        budgets: domain -> watts; policies: model -> Policy."""
        self.holds = dict(holds or {})
        self.budgets = dict(budgets or {})
        self.policies = policies or {}
        self.bins: dict[str, _Bin] = {}
        self.others: dict[str, _Bin] = {}  # not ready: no new replicas, but they draw power
        self.not_ready: dict[str, str] = {}  # node -> its state
        self.warnings: list[str] = []
        for n in nodes:
            if n.state == "lost":
                self.not_ready[n.name] = n.state
                continue
            labels = n.labels
            doms = node_domains(labels)
            p = node_power(n.name, n.facts)
            self.warnings += p.warnings
            b = _Bin(n.name, labels, doms, {g.index: g.memory_mb for g in n.facts.gpus}, n.facts.memory_mb or None,
                     p, held=next((d for d in doms if d and d in self.holds), ""),
                     capped=tuple(d for d in doms if d and d in self.budgets),
                     max_over=max(p.load_over_idle.values(), default=0.0))
            if n.schedulable:
                self.bins[n.name] = b
            else:
                self.others[n.name] = b
                self.not_ready[n.name] = n.state
        self.placed_on: dict[str, list[str]] = {}  # model -> the node of each of its replicas
        self.unit_on: dict[tuple[str, str], list[str]] = {}  # (model, role) -> the node of each of the group's
        for pl in placed:
            node, model, d, gpus = pl[0], pl[1], pl[2], pl[3]
            b = self.bins.get(node) or self.others.get(node)
            if b is None:
                continue
            if len(pl) > 4 and pl[4]:  # type: ignore[misc]
                role: str = pl[4]  # type: ignore[misc]
                b.per_unit[(model, role)] += 1
                self.unit_on.setdefault((model, role), []).append(node)
            for i in gpus:
                b.free_gpus.pop(i, None)
            if d.memory_mb and b.memory_free is not None:
                b.memory_free -= d.memory_mb
            b.replicas_w += replica_watts(b.power, gpus, self.policy(model).watts)
            b.per_model[model] += 1
            b.total += 1
            self.placed_on.setdefault(model, []).append(node)
        self.draw: Counter[str] = Counter()  # domain -> watts (every node but lost ones)
        self.load: Counter[str] = Counter()  # domain -> replicas of any model
        for b in (*self.bins.values(), *self.others.values()):
            w = b.draw()
            for dom in b.domains:
                if dom:
                    self.draw[dom] += w
                    self.load[dom] += b.total
        self._counts: dict[str, list[Counter[str]]] = {}  # model -> per level: domain -> replicas
        self._unit_counts: dict[tuple[str, str], list[Counter[str]]] = {}  # the same per (model, role)
        self._fits: dict[tuple[Demand, int], list[_Bin]] = {}
        # per fits list (the object kept, so that its id is not reused): its skeleton, its domains
        self._skeletons: dict[tuple[int, tuple[int, ...]], tuple[list[_Bin], Skeleton]] = {}
        self._domsets: dict[tuple[int, int], tuple[list[_Bin], set[str]]] = {}

    def policy(self, model: str) -> Policy:
        return self.policies.get(model, DEFAULT_POLICY)

    def counts(self, model: str) -> list[Counter[str]]:
        """The model's replicas per domain, one Counter per level of LEVELS."""
        c = self._counts.get(model)
        if c is None:
            c = self._counts[model] = self._per_domain(self.placed_on.get(model, ()))
        return c

    def unit_counts(self, model: str, role: str) -> list[Counter[str]]:
        """A group's replicas per domain, one Counter per level of LEVELS."""
        key = (model, role)
        c = self._unit_counts.get(key)
        if c is None:
            c = self._unit_counts[key] = self._per_domain(self.unit_on.get(key, ()))
        return c

    def _per_domain(self, nodes: Iterable[str]) -> list[Counter[str]]:
        """Replicas on ``nodes`` (one entry per replica) per domain, one Counter per level."""
        c: list[Counter[str]] = [Counter() for _ in LEVELS]
        for node in nodes:
            b = self.bins.get(node) or self.others.get(node)
            if b is not None:
                for i, dom in enumerate(b.domains):
                    if dom:
                        c[i][dom] += 1
        return c

    # -- the rules ------------------------------------------------------------------------------
    def misfit(self, b: _Bin, d: Demand, pol: Policy) -> str | None:
        """The first rule (but spread) that refuses `b` for one replica of demand `d`."""
        if b.held:
            return "held"
        for k, v in d.selector:
            if b.labels.get(k) != v:
                return "selector"
        if d.gpus:
            if len(b.free_gpus) < d.gpus:
                return "gpus"
            if sum(1 for m in b.free_gpus.values() if m >= d.gpu_memory_mb) < d.gpus:
                return "gpu_memory"
        if d.memory_mb and b.memory_free is not None and b.memory_free < d.memory_mb:
            return "memory"
        if b.capped:
            # the quick bound first: what the replica adds is at most this (power.py: draw is a max)
            most = max(float(pol.watts), d.gpus * b.max_over)
            if any(self.draw[dom] + most > self.budgets[dom] for dom in b.capped) \
                    and self.over_budget(b, d, pol) is not None:
                return "power"
        return None

    def added_watts(self, b: _Bin, d: Demand, pol: Policy) -> float:
        gpus = b.gpus_for(d) or ()
        return b.power.draw(b.replicas_w + replica_watts(b.power, gpus, pol.watts)) - b.draw()

    def over_budget(self, b: _Bin, d: Demand, pol: Policy) -> tuple[str, float, float] | None:
        """(domain, draw it would reach, its cap) for the first budget one more replica on `b` breaks."""
        add = self.added_watts(b, d, pol)
        for dom in b.capped:
            if self.draw[dom] + add > self.budgets[dom]:
                return dom, self.draw[dom] + add, self.budgets[dom]
        return None

    def spread_refusal(self, b: _Bin, counts: list[Counter[str]], mins: dict[int, MinCount],
                       rules: Iterable[SpreadRule]) -> tuple[SpreadRule, str, int, int] | None:
        """(rule, domain, its count after, the least eligible count) of the first hard rule `b` breaks."""
        for r in rules:
            if not r.hard:
                continue
            i = r.index
            dom = b.domains[i]
            if dom and i in mins and counts[i][dom] + 1 - mins[i].min > r.max_skew:
                return r, dom, counts[i][dom] + 1, mins[i].min
        return None

    def eligible(self, d: Demand, pol: Policy, *, fresh: bool = False) -> list[_Bin]:
        """The nodes that fit one replica. Cached per (demand, watts) for the round: models with the
        same demand share it, and a node that stopped fitting since is dropped when it is picked."""
        k = (d, pol.watts)
        if fresh or k not in self._fits:
            self._fits[k] = [b for b in self.bins.values() if self.misfit(b, d, pol) is None]
        return self._fits[k]

    def skeleton(self, fits: list[_Bin], pol: Policy) -> Skeleton:
        levels = tuple(sorted({r.index for r in pol.spread}))
        got = self._skeletons.get((id(fits), levels))
        if got is None or got[0] is not fits:
            got = self._skeletons[(id(fits), levels)] = (fits, Skeleton(fits, list(levels)))
        return got[1]

    def mins(self, model: str, fits: list[_Bin], pol: Policy) -> dict[int, MinCount]:
        """The least count of the model over the eligible domains, per level of a hard rule."""
        counts = self.counts(model)
        out = {}
        for r in pol.spread:
            i = r.index
            got = self._domsets.get((id(fits), i))
            if got is None or got[0] is not fits:
                got = self._domsets[(id(fits), i)] = (fits, {b.domains[i] for b in fits if b.domains[i]})
            out[i] = MinCount(counts[i], got[1])
        return out

    # -- placing --------------------------------------------------------------------------------
    def take(self, b: _Bin, d: Demand, model: str, pol: Policy, unit: str = "") -> tuple[int, ...]:
        gpus = b.gpus_for(d) or ()
        for i in gpus:
            del b.free_gpus[i]
        if d.memory_mb and b.memory_free is not None:
            b.memory_free -= d.memory_mb
        before = b.draw()
        b.replicas_w += replica_watts(b.power, gpus, pol.watts)
        added = b.draw() - before
        counts = self.counts(model)
        for i, dom in enumerate(b.domains):
            if dom:
                self.draw[dom] += added
                self.load[dom] += 1
                counts[i][dom] += 1
        b.per_model[model] += 1
        b.total += 1
        self.placed_on.setdefault(model, []).append(b.name)
        if unit:
            ucounts = self.unit_counts(model, unit)
            for i, dom in enumerate(b.domains):
                if dom:
                    ucounts[i][dom] += 1
            b.per_unit[(model, unit)] += 1
            self.unit_on.setdefault((model, unit), []).append(b.name)
        return gpus

    def place(self, model: str, d: Demand, n: int, *, unit: str = "", only: Callable[[_Bin], bool] | None = None
              ) -> tuple[list[tuple[str, tuple[int, ...]]], str | None]:
        """Up to n single-node placements as (node, gpu indices); and why not all, when not all fit.
        `unit`: the prefill/decode group they are of ("": none); `only`: the nodes they may go to
        (None: any; the why of what did not fit is then over every node: its caller says better)."""
        pol = self.policy(model)
        counts = self.counts(model)
        hard = [r for r in pol.spread if r.hard]
        fits = self.eligible(d, pol)
        if only is not None:
            fits = [b for b in fits if only(b)]
        mins = self.mins(model, fits, pol) if hard else {}
        skel = self.skeleton(fits, pol)
        tree = (UnitTree(skel, counts, self.load, model, self.unit_counts(model, unit), (model, unit)) if unit
                else DomainTree(skel, counts, self.load, model))
        out: list[tuple[str, tuple[int, ...]]] = []
        deferred: list[str] = []  # refused by a hard spread rule for now: the minimum may rise
        while len(out) < n:
            best = tree.best()
            if best is None:
                if not deferred:
                    break
                # Domains may have filled up since the minimum was taken: take it again, retry.
                again = self.eligible(d, pol, fresh=True)
                fresh = self.mins(model, again if only is None else [b for b in again if only(b)], pol)
                if all(fresh[i].min == mins[i].min for i in fresh):
                    break
                mins = fresh
                for nm in deferred:
                    tree.restore(nm)
                deferred = []
                continue
            b = self.bins[best]
            if self.misfit(b, d, pol) is not None:  # a sibling's replica used the power budget
                tree.remove(b.name)
                continue
            if hard and self.spread_refusal(b, counts, mins, hard) is not None:
                tree.remove(b.name)
                deferred.append(b.name)
                continue
            old = [counts[i][b.domains[i]] for i in mins]
            out.append((b.name, self.take(b, d, model, pol, unit)))
            for i, c in zip(list(mins), old, strict=True):
                mins[i].bump(b.domains[i], c)
            if self.misfit(b, d, pol) is not None:
                tree.remove(b.name)
            if deferred:
                for nm in deferred:
                    tree.restore(nm)
                deferred = []
        return out, (None if len(out) == n else self.why_not(model, d, n - len(out)))

    def choose(self, model: str, d: Demand, only: Callable[[_Bin], bool] | None = None) -> str | None:
        """Where the next replica would go, taking nothing (the explanation's "chosen")."""
        pol = self.policy(model)
        counts = self.counts(model)
        hard = [r for r in pol.spread if r.hard]
        fits = self.eligible(d, pol, fresh=True)
        if only is not None:
            fits = [b for b in fits if only(b)]
        mins = self.mins(model, fits, pol) if hard else {}
        tree = DomainTree(self.skeleton(fits, pol), counts, self.load, model)
        while (best := tree.best()) is not None:
            b = self.bins[best]
            if self.misfit(b, d, pol) is None and not (hard and self.spread_refusal(b, counts, mins, hard)):
                return best
            tree.remove(best)
        return None

    def why_not(self, model: str, d: Demand, missing: int) -> str:
        pol = self.policy(model)
        verdicts = [self.misfit(b, d, pol) for b in self.bins.values()]
        counts = Counter(v or "spread" for v in verdicts)
        parts = [f"{c} {_WHY[r]}" for r, c in sorted(counts.items(), key=lambda rc: (-rc[1], rc[0]))]
        if self.not_ready:
            parts.append(f"{len(self.not_ready)} not ready")
        head = f"{missing} replica{'s' if missing > 1 else ''} cannot be placed (each needs {d.describe()})"
        if not self.bins and not self.not_ready:
            return head + ": no nodes have joined"
        return head + ": of the nodes, " + "; ".join(parts) if parts else head
