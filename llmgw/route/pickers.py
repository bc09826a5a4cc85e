"""The scheduler's pickers: turn the candidates' weighted totals into one choice.

Every picker has the same signature and returns an index into ``totals`` / ``endpoints``
(``loads``, when the scheduler already has them, spare the tie-break recomputing them).
Randomness only comes from the injected ``rng`` and memory only from the injected ``state``,
so decisions replay exactly in tests.
"""

from __future__ import annotations

import math
import random
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Protocol

from .filters import load_estimate
from .types import EndpointView

__all__ = [
    "PickerState", "Picker", "PICKERS", "DEFAULT_TEMPERATURE",
    "pick_max_score", "pick_power_of_two", "pick_softmax", "pick_round_robin", "tie_break",
]

DEFAULT_TEMPERATURE = 0.1  # totals live in [0, 1]: a 0.1 lead makes a candidate e times likelier


@dataclass(slots=True)
class PickerState:
    """What pickers remember between decisions: the round-robin counter per key (model)."""

    rr: dict[str, int] = field(default_factory=dict)


class Picker(Protocol):
    def __call__(self, totals: list[float], endpoints: Sequence[EndpointView],
                 loads: Sequence[float] | None, *, rng: random.Random, state: PickerState,
                 key: str, param: float | None) -> int: ...


def tie_break(indices: Sequence[int], endpoints: Sequence[EndpointView],
              loads: Sequence[float] | None = None, rng: random.Random | None = None) -> int:
    """Among equally scored candidates: the least loaded, then (with ``rng``) a random one of
    those, else the smallest id. Random matters: an idle fleet ties on everything, and a fixed
    order would send every cold prefix to the same replica.
    ``loads`` are the candidates' load estimates if already computed (else computed here)."""
    if loads is None:
        ls = [load_estimate(endpoints[i]) for i in indices]
    else:
        ls = [loads[i] for i in indices]
    lo = min(ls)
    if ls.count(lo) == 1:
        return indices[ls.index(lo)]
    best = [i for i, x in zip(indices, ls) if x == lo]
    if rng is not None:
        return best[rng.randrange(len(best))]
    ids = [endpoints[i].id for i in best]
    return best[ids.index(min(ids))]


def _all_indices(values: list[float], v: float) -> list[int]:
    # C-level index scans instead of a Python pass over every candidate
    out = [values.index(v)]
    for _ in range(values.count(v) - 1):
        out.append(values.index(v, out[-1] + 1))
    return out


def pick_max_score(totals: list[float], endpoints: Sequence[EndpointView],
                   loads: Sequence[float] | None = None, *, rng: random.Random,
                   state: PickerState, key: str, param: float | None) -> int:
    best = max(totals)
    if totals.count(best) == 1:  # exact ties only: equal inputs give bit-equal totals
        return totals.index(best)
    return tie_break(_all_indices(totals, best), endpoints, loads, rng)


def pick_power_of_two(totals: list[float], endpoints: Sequence[EndpointView],
                      loads: Sequence[float] | None = None, *, rng: random.Random,
                      state: PickerState, key: str, param: float | None) -> int:
    """Two distinct candidates at random, the better one wins: nearly the balance of max-score
    without every router herding onto the same momentary best."""
    n = len(totals)
    if n == 1:
        return 0
    i = rng.randrange(n)
    j = rng.randrange(n - 1)
    if j >= i:
        j += 1
    ti, tj = totals[i], totals[j]
    if ti != tj:
        return i if ti > tj else j
    return tie_break((i, j), endpoints, loads)


def pick_softmax(totals: list[float], endpoints: Sequence[EndpointView],
                 loads: Sequence[float] | None = None, *, rng: random.Random,
                 state: PickerState, key: str, param: float | None) -> int:
    """Sample with probability ∝ exp(total / temperature); temperature <= 0 is max-score."""
    temp = DEFAULT_TEMPERATURE if param is None else param
    if temp <= 0:
        return pick_max_score(totals, endpoints, loads, rng=rng, state=state, key=key,
                              param=param)
    best = max(totals)
    inv = 1.0 / temp
    exp = math.exp
    cum = list(accumulate([exp((t - best) * inv) for t in totals]))  # shifted: no overflow
    i = bisect_right(cum, rng.random() * cum[-1])
    return i if i < len(cum) else len(cum) - 1


def pick_round_robin(totals: list[float], endpoints: Sequence[EndpointView],
                     loads: Sequence[float] | None = None, *, rng: random.Random,
                     state: PickerState, key: str, param: float | None) -> int:
    """Ignores the scores: the n-th decision for ``key`` takes candidate n mod count."""
    c = state.rr.get(key, 0)
    state.rr[key] = c + 1
    return c % len(totals)


PICKERS: dict[str, Picker] = {
    "max-score": pick_max_score,
    "power-of-two": pick_power_of_two,
    "softmax": pick_softmax,
    "round-robin": pick_round_robin,
}
