"""Tier 2 of cache-aware routing: the ``kv_cache`` scorer votes by the share of a request's
leading KV blocks each candidate's engine really holds, as its KV events say.

The router's shell tokenizes the request through an engine's ``/tokenize`` and hashes the full
blocks with vLLM's scheme (``RequestInfo.kv_hashes``, the events' 64-bit int form); this scorer
asks the index (a callable handed in at construction: the pure core never sees the daemon's
object) how many of those hashes each replica holds contiguously from the first, and scores a
candidate ``held / blocks``, ``blocks`` being the prompt's full blocks (``RequestInfo.kv_blocks``:
the hashes may stop short of them where no replica holds the block before, so no replica holds
more than were hashed). No hashes (a model without kv_events, or tokenization failed)
or no index: every candidate scores 0 and tier 1 (``prefix``) decides alone. Where a candidate
holds at least the first block, tier 1 votes tier 2's shares instead of its own guess
(:meth:`KvCacheScorer.verdict`, wired to ``PrefixRouting.defer``): the engines' report beats the
router's guess, and the affinity keeps both tiers' weight. Where none does, tier 1's guess does
not count for a candidate whose engine publishes events and holds none of the prompt
(:meth:`KvCacheScorer.denied`, wired to ``PrefixRouting.deny``) — unless the router sent that
replica this first block so lately that its events may still be on their way (:class:`RecentSends`:
while the request runs and ``EVENTS_LAG_S`` after it ends), so a burst of one new prefix follows
its first request instead of spreading over the fleet in the events' lag. Either way the decision's
note says which tier decided and why (``observe``).

What it counts (:class:`KvDecisionStats`, exact: one count per committed decision of a kv_events
model) — the outcome of each decision (``decided``: tier 2 voted; else why tier 1 decided, see
``OUTCOMES``), the leading blocks the chosen replica held, and per replica how many of its
decisions each tier made.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from llmgw.kv.parity import ParityConfig

from .scorers import ScoreContext, Scores
from .types import RequestInfo

__all__ = ["KvCacheScorer", "KvDecisionStats", "LeadingBlocks", "OUTCOMES", "MATCHED_BUCKETS", "RecentSends",
           "fallback_reason"]

# hashes -> {replica id: leading blocks held}
LeadingBlocks = Callable[[Sequence[int]], Mapping[Any, int]]

# llmgw_kv_decisions_total{outcome}: decided — tier 2 voted (a candidate holds the first block);
# then why tier 1 decided: miss (candidates have events, none holds the first block), no_events
# (no candidate has reported a block yet), no_full_block (the prompt is shorter than a block),
# no_index, timeout / tokenize_failed / no_replica (the /tokenize step), version (the engine's vLLM
# release is unknown or hashes otherwise), lora (an adapter's request), unsupported (nothing to tokenize).
OUTCOMES = ("decided", "miss", "no_events", "no_full_block", "no_index", "timeout", "tokenize_failed",
            "no_replica", "version", "lora", "unsupported")
# the /tokenize step's own outcome (RequestInfo.kv_outcome) -> the decision's
_TOKENIZE_OUTCOMES = {"timeout": "timeout", "no_replica": "no_replica", "version": "version",
                      "error": "tokenize_failed", "garbage": "tokenize_failed"}
MATCHED_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
MAX_REPLICAS = 4096  # per-replica tier counts kept (the oldest leave first)
# After a request ends, how long the KV events of the blocks it stored may take to reach the index
# (the engine publishes them as it computes; the agent flushes every 0.1 s; measured ~100–300 ms,
# docs/prefix-routing.md): the parity check's settle time, the same wait.
EVENTS_LAG_S = ParityConfig().settle_s
MAX_SENDS = 65_536  # (replica, first block) pairs remembered; the oldest leave first
MAX_RUNNING_S = 300.0  # a send whose end never came counts as running no longer than this


def fallback_reason(note: str, tokenize_outcome: str = "") -> str:
    """The outcome for a request whose /tokenize step left no hashes: from the step's outcome
    when it says, else from its note (the words llmgw.daemon.router.tokenize writes)."""
    if tokenize_outcome in _TOKENIZE_OUTCOMES:
        return _TOKENIZE_OUTCOMES[tokenize_outcome]
    if "timed out" in note:
        return "timeout"
    if "adapter" in note or "LoRA" in note:
        return "lora"
    if "no replica" in note:
        return "no_replica"
    if "to tokenize" in note:
        return "unsupported"
    return "tokenize_failed"


def _total(req: RequestInfo) -> int:
    """The prompt's full blocks: what a share is of (at least the hashes computed)."""
    return max(req.kv_blocks, len(req.kv_hashes or ()))


@dataclass(slots=True)
class KvDecisionStats:
    outcomes: dict[str, int] = field(default_factory=lambda: {o: 0 for o in OUTCOMES})
    # leading blocks the chosen replica held, for decisions with hashes: non-cumulative counts
    # per MATCHED_BUCKETS bound (the last is +Inf) and their sum
    matched: list[int] = field(default_factory=lambda: [0] * (len(MATCHED_BUCKETS) + 1))
    matched_sum: int = 0
    by_replica: dict[str, list[int]] = field(default_factory=dict)  # chosen -> [tier 1, tier 2] decisions


def _due(e: list[float], now: float) -> bool:
    """A RecentSends entry [running, last sent, until]: are its events still due?"""
    return (e[0] > 0 and now - e[1] < MAX_RUNNING_S) or now < e[2]


class RecentSends:
    """Which replica the router sent which first block it did not hold, until that engine's KV events
    about it may be in: while a request with it runs there, and ``lag_s`` after the last one ended —
    or until the index shows it holding the block (:meth:`confirmed`). Bounded (``MAX_SENDS`` pairs,
    the least recently sent leave first)."""

    def __init__(self, lag_s: float = EVENTS_LAG_S) -> None:
        self.lag_s = lag_s
        self._d: OrderedDict[tuple[str, int], list[float]] = OrderedDict()  # -> [running, last sent, until]

    def sent(self, replica: str, first: int, now: float) -> None:
        key = (replica, first)
        e = self._d.get(key)
        if e is None:
            self._make_room(now)
            self._d[key] = [1, now, 0.0]
        else:
            e[0] += 1
            e[1] = now
            self._d.move_to_end(key)

    def _make_room(self, now: float) -> None:
        """Before an entry is added: the least recently sent ones that settled leave (two at most:
        amortised, the map holds about the sends of the last ``lag_s`` and those running), and the
        oldest when the map is full."""
        d = self._d
        for _ in range(2):
            if not d:
                return
            key, e = next(iter(d.items()))
            if _due(e, now):
                break
            del d[key]
        if len(d) >= MAX_SENDS:
            d.popitem(last=False)

    def confirmed(self, held: Mapping[Any, int], first: int) -> None:
        """The index shows these replicas holding the first block: their events are in, nothing to
        wait for (a clear or an eviction after this counts at once)."""
        d = self._d
        if d:
            for rid, n in held.items():
                if n > 0:
                    d.pop((rid, first), None)

    def heard(self, replica: str, first: int, now: float) -> None:
        """A peer router sent it (its insert says so): due ``lag_s`` from now (its end is not heard)."""
        key = (replica, first)
        e = self._d.get(key)
        if e is None:
            self._make_room(now)
            self._d[key] = [0, now, now + self.lag_s]
        else:
            e[2] = max(e[2], now + self.lag_s)
            self._d.move_to_end(key)

    def ended(self, replica: str, first: int, now: float) -> None:
        e = self._d.get((replica, first))
        if e is not None:
            e[0] = max(0, e[0] - 1)
            e[2] = now + self.lag_s

    def pending(self, replica: str, first: int, now: float) -> bool:
        """Whether the engine's events for this first block may still be on their way."""
        e = self._d.get((replica, first))
        if e is None:
            return False
        if _due(e, now):
            return True
        if e[0] <= 0:
            del self._d[(replica, first)]  # settled: nothing left to wait for
        return False

    def __len__(self) -> int:
        return len(self._d)


class KvCacheScorer:
    """Stateless apart from ``lookup`` (set once the index exists; None = no index), ``alarmed``
    (replica id -> is its parity alarm on: its engine hashes differently), its counts and its
    recent sends (``sends``: :meth:`observe` records them, :meth:`ended` settles them)."""

    def __init__(self, lookup: LeadingBlocks | None = None, alarmed: Callable[[str], bool] | None = None) -> None:
        self.lookup = lookup
        self.alarmed = alarmed
        self.stats = KvDecisionStats()
        self.sends = RecentSends()
        self.awaited = 0  # candidates whose tier-1 belief stood because their events may be on their way
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
        if held:
            self.sends.confirmed(held, hashes[0])
        return held

    def verdict(self, req: RequestInfo, endpoints: Sequence[Any], now: float) -> dict[int, float] | None:
        """Tier 2's shares by candidate index where a candidate's engine holds at least the
        request's first block, else None. Tier 1 then votes these instead of its own guess
        (``PrefixRouting.defer``), so the affinity keeps both tiers' weight."""
        held = self.held(req, now)
        if not held:
            return None
        total = _total(req)
        vals = {i: min(n, total) / total for i, e in enumerate(endpoints) if (n := held.get(e.id, 0)) > 0}
        return vals or None

    def denied(self, req: RequestInfo, endpoints: Sequence[Any], now: float) -> list[int]:
        """The candidates (by index) whose engine publishes KV events — known to the index, its
        parity alarm off, so its events are read right — and holds none of the request's first
        block. Tier 1's belief about them does not count where no candidate holds the first
        block (``PrefixRouting.deny``; where one does, :meth:`verdict` rules). A candidate the
        index has never heard from, or whose hashes never match the router's, keeps tier 1's
        guess: its silence says nothing."""
        held = self.held(req, now)
        if not held:
            return []
        alarmed = self.alarmed
        out = [i for i, e in enumerate(endpoints)
               if held.get(e.id) == 0 and not (alarmed is not None and alarmed(e.id))]
        if out and req.kv_hashes:
            # sent there so lately that its events may not be in yet: its silence says nothing
            first, sends = req.kv_hashes[0], self.sends
            kept = {i for i in out if sends.pending(endpoints[i].id, first, now)}
            if kept:
                self.awaited += len(kept)
                out = [i for i in out if i not in kept]
        return out

    def peer_sent(self, replica: str, first: int, now: float) -> None:
        """Another router (routing as one) sent ``replica`` a request with this first block."""
        self.sends.heard(replica, first, now)

    def ended(self, replica: str, req: RequestInfo, now: float) -> None:
        """A request :meth:`observe` saw sent to ``replica`` ended there (the router core's finish)."""
        if req.kv_hashes:
            self.sends.ended(replica, req.kv_hashes[0], now)

    def __call__(self, ctx: ScoreContext) -> Scores:
        req = ctx.req
        hashes = req.kv_hashes
        held = self.held(req, ctx.now)
        if held is None or hashes is None:
            if hashes is not None or req.kv_note:
                if hashes is None:
                    outcome, why = fallback_reason(req.kv_note, req.kv_outcome), req.kv_note
                elif self.lookup is None:
                    outcome, why = "no_index", "no tier-2 index"
                else:
                    outcome, why = "no_full_block", req.kv_note or "no full block"
                ctx.keep(self, (outcome, f"tier 2 unavailable: {why}; tier 1 decides", None))
            return Scores.constant(0.0)
        total = _total(req)
        vals: dict[int, float] = {}
        best, best_id = 0, ""
        for i, e in enumerate(ctx.endpoints):
            n = held.get(e.id, 0)
            if n > 0:
                vals[i] = min(n, total) / total
                if n > best:
                    best, best_id = n, e.id
        if not vals:
            outcome = "miss" if any(e.id in held for e in ctx.endpoints) else "no_events"
            why = f"tier 2: no candidate holds the first of {total} blocks"
            alarmed = self.alarmed
            if alarmed is not None:
                bad = [e.id for e in ctx.endpoints if alarmed(e.id)]
                if bad:  # the likely reason: those engines' hashes never match the router's
                    shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
                    why += f" (parity alarm on {shown}: its engine hashes differently, see `llmgw ctl kv`)"
            ctx.keep(self, (outcome, f"{why}; tier 1 decides", held))
            return Scores.constant(0.0)
        ctx.keep(self, ("decided", f"tier 2: {min(best, total)}/{total} blocks on {best_id}", held))
        return Scores(vals)

    def observe(self, decision: Any, req: RequestInfo, kept: Any, now: float) -> None:
        chosen = decision.chosen
        held = kept[2] if kept else None
        if req.kv_hashes and chosen is not None and not (held or {}).get(chosen):
            self.sends.sent(chosen, req.kv_hashes[0], now)  # its first block's events are yet to come
        if not kept:
            return
        outcome, text, held = kept
        decision.note = f"{decision.note}; {text}" if decision.note else text
        st = self.stats
        st.outcomes[outcome] += 1
        if held is not None:
            n = min(held.get(chosen, 0), _total(req)) if chosen is not None else 0
            st.matched[bisect_left(MATCHED_BUCKETS, n)] += 1
            st.matched_sum += n
        if chosen is not None:
            row = st.by_replica.get(chosen)
            if row is None:
                if len(st.by_replica) >= MAX_REPLICAS:
                    del st.by_replica[next(iter(st.by_replica))]
                row = st.by_replica[chosen] = [0, 0]
            row[1 if outcome == "decided" else 0] += 1
