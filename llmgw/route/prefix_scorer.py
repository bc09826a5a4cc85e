"""The ``prefix`` scorer: cache-aware routing, tier 1, over :class:`~.prefix_tree.PrefixIndex`.

A candidate scores the fraction of the request head it holds (0..1), scaled by how often it was
sent that prefix relative to the best holder (``count_weight``: a holder seen once scores less
than one seen fifty times, so a randomising picker does not make the preference flip). It is a
SCORER, not a filter: the value is one vote in the strategy's weighted sum, so queue, load or
inflight can outvote it, and nobody is ever dropped for lacking the prefix.

Load protection, selectable by ``PrefixScorerConfig.guard`` (the lead benchmarks both):

``"imbalance"``  a holder loses its affinity for this request when its load estimate exceeds the
    least loaded candidate's by BOTH ``abs_gap`` requests AND a factor ``rel_gap``. Absolute alone
    misfires on a busy fleet (108 vs 100 is balanced); relative alone on an idle one (3 vs 0 is
    "infinitely" unbalanced and harmless). The chosen replica is recorded as usual (count + 1).
``"spill"``  a per-request gate against the fleet mean: a holder whose load exceeds
    ``spill_factor`` × the candidates' mean load + ``spill_slack`` loses its affinity; when the
    request then lands on a non-holder, that target is recorded as an EXTRA holder carrying the
    count of the holder it relieved, so the hot prefix is now replicated and later requests split
    between the two by load rather than snapping back to the original.
``"none"``  affinity is never withdrawn (the load scorers alone counterweigh it).

The router holds a :class:`PrefixRouting`, which is itself the ``prefix`` scorer and a stateful
one (:class:`~.scorers.Observer`): it reads the head and cache_salt from the request
(``RequestInfo.head``, ``.cache_salt``), and the scheduler calls its ``observe`` once per
committed decision, whatever the strategy's prefix weight. ``observe`` records the replica the
picker ACTUALLY chose (never the one the scorer proposed), classifies the decision (hit / miss /
guarded / spilled: ``Decision.prefix``) and appends a one-line rationale to ``decision.note``.
Each holder among the recorded candidates also carries a flag with its matched length and
count. A request with no head (embeddings) is neither scored nor recorded.
The shell also calls ``set_capacity`` per replica (from ``vllm:cache_config_info`` or
llama.cpp's ``-np``) and ``remove_replica`` when one leaves; ``metrics()`` and
``zero_hit_alarm(now)`` feed the exporter.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from hashlib import blake2b
from typing import Any, cast

from .prefix_capacity import Capacity, Partition, PrefixConfig, partition_key
from .prefix_share import PrefixInsert, PrefixOutbox
from .prefix_tree import Match, PrefixIndex
from .scorers import ScoreContext, Scorer, Scores
from .types import Decision, EndpointView, RequestInfo

__all__ = [
    "PrefixScorerConfig", "PrefixRouting", "PrefixOutcome", "ZeroHitAlarm", "OUTCOMES",
    "MATCH_BUCKETS", "GUARDS",
]

OUTCOMES = ("hit", "miss", "guarded", "spilled")
GUARDS = ("imbalance", "spill", "none")
# matched bytes of the chosen replica (0 = a miss); ~4 bytes a token, vLLM blocks are 16 tokens
MATCH_BUCKETS = (0, 64, 256, 1024, 4096, 16384, 65536, 262144)


@dataclass(frozen=True, slots=True)
class PrefixScorerConfig:
    guard: str = "spill"  # "imbalance" | "spill" | "none"
    abs_gap: float = 8.0  # imbalance: holder load - min load must exceed this (requests) ...
    rel_gap: float = 1.5  # ... AND holder load must exceed rel_gap × min load
    spill_factor: float = 1.5  # spill: holder load > spill_factor × mean load + spill_slack
    spill_slack: float = 4.0
    cold_room: float = 0.25  # a cold head's score toward the least-filled cache (0 = off)
    min_match_bytes: int = 64  # less than a vLLM block (16 tokens ≈ 64 B) saves nothing
    count_weight: float = 0.5  # 0: any holder scores its fraction; 1: ∝ count / best count
    name: str = "prefix"  # the scorer's name in strategies

    def __post_init__(self) -> None:
        if self.guard not in GUARDS:
            raise ValueError(f"guard must be one of {', '.join(GUARDS)}, got {self.guard!r}")
        if not (self.abs_gap >= 0 and self.rel_gap >= 1):
            raise ValueError("abs_gap must be >= 0 and rel_gap >= 1")
        if not (self.spill_factor >= 1 and self.spill_slack >= 0):
            raise ValueError("spill_factor must be >= 1 and spill_slack >= 0")
        if self.min_match_bytes < 0 or not 0 <= self.count_weight <= 1:
            raise ValueError("min_match_bytes must be >= 0 and count_weight in [0, 1]")


@dataclass(slots=True)
class PrefixOutcome:
    outcome: str  # one of OUTCOMES, or "none" when nothing was chosen
    matched_bytes: int  # of the head, on the chosen replica
    head_bytes: int
    holders: int  # replicas holding at least min_match_bytes of the head
    note: str


@dataclass(slots=True)
class _Pending:
    partition: Partition
    head: bytes
    match: Match | None = None
    gated: dict[str, int] = field(default_factory=dict)  # holder withdrawn -> its count
    live: int = 0  # candidate holders that kept their affinity
    cands: int = -1  # candidates holding the prefix (-1: not scored)
    deferred: bool = False  # tier 2 knew who holds the prefix: this scorer voted its shares
    set_aside: tuple[str, ...] = ()  # holders whose engines' events say they hold no first block


class ZeroHitAlarm:
    """True when, over the last ``window_s``, at least ``min_requests`` requests were routed, at
    least ``min_shared`` of them share a head prefix (their first ``probe_bytes`` were seen
    before within the window) and NOT ONE was a prefix hit: the index is not doing its job
    (records going nowhere, a head rendering that changes per request, a partition key that
    never repeats...). Sharing is judged by its own probe, independent of the tree."""

    def __init__(self, window_s: float = 60.0, *, min_requests: int = 50,
                 min_shared: float = 0.2, probe_bytes: int = 256, buckets: int = 12,
                 max_probes: int = 8192) -> None:
        if not (window_s > 0 and min_requests >= 1 and 0 < min_shared <= 1 and buckets >= 1):
            raise ValueError("bad ZeroHitAlarm settings")
        self.window_s = window_s
        self.min_requests = min_requests
        self.min_shared = min_shared
        self.probe_bytes = probe_bytes
        self._width = window_s / buckets
        self._buckets: deque[list[float]] = deque()  # [start, requests, shared, hits]
        self._probes: OrderedDict[bytes, float] = OrderedDict()
        self._max_probes = max_probes
        self._first: float | None = None

    def observe(self, now: float, partition: Partition, head: bytes, hit: bool) -> None:
        if self._first is None:
            self._first = now
        probe = blake2b(repr(partition).encode() + b"\0" + head[: self.probe_bytes],
                        digest_size=12).digest()
        seen = self._probes.get(probe)
        shared = seen is not None and now - seen <= self.window_s
        self._probes[probe] = now
        self._probes.move_to_end(probe)
        if len(self._probes) > self._max_probes:
            self._probes.popitem(last=False)
        b = self._buckets
        if not b or now >= b[-1][0] + self._width:
            b.append([now, 0, 0, 0])
        cur = b[-1]
        cur[1] += 1
        cur[2] += shared
        cur[3] += hit
        self._trim(now)

    def _trim(self, now: float) -> None:
        b = self._buckets
        while b and b[0][0] + self._width <= now - self.window_s:
            b.popleft()

    def window(self, now: float) -> tuple[int, int, int]:
        """(requests, sharing requests, hits) in the window ending at ``now``."""
        self._trim(now)
        return (int(sum(x[1] for x in self._buckets)), int(sum(x[2] for x in self._buckets)),
                int(sum(x[3] for x in self._buckets)))

    def check(self, now: float) -> bool:
        if self._first is None or now - self._first < self.window_s:
            return False  # not watched for a whole window yet
        n, shared, hits = self.window(now)
        return n >= self.min_requests and shared >= self.min_shared * n and hits == 0


class PrefixRouting:
    """The index, the ``prefix`` scorer (this object: call it with a ScoreContext), its
    ``observe`` hook, and the metrics."""

    def __init__(self, index: PrefixIndex | PrefixConfig | None = None,
                 config: PrefixScorerConfig | None = None, *,
                 alarm: ZeroHitAlarm | None = None) -> None:
        self.index = index if isinstance(index, PrefixIndex) else PrefixIndex(index)
        self.config = config or PrefixScorerConfig()
        self.alarm = alarm or ZeroHitAlarm()
        self.last: PrefixOutcome | None = None  # the last observed decision's (for tests, tools)
        self._pos_last: tuple[list[EndpointView], dict[str, int]] | None = None
        self.outcomes = dict.fromkeys(OUTCOMES, 0)
        self.outvoted = 0  # misses where a candidate held the prefix (load won the vote)
        self.scored = 0
        self._buckets = [0] * (len(MATCH_BUCKETS) + 1)  # last = +Inf
        self._matched_sum = 0
        # Tier 2's verdict where the engines' own events name a holder of this request's first
        # block: its shares by candidate index (the router core wires the kv_cache scorer's
        # here). Then this scorer's own guess counts only for candidates the engines confirm,
        # and tier 2's shares for the rest: what the router sent where goes stale behind its
        # back (a holder evicted the prefix, restarted) and must not outvote what an engine
        # reports, while voting the engines' view with this weight too keeps a conversation as
        # sticky as when both tiers agree.
        self.defer: Callable[[RequestInfo, Sequence[EndpointView], float], dict[int, float] | None] | None = None
        self.deferred = 0
        # Where no engine holds the first block (no verdict): the candidates whose engines
        # publish KV events and say they hold none of it, by index. This scorer's guess about
        # them does not count — an engine-side clear (vLLM's reset_prefix_cache) or eviction
        # leaves it believing what the engine reports is gone (docs/prefix-routing.md).
        self.deny: Callable[[RequestInfo, Sequence[EndpointView], float], Sequence[int]] | None = None
        self.set_aside = 0  # decisions where such a belief was set aside
        # A peer router sent `replica` a request whose tier-2 first block is this (its insert says
        # so): that engine's events about it are due here too (the kv_cache scorer's ``peer_sent``).
        self.peer_sent: Callable[[str, int, float], None] | None = None
        # Routing as one (several routers): each decision's insert is kept here for the shell to
        # send to the other routers (None: not shared). :mod:`.prefix_share`.
        self.share: PrefixOutbox | None = None

    # -- wiring ---------------------------------------------------------------------------------
    @property
    def scorer(self) -> Scorer:
        return self

    def scorers(self) -> dict[str, Scorer]:
        """For ``Scheduler(scorers=routing.scorers())``."""
        return {self.config.name: self}

    def set_capacity(self, replica: str, capacity: Capacity) -> None:
        self.index.set_capacity(replica, capacity)

    def held_bytes(self, req: RequestInfo, now: float) -> dict[str, int]:
        """Replica -> the bytes of ``req``'s head the router sent it (at least ``min_match_bytes``):
        tier 1's belief of what each engine has cached of the prompt. Read-only."""
        if not req.head:
            return {}
        m = self.index.match(self.partition(req, req.cache_salt), req.head, now,
                             min_bytes=self.config.min_match_bytes)
        return {r: mb for r, (mb, _c) in m.holders.items()}

    def remove_replica(self, replica: str) -> None:
        self.index.remove_replica(replica)

    @staticmethod
    def partition(req: RequestInfo, cache_salt: str | None = None) -> Partition:
        return partition_key(req.base_model, req.adapter, cache_salt)

    # -- the scorer -----------------------------------------------------------------------------
    def _positions(self, eps: Sequence[EndpointView]) -> dict[str, int]:
        last = self._pos_last
        if last is not None and last[0] == eps:  # the same view objects: an identity scan
            return last[1]
        pos = {e.id: i for i, e in enumerate(eps)}
        self._pos_last = (list(eps), pos)
        return pos

    def __call__(self, ctx: ScoreContext) -> Scores:
        req = ctx.req
        eps = ctx.endpoints
        if not req.head or not eps:
            return Scores.constant(0.0)
        p = _Pending(self.partition(req, req.cache_salt), req.head)
        ctx.keep(self, p)
        cfg = self.config
        least = cfg.min_match_bytes
        m = self.index.match(p.partition, p.head, ctx.now, min_bytes=least)
        p.match = m
        p.gated = {}
        p.live = 0
        p.cands = 0
        self.scored += 1
        verdict = self.defer(req, eps, ctx.now) if self.defer is not None else None
        if verdict is not None:
            p.deferred = True
            self.deferred += 1
        if not m.holders:
            return Scores(verdict) if verdict is not None else self._cold(eps)
        pos = self._positions(eps)
        get = pos.get
        held = [(i, r, mb, c) for r, (mb, c) in m.holders.items() if (i := get(r)) is not None]
        p.cands = len(held)
        if not held:
            return Scores(verdict) if verdict is not None else self._cold(eps)
        # Both gates reduce to one load threshold per decision: imbalance withdraws a holder
        # when load - least > abs_gap AND load > rel_gap × least, i.e. load > max(least +
        # abs_gap, rel_gap × least); spill when load > spill_factor × mean + spill_slack.
        guard = cfg.guard
        live = held
        why = ""
        if guard != "none":
            loads = ctx.loads
            if guard == "imbalance":
                lo = min(loads)
                limit = max(lo + cfg.abs_gap, cfg.rel_gap * lo)
                why = (f"prefix guarded: load {{:g}} vs least {lo:g} "
                       f"(gap > {cfg.abs_gap:g} and > {cfg.rel_gap:g}×)")
            else:
                mean = sum(loads) / len(loads)
                limit = cfg.spill_factor * mean + cfg.spill_slack
                why = (f"prefix spilled: load {{:g}} > {cfg.spill_factor:g}×mean {mean:g} "
                       f"+ {cfg.spill_slack:g}")
            live = [h for h in held if loads[h[0]] <= limit]
            if len(live) < len(held):
                p.gated = {h[1]: h[3] for h in held if loads[h[0]] > limit}
        p.live = len(live)
        inv = 1.0 / m.head_bytes
        vals: dict[int, float] = {}
        if live:
            w = cfg.count_weight
            base = 1.0 - w
            k = w / max([h[3] for h in live])
            vals = {i: mb * inv * (base + k * c) for i, _r, mb, c in live}
        # remarks for the decision: only the best few candidates are recorded, so only the
        # best few holders are worth a flag
        keep = ctx.cfg.record_candidates
        shown = held if len(held) <= keep else heapq.nlargest(keep, held, key=lambda h: h[2])
        n = m.head_bytes
        gated = p.gated
        for i, r, mb, c in shown:
            if r in gated:
                ctx.flag(i, why.format(ctx.loads[i]))
            else:
                ctx.flag(i, f"prefix {mb}/{n} B held, sent {c}×")
        if verdict is not None:
            # this guess stands only where the engine confirms it holds the prefix's first
            # block (it may know of a turn whose events are still on their way); elsewhere
            # the engines' shares
            vals = {i: max(v, vals.get(i, 0.0)) for i, v in verdict.items()}
        elif self.deny is not None:
            denied = set(self.deny(req, eps, ctx.now))
            aside = [(i, r) for i, r, _mb, _c in held if i in denied]
            if aside:
                # their engines report none of the prompt: the belief is stale (a cleared or
                # evicted cache), and it must not draw the request to a cold replica
                p.set_aside = tuple(r for _, r in aside)
                self.set_aside += 1
                for i, _r in aside:
                    vals.pop(i, None)
                    ctx.flag(i, "tier 1's belief set aside: its engine's KV events show no first block")
        return Scores(vals) if vals else Scores.constant(0.0)

    def _cold(self, eps: Sequence[EndpointView]) -> Scores:
        """No candidate holds this head: nudge it toward the replica whose cache the index fills
        least, so new prefixes (tenants, conversations) spread the working set evenly over the
        caches instead of wherever an idle fleet's tie happens to fall. Small (``cold_room``):
        any real load difference still decides."""
        room = self.config.cold_room
        if room <= 0:
            return Scores.constant(0.0)
        held = [self.index.held_bytes(e.id) for e in eps]
        hi = max(held)
        if hi <= 0:
            return Scores.constant(0.0)
        return Scores(held, -room / hi, room)

    # -- after the pick -------------------------------------------------------------------------
    def observe(self, decision: Decision, req: RequestInfo, kept: _Pending | None, now: float) -> None:
        """The scheduler's hook, once per committed decision: record that ``decision.chosen`` —
        the replica the picker actually chose — was sent the head, classify the decision
        (``decision.prefix``) and append the prefix rationale to its note."""
        if not req.head:
            return
        p = kept if kept is not None else _Pending(self.partition(req, req.cache_salt), req.head)
        out = self._classify(p, decision.chosen, now, req.kv_hashes[0] if req.kv_hashes else None)
        self.last = out
        if decision.chosen is None:
            return
        decision.prefix = out.outcome
        decision.note = f"{decision.note}; {out.note}" if decision.note else out.note

    def _classify(self, p: _Pending, chosen: str | None, now: float, first: int | None) -> PrefixOutcome:
        cfg = self.config
        m = p.match
        if m is None:  # not scored (the strategy gives prefix no weight): look now
            m = self.index.match(p.partition, p.head, now, min_bytes=cfg.min_match_bytes)
        least = cfg.min_match_bytes
        holders = {r: v for r, v in m.holders.items() if v[0] >= least and v[0] > 0}
        if chosen is None:
            return PrefixOutcome("none", 0, m.head_bytes, len(holders), "prefix: nothing chosen")
        mine = holders.get(chosen)
        got = mine[0] if mine is not None else 0
        if mine is not None:
            outcome = "hit"
        elif p.gated and not p.live:  # the gate withdrew every holder's affinity
            outcome = "spilled" if cfg.guard == "spill" else "guarded"
        else:
            outcome = "miss"
            outvoted = p.live > 0 if p.cands >= 0 else bool(holders)
            if outvoted:
                self.outvoted += 1
        count = 1
        if outcome == "spilled":  # an extra holder with the standing of the one it relieves
            count = max(1, max(p.gated.values()))
        self.index.record(p.partition, p.head, chosen, now, count=count)
        if self.share is not None:
            model, adapter, salt = cast("tuple[str, str | None, str | None]", p.partition)  # partition_key's
            mx = self.index.config.max_head_bytes  # what the tree keeps of it: the rest is not sent
            head = p.head if len(p.head) <= mx else p.head[:mx]
            self.share.offer(PrefixInsert(model, adapter, salt, chosen, head, count, first))
        self.outcomes[outcome] += 1
        self._observe_length(got)
        self.alarm.observe(now, p.partition, p.head, outcome == "hit")
        n = m.head_bytes
        if outcome == "hit":
            note = f"prefix hit {got}/{n} B on {chosen} ({len(holders)} holder(s))"
        elif outcome == "miss":
            if not holders:
                note = f"prefix miss: {n} B head, cold"
            else:
                best = max(v[0] for v in holders.values())
                note = (f"prefix miss: {len(holders)} holder(s), best {best}/{n} B, "
                        + ("outvoted" if outvoted else "none among the candidates"))
        else:
            note = (f"prefix {outcome}: {', '.join(sorted(p.gated))} over the load gate, "
                    f"{chosen} recorded" + (f" as extra holder (count {count})"
                                            if outcome == "spilled" else ""))
        if p.deferred:
            note += " (tier 1 voted where tier 2 confirms)"
        if p.set_aside:
            note += f" (tier 1 set aside on {', '.join(p.set_aside)}: its engine's KV events show no first block)"
        return PrefixOutcome(outcome, got, n, len(holders), note)

    def _observe_length(self, got: int) -> None:
        b = self._buckets
        for k, le in enumerate(MATCH_BUCKETS):
            if got <= le:
                b[k] += 1
                break
        else:
            b[-1] += 1
        self._matched_sum += got

    def apply_peer(self, ins: PrefixInsert, now: float) -> None:
        """Another router's decision (:mod:`.prefix_share`): recorded as this router's own
        would be — the tree's path, the holder's count (clamped to ``1..max_count``), the
        capacity model — but not classified or counted as a decision here, nor shared again."""
        count = min(max(int(ins.count), 1), self.index.config.max_count)
        self.index.record(partition_key(ins.model, ins.adapter, ins.salt), ins.head, ins.replica,
                          now, count=count)
        if ins.first_block is not None and self.peer_sent is not None:
            self.peer_sent(ins.replica, ins.first_block, now)  # its engine's events are due here too

    # -- metrics --------------------------------------------------------------------------------
    def metrics(self) -> dict[str, Any]:
        """Decisions by outcome, the chosen replica's matched length as cumulative histogram
        buckets (Prometheus style, upper bound in bytes -> count), and the tree's size."""
        cum: list[tuple[float, int]] = []
        acc = 0
        for le, c in zip([*MATCH_BUCKETS, float("inf")], self._buckets):
            acc += c
            cum.append((le, acc))
        return {
            "decisions": dict(self.outcomes), "outvoted": self.outvoted, "scored": self.scored,
            "matched_bytes": {"buckets": cum, "sum": self._matched_sum, "count": acc},
            "tree": self.index.stats(),
        }

    def zero_hit_alarm(self, now: float) -> bool:
        return self.alarm.check(now)


def routing_from(settings: Mapping[str, Any] | None = None) -> PrefixRouting:
    """A PrefixRouting from a flat settings mapping (config file): keys of PrefixConfig
    (budget_bytes, max_head_bytes, max_count, ttl_s, default_capacity_bytes) and of
    PrefixScorerConfig (guard, abs_gap, rel_gap, spill_factor, spill_slack, min_match_bytes,
    count_weight)."""
    s = dict(settings or {})
    tree_keys = {"budget_bytes", "max_head_bytes", "max_count", "ttl_s"}
    tree = {k: s.pop(k) for k in list(s) if k in tree_keys}
    cap = s.pop("default_capacity_bytes", None)
    if cap is not None:
        tree["default_capacity"] = Capacity(bytes=int(cap))
    return PrefixRouting(PrefixConfig(**tree), PrefixScorerConfig(**s))
