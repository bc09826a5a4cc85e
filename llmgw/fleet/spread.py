"""Topology spread: how evenly a model's replicas sit across the domains of a level.

The semantics are Kubernetes' topology spread constraints. At a level (rack, pdu, ...) the *skew*
of a placement is the count of the model's replicas in a domain minus the smallest count over the
*eligible* domains — those with a node that could take one more replica now (ready, not held,
capacity, power and selector all pass). A rule has a ``max_skew``; a **hard** rule refuses a node
whose domain would go past it, a **soft** rule only prefers the domains with the fewest replicas.
Domains that cannot take a replica do not hold the others back: with fewer domains than replicas,
or with some of them full, the replicas spread over those that can, as evenly as they allow.

Default: soft, max_skew 1, across rows, racks and PDUs (and rooms where present) — a soft rule
never leaves a replica unplaced. Nodes without a level's label are not constrained at that level.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from llmgw.fleet.domains import LEVELS

__all__ = ["DEFAULT_SPREAD", "MinCount", "SpreadRule", "worst_skew"]


@dataclass(frozen=True)
class SpreadRule:
    level: str  # one of LEVELS
    max_skew: int = 1
    hard: bool = False

    @property
    def index(self) -> int:
        return LEVELS.index(self.level)

    def to_wire(self) -> dict[str, object]:
        return {"level": self.level, "max_skew": self.max_skew, "hard": self.hard}


DEFAULT_SPREAD: tuple[SpreadRule, ...] = (SpreadRule("room"), SpreadRule("row"), SpreadRule("rack"),
                                          SpreadRule("pdu"))


class MinCount:
    """The smallest count over a set of domains, kept as counts change one at a time (a histogram
    of counts, so each step is O(1) amortised)."""

    def __init__(self, counts: Counter[str], domains: Iterable[str]) -> None:
        self.domains = set(domains)
        self.hist: Counter[int] = Counter(counts[d] for d in self.domains)
        self.min = min(self.hist) if self.hist else 0

    def bump(self, domain: str, old: int) -> None:
        if domain not in self.domains:
            return
        self.hist[old] -= 1
        self.hist[old + 1] += 1
        if self.hist[old] == 0:
            del self.hist[old]
            if old == self.min:
                self.min = old + 1


def worst_skew(placed_domains: Iterable[str], eligible: Iterable[str]) -> tuple[int, str, str]:
    """(skew, most loaded domain, least loaded domain) of replicas whose domains at one level are
    `placed_domains`, over `eligible` (domains with room) and those holding replicas."""
    eligible = set(eligible)
    counts = Counter(d for d in placed_domains if d)
    doms = eligible | set(counts)
    if not doms:
        return 0, "", ""
    hi = max(sorted(doms), key=lambda d: counts[d])
    lo = min(sorted(eligible), key=lambda d: counts[d]) if eligible else hi
    return counts[hi] - counts[lo], hi, lo
