"""The scheduler's scorers: how good each candidate is for this request, in [0, 1] (1 = best).

A scorer is any callable ``(ScoreContext) -> Scores``; register it in :data:`SCORERS` (or pass
it to ``Scheduler(scorers=...)``) and give it a weight in a strategy. Scores are column-wise, one
value per candidate, in candidate order, because one list comprehension per decision is far
cheaper than one call per candidate.

A :class:`Scores` is *affine*: candidate i scores ``offset + scale * values[i]``. Scorers of the
"1 - x / max" kind hand back the raw metric column with ``scale = -1/max`` instead of building a
normalised copy; the scheduler folds every scale into a single weighted-sum pass, and a column
whose scale is 0 (every candidate scores the same) costs nothing at all. A scorer whose values
are already final returns ``Scores(values)``. Affinity scorers, where few candidates score
anything, return ``values`` as a sparse ``{index: value}`` dict (absent = 0): the scheduler adds
those few terms after the dense pass.

Missing metrics (never scraped, stale, or absent from the engine's contract: llama.cpp has no KV
gauge) score a neutral 0.5 and never trigger a hard check.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from .filters import loads_of
from .hashring import HashRing, IndexedLoads, RingCache
from .types import EndpointView, RequestInfo, SchedulerConfig

__all__ = [
    "NEUTRAL", "Scores", "ScoreContext", "Scorer", "SCORERS",
    "score_queue", "score_kv", "score_inflight", "score_load", "score_weight", "score_session",
]

NEUTRAL = 0.5  # the score of an unknown metric: neither attracts nor repels


class Scores(NamedTuple):
    """Candidate i scores ``offset + scale * values[i]``. ``values`` is one value per candidate,
    or a sparse ``{index: value}`` dict (absent = 0). When ``scale == 0`` every candidate scores
    ``offset`` and ``values`` may be empty."""

    values: Sequence[float] | dict[int, float]
    scale: float = 1.0
    offset: float = 0.0

    @classmethod
    def constant(cls, value: float) -> Scores:
        return cls((), 0.0, value)

    def at(self, i: int) -> float:
        if self.scale == 0.0:
            return self.offset
        v = self.values
        return self.offset + self.scale * (v.get(i, 0.0) if isinstance(v, dict) else v[i])


@dataclass(slots=True)
class ScoreContext:
    """What scorers see of one decision. ``state`` is a dict the Scheduler keeps across
    decisions, for scorers that keep structures (hash rings, later prefix indexes)."""

    req: RequestInfo
    endpoints: Sequence[EndpointView]  # the candidates, after filters
    members: Sequence[EndpointView]  # every endpoint serving the request, healthy or not
    cfg: SchedulerConfig
    now: float
    state: dict[str, Any]
    _loads: list[float] | None = None
    _fresh: bool | None = None
    flags: dict[int, list[str]] | None = None  # candidate index -> remarks for the decision
    vetoed: set[int] | None = None  # candidates only picked when every candidate is vetoed
    kept: dict[Any, Any] | None = None  # observer -> what it noted while scoring (see keep())

    @property
    def loads(self) -> list[float]:
        """:func:`~llmgw.route.filters.load_estimate` per candidate, computed once per decision."""
        if self._loads is None:
            eps = self.endpoints
            if self.fresh:
                try:  # inlined load_estimate for the common case: fresh, both gauges present
                    # (the scheduler's fused scan computes the very same expression)
                    self._loads = [(e.running + e.waiting  # type: ignore[operator]
                                    + (e.inflight - e.inflight_at_scrape))
                                   if e.inflight > e.inflight_at_scrape
                                   else e.running + e.waiting  # type: ignore[operator]
                                   for e in eps]
                    return self._loads
                except TypeError:  # a None gauge
                    pass
            self._loads = loads_of(eps)
        return self._loads

    @property
    def fresh(self) -> bool:
        """No candidate's scrape is stale: scraped metrics can be used as they are."""
        if self._fresh is None:
            self._fresh = True not in [e.stale for e in self.endpoints]
        return self._fresh

    def keep(self, observer: Any, value: Any) -> None:
        """A stateful scorer notes what it found while scoring; its ``observe`` gets it back
        with the decision (nothing outlives the decision but what observe records)."""
        if self.kept is None:
            self.kept = {}
        self.kept[observer] = value

    def flag(self, i: int, text: str, *, veto: bool = False) -> None:
        if self.flags is None:
            self.flags = {}
        self.flags.setdefault(i, []).append(text)
        if veto:
            if self.vetoed is None:
                self.vetoed = set()
            self.vetoed.add(i)


Scorer = Callable[[ScoreContext], Scores]


class Observer(Protocol):
    """A stateful scorer (one with memory across decisions, like the prefix index) also has
    ``observe``: the scheduler calls it once per committed decision — after the pick, with the
    replica actually chosen — whatever weight the strategy gives the scorer. ``kept`` is what
    the scorer passed to :meth:`ScoreContext.keep` while scoring this request (None when it did
    not score it). It may add to ``decision.note``; it must not change the choice."""

    def __call__(self, ctx: ScoreContext) -> Scores: ...

    def observe(self, decision: Any, req: RequestInfo, kept: Any, now: float) -> None: ...


def _less_is_better(values: Sequence[float]) -> Scores:
    """1 - x / max(x) over the candidates (x >= 0), without building the normalised column.
    All zero (an idle fleet) is a constant column, which the weighted sum skips; a full
    min() scan to catch equal non-zero values would cost more than it saves."""
    hi = max(values)
    if hi <= 0:
        return Scores.constant(1.0)
    return Scores(values, -1.0 / hi, 1.0)


def _less_is_better_partial(values: Sequence[float | None]) -> Scores:
    """As :func:`_less_is_better`, unknown (None) values scoring NEUTRAL."""
    known = [v for v in values if v is not None]
    if not known:
        return Scores.constant(NEUTRAL)
    hi = max(known)
    inv = 1.0 / hi if hi > 0 else 0.0
    return Scores([NEUTRAL if v is None else 1.0 - v * inv for v in values])


def score_queue(ctx: ScoreContext) -> Scores:
    """The engine's waiting queue: requests there wait for a free slot, so fewer is better."""
    eps = ctx.endpoints
    if ctx.fresh:
        vals = [e.waiting for e in eps]
        try:
            return _less_is_better(vals)  # type: ignore[arg-type]
        except TypeError:  # some None: min/max refuse them, so the check costs nothing
            pass
    return _less_is_better_partial([None if e.stale else e.waiting for e in eps])


def score_kv(ctx: ScoreContext) -> Scores:
    """KV cache headroom, 1 - usage / ceiling. At or above the ceiling the replica is about to
    preempt (or already does): it scores 0 and is vetoed — picked only if every candidate is."""
    ceiling = ctx.cfg.kv_ceiling
    eps = ctx.endpoints
    if ctx.fresh:
        vals: list[float | None] = [e.kv_usage for e in eps]
        try:
            hi = max(vals)  # type: ignore[type-var]
            if hi < ceiling:  # type: ignore[operator]
                if hi <= 0:  # type: ignore[operator]
                    return Scores.constant(1.0)
                return Scores(vals, -1.0 / ceiling, 1.0)  # type: ignore[arg-type]
        except TypeError:  # some None: llama.cpp has no KV gauge at all
            if vals.count(None) == len(vals):
                return Scores.constant(NEUTRAL)
    else:
        vals = [None if e.stale else e.kv_usage for e in eps]
        if vals.count(None) == len(vals):
            return Scores.constant(NEUTRAL)
    out: list[float] = []
    for i, v in enumerate(vals):
        if v is None:
            out.append(NEUTRAL)
        elif v >= ceiling:
            out.append(0.0)
            ctx.flag(i, f"kv {v:.2f} >= ceiling {ceiling:.2f}", veto=True)
        else:
            out.append(1.0 - v / ceiling)
    return Scores(out)


def score_inflight(ctx: ScoreContext) -> Scores:
    """Our own live inflight count: exact and instant, but blind to other routers' traffic."""
    return _less_is_better([e.inflight for e in ctx.endpoints])


def score_load(ctx: ScoreContext) -> Scores:
    """Running + waiting at the last scrape plus what we started since: a burst between scrapes
    lowers the score of the replica it lands on instead of herding onto the one that looked idle."""
    return _less_is_better(ctx.loads)


def score_weight(ctx: ScoreContext) -> Scores:
    """The static weight from the config, relative to the largest candidate weight."""
    ws = [e.weight for e in ctx.endpoints]
    if ws.count(ws[0]) == len(ws):  # the usual fleet of equals: a C scan, mostly identity checks
        return Scores.constant(1.0)
    hi = max(ws)
    if hi <= 0:
        return Scores.constant(1.0)
    return Scores(ws, 1.0 / hi)


class _SessionRings:
    """Hash rings per (model, adapter). Checking that the members are the very view objects of
    the previous decision is an identity scan; only when that fails are their ids compared."""

    __slots__ = ("rings", "last")

    def __init__(self, vnodes: int) -> None:
        self.rings = RingCache(vnodes)
        self.last: dict[object, tuple[list[EndpointView], dict[str, int], HashRing]] = {}

    def get(self, group: object,
            members: Sequence[EndpointView]) -> tuple[dict[str, int], HashRing]:
        last = self.last.get(group)
        if last is not None and last[0] == members:
            return last[1], last[2]
        pos, ring = self.rings.get_indexed(group, [e.id for e in members])
        self.last[group] = (list(members), pos, ring)
        return pos, ring


def score_session(ctx: ScoreContext) -> Scores:
    """Session affinity: the replica a session key maps to by consistent hashing with bounded
    loads scores 1, every other 0 (no key: all 0). The ring spans every endpoint serving the
    request, healthy or not, so a breaker trip moves only the sessions of that replica."""
    key = ctx.req.session_key
    eps = ctx.endpoints
    if key is None or not eps:
        return Scores.constant(0.0)
    cfg = ctx.cfg
    rings = ctx.state.get("session")
    if rings is None:
        rings = ctx.state["session"] = _SessionRings(cfg.ring_vnodes)
    members = ctx.members
    pos, ring = rings.get((ctx.req.base_model, ctx.req.adapter), members)
    if members is eps:  # nothing filtered: candidate i is member i, no {id: load} dict needed
        target, home = ring.place(key, IndexedLoads(pos, ctx.loads), cfg.bounded_load_c)
        i = pos[target]  # type: ignore[index]
    else:
        ids = [e.id for e in eps]
        target, home = ring.place(key, dict(zip(ids, ctx.loads)), cfg.bounded_load_c)
        i = ids.index(target)  # type: ignore[arg-type]
    ctx.flag(i, "session home" if home == target
             else f"session moved off {home} (filtered out or at its load bound)")
    return Scores({i: 1.0})


def score_no_prefix(ctx: ScoreContext) -> Scores:
    """The ``prefix`` scorer where no prefix index is wired in (a bare Scheduler, as in tools and
    tests): every candidate scores the same. The router registers the real one
    (:class:`~.prefix_scorer.PrefixRouting`) under this name."""
    return Scores.constant(0.0)


def score_no_kv_cache(ctx: ScoreContext) -> Scores:
    """The ``kv_cache`` scorer where no tier-2 index is wired in: every candidate scores 0. The
    router registers the real one (:class:`~.kv_scorer.KvCacheScorer`) under this name."""
    return Scores.constant(0.0)


SCORERS: dict[str, Scorer] = {
    "prefix": score_no_prefix,
    "kv_cache": score_no_kv_cache,
    "load": score_load,
    "queue": score_queue,
    "kv": score_kv,
    "inflight": score_inflight,
    "weight": score_weight,
    "session": score_session,
}
