"""Power: what a node draws, and what one more replica adds — for the budgets of its domains.

A node's draw is the largest of what is known of it:

- **declared**: the node's own figure (the agent's ``declared_watts``);
- **derived**: its GPUs from the table below (every GPU at idle) plus, for each replica placed on it,
  the larger of the profile's declared ``watts`` and its GPUs' load minus idle;
- **measured**: the sum of nvidia-smi's ``power.draw`` the agent reported, plus what replicas placed
  since add. Missing (no nvidia-smi) or absurd (negative, not a number, past what the node's GPUs
  could draw) is ignored, with a warning — never a negative draw.

A node with none of the three known draws 0 W as far as budgets go (said in the facility listing).
Pure: no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from llmgw.fleet.types import NodeFacts

__all__ = ["CARD_WATTS", "MAX_GPU_WATTS", "NodePower", "card_watts", "node_power", "replica_watts"]

# (substring of nvidia-smi's name, lower case) -> (idle W, load W = board TDP); the first match wins,
# so the more specific names come first. Idle figures are estimates (roughly a tenth of the TDP).
CARD_WATTS: tuple[tuple[str, tuple[int, int]], ...] = (
    ("gh200", (100, 1000)), ("b200", (120, 1000)), ("b100", (90, 700)), ("h200", (75, 700)),
    ("h100 pcie", (40, 350)), ("h100 nvl", (50, 400)), ("h100", (70, 700)), ("h800", (70, 700)),
    ("a100-pcie", (35, 300)), ("a100 pcie", (35, 300)), ("a100", (50, 400)), ("a800", (50, 400)),
    ("l40s", (35, 350)), ("l40", (30, 300)), ("l4", (15, 72)), ("a10g", (30, 300)), ("a10", (20, 150)),
    ("a30", (25, 165)), ("a40", (30, 300)), ("rtx 6000 ada", (30, 300)), ("a6000", (30, 300)),
    ("4090", (30, 450)), ("3090", (30, 350)), ("v100", (40, 300)), ("t4", (10, 70)),
    ("mi300x", (90, 750)), ("mi250", (60, 500)),
)
MAX_GPU_WATTS = 2000.0  # past this per GPU, a measured figure is absurd
_MAX_HOST_WATTS = 10000.0  # the rest of a node (CPUs, fans, NICs) at most


@lru_cache(maxsize=256)
def card_watts(name: str) -> tuple[int, int] | None:
    """(idle, load) watts of a GPU by its nvidia-smi name; None for a card not in the table."""
    n = name.lower()
    for key, w in CARD_WATTS:
        if key in n:
            return w
    return None


@dataclass(frozen=True)
class NodePower:
    """A node's power before the replicas placed on it (see the module doc)."""

    declared: float | None
    idle: float | None  # every GPU at idle, when at least one card is known
    measured: float | None
    load_over_idle: dict[int, float]  # GPU index -> its load minus idle (known cards only)
    warnings: tuple[str, ...] = ()

    def draw(self, replicas_w: float) -> float:
        """The node's draw with `replicas_w` of replicas on it (their derived increments)."""
        figures = [self.declared or 0.0]
        if self.idle is not None:
            figures.append(self.idle + replicas_w)
        if self.measured is not None:
            figures.append(self.measured + replicas_w)
        return max(figures)

    @property
    def source(self) -> str:
        """Which figure counts: declared, derived, measured, or unknown."""
        best = max(((self.declared or 0.0, "declared"), (self.idle or 0.0, "derived"),
                    (self.measured or 0.0, "measured")), key=lambda fw: fw[0])
        return best[1] if best[0] > 0 else "unknown"


def node_power(name: str, facts: NodeFacts) -> NodePower:
    warnings: list[str] = []
    declared = facts.declared_watts if facts.declared_watts and facts.declared_watts > 0 else None
    idle = 0.0
    known = False
    over: dict[int, float] = {}
    for g in facts.gpus:
        w = card_watts(g.name)
        if w is not None:
            known = True
            idle += w[0]
            over[g.index] = float(w[1] - w[0])
    measured = facts.measured_watts
    if measured is not None:
        limit = MAX_GPU_WATTS * max(1, len(facts.gpus)) + _MAX_HOST_WATTS
        if not math.isfinite(measured) or measured < 0 or measured > limit:
            warnings.append(f"node {name}: measured power {measured!r} W is absurd (0 to {limit:.0f} W "
                            "for its GPUs); ignored")
            measured = None
    return NodePower(declared, idle if known else None, measured, over, tuple(warnings))


def replica_watts(p: NodePower, gpus: tuple[int, ...], declared: int) -> float:
    """What one replica adds to its node: its declared watts, or its GPUs' load over idle if more."""
    derived = sum(p.load_over_idle.get(i, 0.0) for i in gpus)
    return float(max(declared, derived))
