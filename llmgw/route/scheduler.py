"""The scheduler: filter → score → pick, with a recorded rationale for every decision.

Pure: no I/O and no clock except ``perf_counter_ns`` to time itself (injectable). The caller
passes monotonic ``now`` (breaker retry times) and ``wall`` (the decision's timestamp) in.

Cost model (it runs once per request, and at 512 replicas every pass over the candidates
costs ~10-40 µs): one fused scan first checks that no filter would drop anything (the common
case) and computes the load estimates on the way, else the filters run one by one; scorers
return affine columns (see :mod:`.scorers`) folded into one weighted-sum pass; one more pass
finds the best ``record_candidates`` (:func:`top_indices`), which also answers max-score when
its best is unique (the other pickers use C-level ``max``/``count``/``index`` rather than
sorting); only those few candidates are recorded in the Decision, as a fixed-size
:class:`~.ranked.Ranked` whose Candidate objects are built only when the rationale is read.
"""

from __future__ import annotations

import functools
import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .filters import ALL_OPEN_NOTE, healthy, pool_priority, serves
from .pickers import PICKERS, PickerState, pick_max_score
from .scorers import SCORERS, Observer, ScoreContext, Scorer, Scores
from .strategies import Strategy, StrategyError
from .ranked import Ranked
from .types import Candidate, Decision, EndpointView, FilterDrop, RequestInfo, SchedulerConfig

__all__ = ["SchedulerConfig", "Scheduler", "weighted_sum", "top_indices"]


@functools.cache
def _summer(k: int) -> Callable[..., list[float]]:
    # One fused comprehension per column count: k separate passes would cost k list rebuilds.
    a = ", ".join(f"a{i}" for i in range(k))
    v = ", ".join(f"v{i}" for i in range(k))
    x = ", ".join(f"x{i}" for i in range(k))
    terms = " + ".join(f"a{i} * x{i}" for i in range(k))
    ns: dict[str, Any] = {}
    exec(f"def weighted_sum({a}, {v}):\n    return [{terms} for {x} in zip({v})]", ns)
    return ns["weighted_sum"]


def weighted_sum(coefs: Sequence[float], columns: Sequence[Sequence[float]], n: int) -> list[float]:
    """``Σ_k coefs[k] * columns[k][i]`` for each i in range(n)."""
    k = len(coefs)
    if k == 0:
        return [0.0] * n
    if k == 1:
        a0 = coefs[0]
        return [a0 * x for x in columns[0]]
    return _summer(k)(*coefs, *columns)


def top_indices(values: list[float], k: int) -> list[int]:
    """Indices of the k largest values, largest first, ties by lowest index."""
    n = len(values)
    if n <= k:
        return sorted(range(n), key=values.__getitem__, reverse=True)
    if k == 1:
        return [values.index(max(values))]
    # A floor first: the k-th largest of a sample is at most the k-th largest of all (the k
    # sampled values at or above it are values too), so only values at or above it can make the
    # top k. A C-level sort of ~sqrt(k n) of them leaves one comparison per value and a sort of
    # the few at or above the floor (stable: equal values stay in index order).
    floor = sorted(values[::math.isqrt(n // k)])[-k]
    top = [i for i in range(n) if values[i] >= floor]
    if len(top) < k:  # only with NaNs, which defeat any order: still k indices
        top = list(range(n))
    top.sort(key=values.__getitem__, reverse=True)
    return top[:k]


def _unfiltered_loads(req: RequestInfo, endpoints: Sequence[EndpointView]) -> list[float] | None:
    """The common case in one scan: every endpoint serves the request, its breaker allows
    traffic, all share one pool priority and every scrape is fresh with both queue gauges. Then
    no filter would drop anything, and the load estimates (``ScoreContext.loads``) come out of
    the same pass. None otherwise: the caller takes the general path."""
    if not endpoints:
        return None
    base = req.base_model
    adapter = req.adapter
    p0 = endpoints[0].pool_priority
    # running + waiting + our starts since the scrape; `+ 0.0` when there are none would cost
    # another float op per candidate, so the sum is spelled twice
    try:
        if adapter is None:
            loads = [(e.running + e.waiting  # type: ignore[operator]
                      + (e.inflight - e.inflight_at_scrape)) if e.inflight > e.inflight_at_scrape
                     else e.running + e.waiting  # type: ignore[operator]
                     for e in endpoints
                     if e.model == base and e.available and e.pool_priority == p0 and not e.stale]
        else:
            loads = [(e.running + e.waiting  # type: ignore[operator]
                      + (e.inflight - e.inflight_at_scrape)) if e.inflight > e.inflight_at_scrape
                     else e.running + e.waiting  # type: ignore[operator]
                     for e in endpoints
                     if e.model == base and e.available and e.pool_priority == p0 and not e.stale
                     and adapter in e.adapters]
    except TypeError:  # a None gauge (llama.cpp, a partial scrape)
        return None
    return loads if len(loads) == len(endpoints) else None


def _unfiltered_freshness(req: RequestInfo, endpoints: Sequence[EndpointView]) -> bool | None:
    """None unless serves, healthy and pool_priority would all keep every endpoint (each serves
    the request, each breaker allows traffic, all share one pool priority): then whether every
    scrape is fresh, which the scorers need next. One scan instead of four."""
    if not endpoints:
        return None
    base = req.base_model
    adapter = req.adapter
    p0 = endpoints[0].pool_priority
    if adapter is None:
        stale = [e.stale for e in endpoints
                 if e.model == base and e.available and e.pool_priority == p0]
    else:
        stale = [e.stale for e in endpoints if e.model == base and e.available
                 and e.pool_priority == p0 and adapter in e.adapters]
    if len(stale) != len(endpoints):
        return None
    return True not in stale


class Scheduler:
    """Owns what outlives one decision: the config, the scorer registry, the pickers' state
    (round-robin counters) and the scorers' state (hash rings).

    Stateful scorers (those with an ``observe`` method, see :class:`~.scorers.Observer`) learn
    of each decision through :meth:`commit`: ``decide`` commits at once unless told
    ``commit=False`` — the router's core does that when the pick may still fall through (the
    chosen replica's cap turned out full), and commits only the decisions it acts on."""

    def __init__(self, config: SchedulerConfig | None = None, *,
                 scorers: Mapping[str, Scorer] | None = None,
                 timer: Callable[[], int] = time.perf_counter_ns) -> None:
        self.config = config or SchedulerConfig()
        self.scorers: dict[str, Scorer] = {**SCORERS, **(scorers or {})}
        self.picker_state = PickerState()
        self.scorer_state: dict[str, Any] = {}
        self.observers: list[Observer] = [s for s in self.scorers.values()  # type: ignore[misc]
                                          if callable(getattr(s, "observe", None))]
        self._timer = timer

    def commit(self, decision: Decision, req: RequestInfo, now: float) -> None:
        """Tell the stateful scorers what was decided (once: a second commit does nothing)."""
        pending = decision.pending
        if pending is None:
            return
        decision.pending = None
        for obs, kept in pending:
            obs.observe(decision, req, kept, now)

    def decide(self, req: RequestInfo, endpoints: Sequence[EndpointView], strategy: Strategy, *,
               now: float, wall: float, rng: random.Random, commit: bool = True) -> Decision:
        d = self._decide(req, endpoints, strategy, now, wall, rng)
        if commit and d.pending is not None:
            self.commit(d, req, now)
        return d

    def _decide(self, req: RequestInfo, endpoints: Sequence[EndpointView], strategy: Strategy,
                now: float, wall: float, rng: random.Random) -> Decision:
        t0 = self._timer()
        cfg = self.config
        dropped: list[FilterDrop] = []
        notes: list[str] = []
        fallback = False

        loads = _unfiltered_loads(req, endpoints)
        fresh = True if loads is not None else _unfiltered_freshness(req, endpoints)
        if fresh is not None:  # the common case: nothing to filter
            members = eps = endpoints
        else:
            # serves first, so "all breakers open" is judged among this model's endpoints only
            res = serves(req, endpoints)
            members = res.kept
            if res.drops:
                dropped.extend(res.drops)
            if not members:
                what = (f"adapter {req.adapter!r} of {req.base_model!r}" if req.adapter
                        else f"model {req.base_model!r}")
                return self._decision(req, strategy, None, [], dropped,
                                      [f"no endpoint serves {what}"], wall, t0, 0, None)
            res = healthy(members, now)
            if res.drops:
                dropped.extend(res.drops)
            if res.note:
                notes.append(res.note)
                fallback = res.note == ALL_OPEN_NOTE
            res = pool_priority(res.kept, cfg)
            if res.drops:
                dropped.extend(res.drops)
            if res.note:
                notes.append(res.note)
            eps = res.kept
        n = len(eps)

        ctx = ScoreContext(req, eps, members, cfg, now, self.scorer_state)
        ctx._fresh = fresh  # known from the fused scan; None = let the context compute it
        ctx._loads = loads
        scorers = self.scorers
        names: list[str] = []
        scores: list[Scores] = []
        const = 0.0  # Σ weight × offset: the same for every candidate, so added only where
        coefs: list[float] = []  # totals are shown; no picker depends on a common shift
        columns: list[Sequence[float]] = []
        sparse: list[tuple[float, dict[int, float]]] | None = None
        for name, w in strategy.weights.items():
            fn = scorers.get(name)
            if fn is None:
                raise StrategyError(f"strategy {strategy.name!r} weights unknown scorer {name!r}")
            sc = fn(ctx)
            names.append(name)
            scores.append(sc)
            const += w * sc.offset
            if sc.scale != 0.0:
                if isinstance(sc.values, dict):
                    if sparse is None:
                        sparse = []
                    sparse.append((w * sc.scale, sc.values))
                else:
                    coefs.append(w * sc.scale)
                    columns.append(sc.values)
        totals = weighted_sum(coefs, columns, n)
        vals: Sequence[float] | dict[int, float]  # (declared for the compiled core: two loops bind it)
        get: Callable[[int, Any], Any]
        if sparse is not None:
            for a, vals in sparse:
                for i, v in vals.items():
                    totals[i] += a * v

        # Only the best few candidates (and the pick) are recorded below: a Candidate with
        # its score dict costs ~1 µs, more than the rest of the decision per candidate.
        order = top_indices(totals, cfg.record_candidates)
        picker = PICKERS[strategy.picker]
        key = req.model
        vetoed = ctx.vetoed
        loads = ctx._loads
        if vetoed and len(vetoed) < n:
            allowed = [i for i in range(n) if i not in vetoed]
            j = picker([totals[i] for i in allowed], [eps[i] for i in allowed],
                       None if loads is None else [loads[i] for i in allowed],
                       rng=rng, state=self.picker_state, key=key, param=strategy.param)
            chosen = allowed[j]
            notes.append(f"{len(vetoed)} candidate(s) vetoed by a hard limit")
        elif not vetoed and picker is pick_max_score and (
                n == 1 or (len(order) > 1 and totals[order[0]] > totals[order[1]])):
            chosen = order[0]  # max-score's answer when the best is unique: no max/count scans
        else:
            if vetoed:
                notes.append("every candidate is over a hard limit: picking among them anyway")
            chosen = picker(totals, eps, loads, rng=rng, state=self.picker_state, key=key,
                            param=strategy.param)
        if chosen not in order:
            order[-1] = chosen
        # each scorer's value at each kept candidate, then one {name: value} dict per candidate
        k = len(order)
        cols: list[Sequence[float]] = []
        for vals, a, off in scores:
            if a == 0.0:
                cols.append((off,) * k)
            elif isinstance(vals, dict):
                get = vals.get
                cols.append([off + a * get(i, 0.0) for i in order])
            else:
                cols.append([off + a * vals[i] for i in order])
        # the rationale as a fixed-size record: its Candidates are built when it is read (Ranked)
        flags = ctx.flags
        candidates = Ranked(tuple(names), cols, [eps[i].id for i in order], [const + totals[i] for i in order],
                            None if flags is None else [tuple(flags.get(i, ())) for i in order])
        d = self._decision(req, strategy, eps[chosen].id, candidates, dropped, notes,
                           wall, t0, n, ctx.kept)
        d.fallback = fallback
        return d

    def _decision(self, req: RequestInfo, strategy: Strategy, chosen: str | None,
                  candidates: Sequence[Candidate], dropped: list[FilterDrop], notes: list[str],
                  wall: float, t0: int, n: int, kept: dict[Any, Any] | None) -> Decision:
        observers = self.observers
        pending = None
        if observers:
            pending = [(o, None) for o in observers] if kept is None else \
                [(o, kept.get(o)) for o in observers]
        return Decision(
            request_id=req.request_id, model=req.model, strategy=strategy.name,
            picker=strategy.picker, chosen=chosen, candidates=candidates, dropped=dropped,
            weights=strategy.weights,  # type: ignore[arg-type]  # shared, read-only
            decided_at=wall, decide_us=(self._timer() - t0) / 1000.0, note="; ".join(notes),
            n_candidates=n, pending=pending,
        )
