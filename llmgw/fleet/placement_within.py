"""keep_within for a disaggregated model ([models.pd] keep_within = LEVEL, ``Policy.all_within``):
every prefill and decode replica of the model inside ONE domain of that level — the reach of the
network its engines' KV transfer runs on.

The domain (the model's *home*) is where the model's replicas that stay already are: the domain of
that level holding the most of them, ties to the first by name. A model with none yet has none: its
first new replica goes where the placer would put it anyway (among the nodes labelled at that
level) and decides it, and the round's other replicas — of either group — follow. Nodes outside the
home, or without a label at the level, are never chosen; when the home is full the reason says so
(``keep_within rack: rack=r1 has no room …``) and nothing is placed outside it.

It is a placement-only confinement (`Placer.place`'s `only`), not part of what a replica demands:
the stored assignments' demand and spec do not carry it, so setting or changing it restarts
nothing and moves nothing that runs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from llmgw.fleet.domains import LEVELS
from llmgw.fleet.placement import _WHY, Demand, Placer, _Bin

__all__ = ["home_domain", "home_in", "place_within", "within_refusal"]


def home_domain(domains: Iterable[str]) -> str | None:
    """The domain holding the most of `domains` (a model's replicas' domains at the level; "" for
    a node without one is not a domain), ties to the first by name; None when there are none."""
    c = Counter(d for d in domains if d)
    if not c:
        return None
    return min(c, key=lambda d: (-c[d], d))


def home_in(p: Placer, model: str, level: str) -> str | None:
    """The model's home as the placer's replicas of it stand (every one given to it): what an
    explanation uses (the reconciler's leaves out the replicas that are moving away)."""
    c = p.counts(model)[LEVELS.index(level)]
    return min((dom for dom in c if dom and c[dom] > 0), key=lambda dom: (-c[dom], dom), default=None)


def place_within(p: Placer, model: str, d: Demand, n: int, level: str, home: str | None, *,
                 unit: str = "") -> tuple[list[tuple[str, tuple[int, ...]]], str | None, str | None]:
    """Up to n placements of `model` (of group `unit`) inside `home`, a domain of `level` (None:
    the first placement chooses it among the nodes labelled at `level`). Answers the placements,
    why not all (None: all placed) and the home (as chosen, when it was None)."""
    i = LEVELS.index(level)
    out: list[tuple[str, tuple[int, ...]]] = []
    if home is None and n > 0:
        first, _ = p.place(model, d, 1, unit=unit, only=lambda b: bool(b.domains[i]))
        if not first:
            return [], _nowhere(p, model, d, n, level, i), None
        out += first
        home = p.bins[first[0][0]].domains[i]
    if len(out) < n:
        more, _ = p.place(model, d, n - len(out), unit=unit, only=lambda b: b.domains[i] == home)
        out += more
    if len(out) == n:
        return out, None, home
    assert home is not None
    return out, _full(p, model, d, n - len(out), level, i, home), home


def within_refusal(domains: tuple[str, ...], level: str, home: str | None) -> str | None:
    """Why keep_within refuses a node with these domains (None: it does not)."""
    i = LEVELS.index(level)
    if not domains or not domains[i]:
        return f"no {level} label: keep_within {level} keeps the model inside one {level}"
    if home is not None and domains[i] != home:
        return f"outside {home}, where the model's replicas are kept (keep_within {level})"
    return None


def _head(d: Demand, missing: int) -> str:
    return f"{missing} replica{'s' if missing > 1 else ''} cannot be placed (each needs {d.describe()})"


def _verdicts(p: Placer, model: str, d: Demand, bins: list[_Bin]) -> str:
    pol = p.policy(model)
    counts = Counter(p.misfit(b, d, pol) or "spread" for b in bins)
    return "; ".join(f"{c} {_WHY[r]}" for r, c in sorted(counts.items(), key=lambda rc: (-rc[1], rc[0])))


def _full(p: Placer, model: str, d: Demand, missing: int, level: str, i: int, home: str) -> str:
    mine = [b for b in p.bins.values() if b.domains[i] == home]
    away = sum(1 for b in p.others.values() if b.domains[i] == home)
    parts = [x for x in (_verdicts(p, model, d, mine), f"{away} not ready" if away else "") if x]
    nodes = len(mine) + away
    head = f"{_head(d, missing)}: keep_within {level}: {home} has no room"
    if not parts:
        return f"{head}: none of its nodes is ready"
    return f"{head}: of its {nodes} node{'s' if nodes != 1 else ''}, " + "; ".join(parts)


def _nowhere(p: Placer, model: str, d: Demand, missing: int, level: str, i: int) -> str:
    """No node labelled at `level` fits one replica: because none is labelled, or for the usual reasons."""
    labelled = [b for b in p.bins.values() if b.domains[i]]
    if p.bins and not labelled:
        return (f"{_head(d, missing)}: keep_within {level}: no ready node has a {level} label "
                f"(llmgw.io/{level})")
    return p.why_not(model, d, missing) if len(labelled) == len(p.bins) else (
        f"{_head(d, missing)}: keep_within {level}: of the {len(labelled)} nodes labelled with a {level}, "
        + _verdicts(p, model, d, labelled))
