"""Tier 2 of cache-aware routing: the ``kv_cache`` scorer votes by the share of a request's
leading KV blocks each candidate's engine really holds, as its KV events say.

The router's shell tokenizes the request through an engine's ``/tokenize`` and hashes the full
blocks with vLLM's scheme (``RequestInfo.kv_hashes``, the events' 64-bit int form); this scorer
asks the index (a callable handed in at construction: the pure core never sees the daemon's
object) how many of those hashes each replica holds contiguously from the first, and scores a
candidate ``held / len(hashes)``. No hashes (a model without kv_events, or tokenization failed)
or no index: every candidate scores 0 and tier 1 (``prefix``) decides alone. Where a candidate
holds at least the first block, tier 1 votes tier 2's shares instead of its own guess
(:meth:`KvCacheScorer.verdict`, wired to ``PrefixRouting.defer``): the engines' report beats the
router's guess, and the affinity keeps both tiers' weight. Either way the decision's
note says which tier decided and why (``observe``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .scorers import ScoreContext, Scores
from .types import RequestInfo

__all__ = ["KvCacheScorer", "LeadingBlocks"]

# hashes -> {replica id: leading blocks held}
LeadingBlocks = Callable[[Sequence[int]], Mapping[Any, int]]


class KvCacheScorer:
    """Stateless apart from ``lookup`` (set once the index exists; None = no index)."""

    def __init__(self, lookup: LeadingBlocks | None = None) -> None:
        self.lookup = lookup
        self._memo: tuple[RequestInfo, float, Mapping[Any, int]] | None = None

    def held(self, req: RequestInfo, now: float) -> Mapping[Any, int] | None:
        """The index's answer for ``req`` (None: no hashes or no index), asked once per decision."""
        hashes = req.kv_hashes
        if not hashes or self.lookup is None:
            return None
        memo = self._memo
        if memo is not None and memo[0] is req and memo[1] == now:
            return memo[2]
        held = self.lookup(hashes)
        self._memo = (req, now, held)
        return held

    def verdict(self, req: RequestInfo, endpoints: Sequence[Any], now: float) -> dict[int, float] | None:
        """Tier 2's shares by candidate index where a candidate's engine holds at least the
        request's first block, else None. Tier 1 then votes these instead of its own guess
        (``PrefixRouting.defer``), so the affinity keeps both tiers' weight."""
        held = self.held(req, now)
        if not held:
            return None
        total = len(req.kv_hashes or ())
        vals = {i: min(n, total) / total for i, e in enumerate(endpoints) if (n := held.get(e.id, 0)) > 0}
        return vals or None

    def __call__(self, ctx: ScoreContext) -> Scores:
        req = ctx.req
        hashes = req.kv_hashes
        held = self.held(req, ctx.now)
        if held is None or hashes is None:
            if hashes is not None or req.kv_note:
                why = req.kv_note or ("no tier-2 index" if self.lookup is None else "no full block")
                ctx.keep(self, f"tier 2 unavailable: {why}; tier 1 decides")
            return Scores.constant(0.0)
        total = len(hashes)
        vals: dict[int, float] = {}
        best, best_id = 0, ""
        for i, e in enumerate(ctx.endpoints):
            n = held.get(e.id, 0)
            if n > 0:
                vals[i] = min(n, total) / total
                if n > best:
                    best, best_id = n, e.id
        if not vals:
            ctx.keep(self, f"tier 2: no candidate holds the first of {total} blocks; tier 1 decides")
            return Scores.constant(0.0)
        ctx.keep(self, f"tier 2: {min(best, total)}/{total} blocks on {best_id}")
        return Scores(vals)

    def observe(self, decision: Any, req: RequestInfo, kept: Any, now: float) -> None:
        if kept:
            decision.note = f"{decision.note}; {kept}" if decision.note else kept

