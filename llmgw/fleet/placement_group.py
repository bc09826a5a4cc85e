"""Multi-node replicas: one replica on ``Policy.nodes`` nodes (tensor or pipeline parallel across
nodes), all inside one domain of the level ``Policy.keep_within`` (a rack, say), placed
all-or-nothing: either every node of it is taken, or none is.

Among the domains of that level with enough nodes that fit one part of the replica, the one whose
best nodes hold the fewest of the model (soft spread, as for single-node replicas) wins; its power
budgets are checked for all the parts together (two parts on one PDU add up). The first node of a
group is the one that serves.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection

from llmgw.fleet.domains import LEVELS
from llmgw.fleet.placement import Demand, Placer, Policy, _Bin

__all__ = ["Group", "place_groups"]

Group = tuple[tuple[str, tuple[int, ...]], ...]  # ((node, gpu indices), ...), the serving node first


def _joint_overdraw(p: Placer, nodes: list[_Bin], d: Demand, watts: int) -> str | None:
    """The first capped domain the parts together would take past its budget, or None."""
    pol = Policy(watts=watts)
    add: Counter[str] = Counter()
    for b in nodes:
        w = p.added_watts(b, d, pol)
        for dom in b.capped:
            add[dom] += w
    for dom, w in sorted(add.items()):
        if p.draw[dom] + w > p.budgets[dom]:
            return dom
    return None


def place_groups(p: Placer, model: str, d: Demand, n: int,
                 capable: Collection[str] | None = None) -> tuple[list[Group], str | None]:
    """Up to n multi-node replicas of `model`; and why not all, when not all fit. `capable`: the
    nodes whose agents run the parts of multi-node replicas (None: all)."""
    pol = p.policy(model)
    size = max(1, pol.nodes)
    level = LEVELS.index(pol.keep_within) if pol.keep_within in LEVELS else None
    counts = p.counts(model)
    levels = sorted({r.index for r in pol.spread})
    out: list[Group] = []
    why = ""
    while len(out) < n:
        by_dom: dict[str, list[_Bin]] = {}
        for b in p.bins.values():
            if (capable is None or b.name in capable) and p.misfit(b, d, pol) is None:
                dom = b.domains[level] if level is not None else "*"
                if dom:
                    by_dom.setdefault(dom, []).append(b)

        def key(b: _Bin) -> tuple[object, ...]:
            return (*(counts[i][b.domains[i]] if b.domains[i] else 0 for i in levels),
                    b.per_model[model], b.total, b.name)

        choices = []
        for dom, bins in by_dom.items():
            if len(bins) >= size:
                best = sorted(bins, key=key)[:size]
                choices.append((tuple(key(b) for b in best), dom, best))
        choices.sort(key=lambda c: (c[0], c[1]))
        picked = None
        for _, dom, best in choices:
            over = _joint_overdraw(p, best, d, pol.watts)
            if over is None:
                picked = best
                break
            why = f"its {size} nodes together would take {over} past its power budget"
        if picked is None:
            within = f" inside one {LEVELS[level]}" if level is not None else ""
            why = why or (f"no domain has {size} nodes that fit{within}" if by_dom or p.bins
                          else "no nodes have joined")
            break
        out.append(tuple((b.name, p.take(b, d, model, pol)) for b in picked))
    if len(out) == n:
        return out, None
    missing = n - len(out)
    old = sum(1 for b in p.bins if b not in capable) if capable is not None else 0
    if old:
        why += f" ({old} node{'s' if old > 1 else ''} with an agent too old to run multi-node replicas left out)"
    return out, (f"{missing} replica{'s' if missing > 1 else ''} of {size} nodes each cannot be placed "
                 f"(each node needs {d.describe()}): {why}")
