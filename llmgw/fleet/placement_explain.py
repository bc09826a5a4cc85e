"""Why a replica is where it is — or why it is nowhere: every node with its verdict.

For a placed replica the placer is built from everything else that runs (without the replica), and
its node is the one *chosen*; for a model that cannot place a replica, the same table is built for
the next one. Each other node is either a candidate that *fits* but ranks lower (the ranking is the
spread key: the model's replicas in each of the node's domains, outermost level first, then on the
node, then the node's load) or refused by the first rule that fails: held, selector, gpus,
gpu_memory, memory, power, spread — or not ready / lost. A disaggregated model kept inside one
domain ([models.pd] keep_within, placement_within.py) refuses the nodes outside its domain (or
without a label at the level) as ``keep_within``, after every other rule.

That table is *now*'s: the control plane also keeps the table as it stood when each replica was
placed (:func:`at_placement`, docs/placement.md), so a rejection that has since gone (a hold
released, a node that came back) is still seen beside it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from llmgw.fleet.domains import LEVELS
from llmgw.fleet.placement import Demand, Placer, _Bin
from llmgw.fleet.placement_within import home_in, within_refusal

__all__ = ["AT_PLACEMENT_ROWS", "AtPlacement", "Candidate", "Explanation", "at_placement", "explain"]

MAX_ROWS = 500  # candidates listed; the counts cover every node
AT_PLACEMENT_ROWS = 20  # candidates kept in a placement-time record; its counts cover every node


@dataclass(frozen=True)
class Candidate:
    node: str
    verdict: str  # "chosen" | "fits" | a rule of placement.RULES | "keep_within" | "not_ready" | "lost"
    detail: str
    domains: tuple[str, ...] = ()


@dataclass(frozen=True)
class AtPlacement:
    """The verdicts as they stood when a replica was placed: its node chosen, the others' verdicts
    (refusals first, then those that fit but ranked lower) then."""
    at: float  # Unix time of the placement
    node: str
    why: str
    counts: dict[str, int]  # verdict -> nodes, over every node then
    candidates: tuple[Candidate, ...]  # the chosen node first; at most AT_PLACEMENT_ROWS
    truncated: int  # candidates left out (counted in counts)

    def to_wire(self) -> dict[str, Any]:
        return {"at": self.at, "node": self.node, "why": self.why, "counts": dict(self.counts),
                "truncated": self.truncated,
                "candidates": [{"node": c.node, "verdict": c.verdict, "detail": c.detail, "domains": list(c.domains)}
                               for c in self.candidates]}


@dataclass
class Explanation:
    model: str
    replica: str | None
    node: str | None  # the chosen node (None: nowhere fits)
    domains: tuple[str, ...]  # the chosen node's domains, outermost first
    why: str
    candidates: list[Candidate] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)  # verdict -> nodes
    truncated: int = 0  # candidates beyond MAX_ROWS, left out (counted in `counts`)
    warnings: list[str] = field(default_factory=list)
    # A placed replica's verdicts when it was placed (None: not kept — placed before this router
    # started, or past the bound of records; see docs/placement.md).
    at_placement: AtPlacement | None = None

    def to_wire(self) -> dict[str, Any]:
        return {"model": self.model, "replica": self.replica, "node": self.node, "domains": list(self.domains),
                "why": self.why, "counts": dict(self.counts), "truncated": self.truncated,
                "warnings": list(self.warnings),
                "at_placement": None if self.at_placement is None else self.at_placement.to_wire(),
                "candidates": [{"node": c.node, "verdict": c.verdict, "detail": c.detail, "domains": list(c.domains)}
                               for c in self.candidates]}


def _refusal(p: Placer, b: _Bin, rule: str, d: Demand, model: str) -> str:
    pol = p.policy(model)
    if rule == "held":
        reason = p.holds.get(b.held, "")
        return f"in held domain {b.held}" + (f" ({reason})" if reason else "")
    if rule == "selector":
        return "lacks " + ", ".join(f"{k}={v}" for k, v in d.selector if b.labels.get(k) != v)
    if rule == "gpus":
        return f"{len(b.free_gpus)} free GPUs, needs {d.gpus}"
    if rule == "gpu_memory":
        big = sum(1 for m in b.free_gpus.values() if m >= d.gpu_memory_mb)
        return f"{big} free GPUs with ≥{d.gpu_memory_mb} MB, needs {d.gpus}"
    if rule == "memory":
        return f"{b.memory_free} MB of memory free, needs {d.memory_mb}"
    if rule == "power":
        over = p.over_budget(b, d, pol)
        if over:
            dom, w, cap = over
            return f"{dom} would draw {w:.0f} W of its {cap:.0f} W budget"
    return rule


def _rank_detail(counts: list[Counter[str]], b: _Bin, model: str, levels: list[int]) -> str:
    parts = [f"{counts[i][b.domains[i]]} in {b.domains[i]}" for i in levels if b.domains[i]]
    parts.append(f"{b.per_model[model]} on the node, {b.total} replicas in all")
    return f"replicas of {model}: " + ", ".join(parts)


def explain(p: Placer, model: str, d: Demand, *, replica: str | None = None, node: str | None = None) -> Explanation:
    """`node`: where `replica` runs (p built without it); neither: where the next replica would go."""
    pol = p.policy(model)
    counts = p.counts(model)
    levels = sorted({r.index for r in pol.spread})
    hard = [r for r in pol.spread if r.hard]
    rows: list[tuple[tuple[Any, ...], Candidate]] = []
    level = pol.all_within if pol.all_within in LEVELS else ""
    home = home_in(p, model, level) if level else None

    def away(b: _Bin) -> str | None:  # keep_within's refusal of `b`, if any
        return within_refusal(b.domains, level, home) if level else None

    fits = [b for b in p.bins.values() if p.misfit(b, d, pol) is None and away(b) is None]
    mins = p.mins(model, fits, pol)
    for b in p.bins.values():
        rule = p.misfit(b, d, pol)
        if rule is None and (out := away(b)) is not None:
            rows.append(((1, "keep_within", b.name), Candidate(b.name, "keep_within", out, b.domains)))
            continue
        if rule is None and hard:
            ref = p.spread_refusal(b, counts, mins, hard)
            if ref is not None:
                r, dom, after, least = ref
                rows.append(((2,), Candidate(b.name, "spread", f"{dom} would hold {after} replicas of {model}, "
                                             f"the least-loaded eligible {r.level} {least} (max skew {r.max_skew}, "
                                             "hard)", b.domains)))
                continue
        if rule is None:
            key = (0, *(counts[i][b.domains[i]] if b.domains[i] else 0 for i in levels), b.per_model[model],
                   b.total, b.name)
            rows.append((key, Candidate(b.name, "fits", _rank_detail(counts, b, model, levels), b.domains)))
        else:
            rows.append(((1, rule, b.name), Candidate(b.name, rule, _refusal(p, b, rule, d, model), b.domains)))
    for name, state in sorted(p.not_ready.items()):
        rows.append(((3, name), Candidate(name, state, f"node is {state.replace('_', ' ')}")))
    rows.sort(key=lambda kc: kc[0])
    cands = [c for _, c in rows]
    chosen: Candidate | None = None
    if node is not None:
        b = p.bins.get(node) or p.others.get(node)
        mine = next((c for c in cands if c.node == node), None)
        if b is not None and mine is not None:
            chosen = Candidate(node, "chosen", _rank_detail(counts, b, model, levels), b.domains)
            now = "" if mine.verdict == "fits" else f"; now it would be refused: {mine.verdict}: {mine.detail}"
            why = f"placed on {node} ({'/'.join(x for x in b.domains if x) or 'no facility labels'}): " \
                  f"{chosen.detail}{now}"
            cands = [c for c in cands if c.node != node]
        else:
            why = f"placed on {node}, which is no longer known"
    elif (nxt := p.choose(model, d, (lambda b: away(b) is None) if level else None)) is not None:
        first = next(c for c in cands if c.node == nxt)
        cands.remove(first)
        chosen = Candidate(first.node, "chosen", first.detail, first.domains)
        why = f"the next replica would go to {first.node}: fewest {first.detail}"
    else:
        why = p.why_not(model, d, 1)
        if level and any(c.verdict == "keep_within" for c in cands):
            why += (f" (keep_within {level}: " + (f"{home} has no room" if home else f"no node labelled with a {level} "
                                                                                  "fits") + ")")
    verdicts = Counter(c.verdict for c in cands)
    if chosen is not None:
        verdicts["chosen"] += 1
    out = Explanation(model, replica, chosen.node if chosen else node, chosen.domains if chosen else (), why,
                      ([chosen] if chosen else []) + cands[:MAX_ROWS], dict(verdicts),
                      max(0, len(cands) - MAX_ROWS), list(p.warnings))
    return out


def at_placement(before: Explanation, node: str, at: float) -> AtPlacement:
    """The record of a replica placed on `node` at `at`, from `before`: the explanation of where
    its model's next replica would go, made as the round that placed it began (one per model and
    round: the replicas a round places share it, each with its own node chosen). Refusals come
    first in the rows kept, since they are what a later look cannot recompute."""
    rows = [c for c in before.candidates if c.node != node]
    mine = next((c for c in before.candidates if c.node == node), None)
    chosen = Candidate(node, "chosen", mine.detail if mine else "", mine.domains if mine else ())
    rows = [Candidate(c.node, "fits", c.detail, c.domains) if c.verdict == "chosen" else c for c in rows]
    counts = Counter(before.counts)  # over every node, the rows left out of `before` too
    counts[mine.verdict if mine is not None else "fits"] -= 1
    counts["chosen"] += 1
    if before.node is not None and before.node != node:  # the next one would have gone there: it fitted
        counts["chosen"] -= 1
        counts["fits"] += 1
    rows.sort(key=lambda c: c.verdict == "fits")  # stable: refusals first, each group in its order
    kept = rows[:AT_PLACEMENT_ROWS - 1]
    refused = {v: n for v, n in counts.items() if v not in ("chosen", "fits") and n > 0}
    why = (f"placed on {node} ({'/'.join(x for x in chosen.domains if x) or 'no facility labels'})"
           + (f": {chosen.detail}" if chosen.detail else "")
           + ("; refused then: " + ", ".join(f"{n} {v}" for v, n in sorted(refused.items(), key=lambda vn: -vn[1]))
              if refused else ""))
    return AtPlacement(at, node, why, {v: n for v, n in counts.items() if n > 0}, (chosen, *kept),
                       max(0, len(rows) - len(kept)) + before.truncated)
