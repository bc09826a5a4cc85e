"""Routing strategies. A strategy is only data: scorer weights, a picker and its parameter.

Weights are normalised to sum to 1 (zero weights dropped), so a candidate's total is in [0, 1]
and totals compare across strategies. The presets' names, like the scorers' and pickers', are
listed in :mod:`.names`.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from llmgw.config.names import DEFAULT_PICKER, PRESET_NAMES
from .pickers import PICKERS
from .scorers import SCORERS

__all__ = ["Strategy", "PRESETS", "resolve", "StrategyError", "RESERVED_KEYS"]

RESERVED_KEYS = ("picker", "param")  # override keys that are not scorer weights


class StrategyError(ValueError):
    pass


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _suggest(name: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


@dataclass(frozen=True, slots=True)
class Strategy:
    name: str
    weights: Mapping[str, float]  # scorer name -> weight; read-only once built
    picker: str = DEFAULT_PICKER
    param: float | None = None  # the picker's parameter: softmax temperature

    def __post_init__(self) -> None:
        where = f"strategy {self.name!r}"
        for k, w in self.weights.items():
            if not _finite(w) or w < 0:
                raise StrategyError(f"{where}: weight {k!r} must be a number >= 0, got {w!r}")
        total = sum(self.weights.values())
        if total <= 0:
            raise StrategyError(f"{where}: at least one weight must be > 0")
        if self.picker not in PICKERS:
            raise StrategyError(f"{where}: unknown picker {self.picker!r}"
                                f"{_suggest(self.picker, PICKERS)}; "
                                f"known: {', '.join(sorted(PICKERS))}")
        if self.param is not None and not _finite(self.param):
            raise StrategyError(f"{where}: param must be a finite number, got {self.param!r}")
        object.__setattr__(self, "weights",
                           {k: w / total for k, w in self.weights.items() if w > 0})


_CHAT, _BATCH, _LONG_CONTEXT, _LOAD_BALANCE, _PREFILL, _DECODE = PRESET_NAMES  # one preset per name in names.PRESET_NAMES

PRESETS: dict[str, Strategy] = {
    s.name: s for s in (
        # Latency, and the default: send a request where its prompt's head is cached (a cache hit
        # skips the head's prefill), balanced by load and queue — the prefix guard withdraws the
        # affinity of a replica that is too busy — and never into a full KV cache (the kv veto).
        # docs/prefix-routing.md has the figures.
        # Tier 2 (kv_cache, models with kv_events only) outweighs tier 1 where both vote: it
        # knows what the engine holds; without hashes it scores 0 everywhere, changing nothing.
        Strategy(_CHAT, {"prefix": 0.55, "kv_cache": 0.60, "load": 0.20, "queue": 0.15, "kv": 0.10}),
        # Throughput: fill KV and drain queues evenly; power-of-two spreads without herding;
        # still a vote for where the prompt is cached.
        Strategy(_BATCH, {"kv": 0.35, "queue": 0.30, "load": 0.10, "weight": 0.05, "prefix": 0.20},
                 picker="power-of-two"),
        # Long prompts need KV room most: a full cache means preemption and recompute; a cached
        # head saves the most prefill here.
        Strategy(_LONG_CONTEXT, {"kv": 0.50, "queue": 0.15, "load": 0.15, "prefix": 0.20}),
        # No affinity at all: where a request starts soonest.
        Strategy(_LOAD_BALANCE, {"load": 0.40, "queue": 0.20, "kv": 0.20, "inflight": 0.10,
                                 "weight": 0.10}),
        # Disaggregated models ([models.pd], docs/disaggregation.md): the prefiller's decision —
        # where the prompt's blocks are cached (a hit is prefill not done), then the shortest
        # prefill queue; its KV holds a prompt only until the decoder has pulled it.
        Strategy(_PREFILL, {"kv_cache": 0.55, "prefix": 0.45, "queue": 0.35, "load": 0.15, "kv": 0.05}),
        # ... and the decoder's: KV headroom (every stream's blocks live there until it ends) and
        # decode load; no affinity — its blocks come from the prefiller.
        Strategy(_DECODE, {"kv": 0.45, "load": 0.35, "inflight": 0.20}),
    )
}


def resolve(name: str, overrides: Mapping[str, Any] | None = None, *,
            scorers: Iterable[str] | None = None) -> Strategy:
    """A preset by name, with ``overrides`` merged in: scorer name -> weight (0 disables a
    scorer), plus the reserved keys ``picker`` and ``param``. ``scorers`` is the set of scorer
    names weights may use (default: the built-in :data:`SCORERS`)."""
    base = PRESETS.get(name)
    if base is None:
        raise StrategyError(f"unknown strategy {name!r}{_suggest(name, PRESETS)}; "
                            f"known: {', '.join(sorted(PRESETS))}")
    if not overrides:
        return base
    known = set(SCORERS if scorers is None else scorers)
    weights = dict(base.weights)
    picker, param = base.picker, base.param
    for k, v in overrides.items():
        if k == "picker":
            picker = v
        elif k == "param":
            param = v
        elif k in known:
            weights[k] = v
        else:
            raise StrategyError(f"strategy {name!r}: unknown scorer {k!r}"
                                f"{_suggest(k, [*known, *RESERVED_KEYS])}; known: "
                                f"{', '.join(sorted(known))}, or {' / '.join(RESERVED_KEYS)}")
    return Strategy(name, weights, picker, param)
