"""Tier 2's parity self-check (pure: no I/O, the clock passed in): do the block hashes the router
computes for a request match the ones its engine reports storing?

A router and an engine that hash differently (another ``--prefix-caching-hash-algo``, another or
no ``PYTHONHASHSEED``, another block size, a vLLM release that hashes otherwise) never agree on a
single block: tier 2 then silently never votes. This module catches that within a few requests.

For each request routed with tier-2 hashes, the shell opens a **check** on the replica R that got
it (:meth:`ParityTracker.open`), with the request's leading block hashes, and ends it when the
request ends (:meth:`ParityTracker.end`; a failed attempt drops its check). Every ``kv_events``
message applied for R is shown to the tracker (:meth:`ParityTracker.on_delta`). A check:

* **passes** as soon as one of its expected hashes is in R's index when it opens (a prefix hit:
  nothing new is stored, the blocks must already be there), or is one R already proved to hash
  alike (kept in a bounded per-replica set that survives resets), or shows among R's additions
  while the check is open (an evicted block was still reported when stored);
* **fails** when ``settle_s`` after the request's end none showed although R reported additions
  since the check opened (the engine stored blocks, just not the router's), and no reset of R's
  index came in between (a reset can drop the very events the check waited for);
* is **unknown** when no additions came at all (an idle engine, a stream that stalls, events off),
  when a reset came in between, or when the per-replica table was full and it was the oldest.

A replica's **alarm** goes on after ``alarm_after`` failed checks in a row with no pass between,
and off at the next pass: a healthy engine passes nearly every check, so three failures in a row
mean the hashes differ. :meth:`ParityTracker.take_changes` hands the shell each change to log.

Bounds: at most ``max_checks_per_replica`` open checks per replica (the oldest gives way), each
with at most ``max_expected`` hashes; ``known_per_replica`` proven hashes per replica; totals for
at most ``MAX_SERIES`` replicas (forgotten ones leave first).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["OUTCOMES", "STATUSES", "MAX_SERIES", "ParityConfig", "ParityTracker", "ParityChange",
           "ReplicaParity"]

OUTCOMES = ("pass", "fail", "unknown")
# ok: the last verdict was a pass; suspect: the last was a fail (fewer than alarm_after in a row);
# alarm: alarm_after fails in a row; unchecked: no pass or fail yet.
STATUSES = ("ok", "suspect", "alarm", "unchecked")
MAX_SERIES = 4096

Replica = Hashable
Holds = Callable[[Replica, Hashable], bool]


@dataclass(frozen=True, slots=True)
class ParityConfig:
    settle_s: float = 2.0  # after a request's end, how long its blocks' events may take (agents flush every 0.1 s)
    max_checks_per_replica: int = 256
    max_expected: int = 16  # leading hashes a check keeps
    alarm_after: int = 3  # failed checks in a row that raise the alarm
    known_per_replica: int = 1024  # hashes a replica proved to hash alike, kept across resets

    def __post_init__(self) -> None:
        if not (self.settle_s > 0 and self.max_checks_per_replica >= 1 and self.max_expected >= 1
                and self.alarm_after >= 1 and self.known_per_replica >= 1):
            raise ValueError("bad ParityConfig")


@dataclass(frozen=True, slots=True)
class ParityChange:
    """A replica's alarm went on or off (for the shell's log line)."""

    replica: Replica
    model: str
    on: bool
    failed_in_row: int
    forgotten: bool = False  # off because the replica's index was dropped, not because a check passed


class _Check:
    __slots__ = ("id", "replica", "expected", "ended_at", "adds_at_open", "resets_at_open")

    def __init__(self, cid: int, replica: Replica, expected: tuple[Hashable, ...], adds: int, resets: int) -> None:
        self.id = cid
        self.replica = replica
        self.expected = expected
        self.ended_at: float | None = None  # None while the request runs
        self.adds_at_open = adds
        self.resets_at_open = resets


@dataclass(slots=True)
class ReplicaParity:
    """One replica's checks and verdicts (the counters are exact and only grow)."""

    model: str
    passed: int = 0
    failed: int = 0
    unknown: int = 0
    fails_in_row: int = 0
    alarm: bool = False
    last: str = ""  # the last pass/fail verdict
    forgotten: bool = False  # the replica left: its totals stay for the counters
    open: dict[int, _Check] = field(default_factory=dict)  # oldest first
    by_hash: dict[Hashable, set[int]] = field(default_factory=dict)  # expected hash -> open checks
    known: OrderedDict[Hashable, None] = field(default_factory=OrderedDict)
    adds: int = 0  # messages with additions so far
    resets: int = 0  # resets of its index so far

    @property
    def status(self) -> str:
        if self.alarm:
            return "alarm"
        return {"pass": "ok", "fail": "suspect"}.get(self.last, "unchecked")

    @property
    def mismatch_rate(self) -> float | None:
        """Failed / decided checks (None before any verdict)."""
        n = self.passed + self.failed
        return self.failed / n if n else None


class ParityTracker:
    def __init__(self, config: ParityConfig | None = None, holds: Holds | None = None) -> None:
        self.config = config or ParityConfig()
        self.holds = holds  # (replica, hash) -> is it in the replica's index now
        self.replicas: dict[Replica, ReplicaParity] = {}
        self._checks: dict[int, _Check] = {}  # every open check by id
        self._ended: deque[_Check] = deque()  # ended checks, by end time
        self._next_id = 1
        self._changes: list[ParityChange] = []

    # ---------------------------------------------------------------- the request path
    def open(self, replica: Replica, model: str, hashes: Sequence[Hashable], now: float) -> int | None:
        """A request with these block hashes went to `replica`: a check id to end, or None when the
        check is decided at once (a pass) or there is nothing to check."""
        if not hashes:
            return None
        cfg = self.config
        rp = self._replica(replica, model)
        expected = tuple(hashes[:cfg.max_expected])
        holds = self.holds
        for h in expected:
            if h in rp.known or (holds is not None and holds(replica, h)):
                self._verdict(replica, rp, "pass", proven=h)
                return None
        if len(rp.open) >= cfg.max_checks_per_replica:
            self._close(rp, next(iter(rp.open.values())))
            self._count(replica, rp, "unknown")
        cid = self._next_id
        self._next_id += 1
        c = _Check(cid, replica, expected, rp.adds, rp.resets)
        rp.open[cid] = c
        self._checks[cid] = c
        for h in expected:
            s = rp.by_hash.get(h)
            if s is None:
                rp.by_hash[h] = {cid}
            else:
                s.add(cid)
        return cid

    def end(self, cid: int | None, now: float, *, ok: bool) -> None:
        """The request ended (``ok``: its answer went out whole); a failed one's check is dropped."""
        c = self._checks.get(cid) if cid is not None else None
        if c is None or c.ended_at is not None:
            return
        rp = self.replicas[c.replica]
        if not ok:
            self._close(rp, c)
            return
        c.ended_at = now
        self._ended.append(c)
        self.tick(now)

    # ---------------------------------------------------------------- what the engine reports
    def on_delta(self, replica: Replica, added: Sequence[tuple[Any, Hashable]], *, reset: bool,
                 now: float) -> None:
        """A kv_events message was applied for `replica` (``added``: the blocks it added, as
        ``(medium, hash)`` pairs). Costs one dict lookup per added block while checks are open."""
        rp = self.replicas.get(replica)
        if rp is None or rp.forgotten:
            return
        if reset:
            rp.resets += 1
        by_hash = rp.by_hash
        if by_hash:
            for _, h in added:
                ids = by_hash.get(h)
                if ids:
                    for cid in list(ids):
                        c = rp.open.get(cid)
                        if c is not None:
                            self._close(rp, c)
                            self._verdict(replica, rp, "pass", proven=h)
                    if not by_hash:
                        break
        if added:
            rp.adds += 1
        self.tick(now)

    def tick(self, now: float) -> None:
        """Decide the checks whose settle time is over."""
        settle = self.config.settle_s
        ended = self._ended
        while ended and ended[0].ended_at + settle <= now:  # type: ignore[operator]
            c = ended.popleft()
            if self._checks.get(c.id) is not c:
                continue  # decided already
            rp = self.replicas[c.replica]
            self._close(rp, c)
            fail = rp.adds > c.adds_at_open and rp.resets == c.resets_at_open
            self._verdict(c.replica, rp, "fail" if fail else "unknown")

    def forget(self, replica: Replica) -> None:
        """The replica's index is gone (it left routing, its engine restarted or its agent's stream
        ended): its open checks are dropped, its proof and alarm forgotten; its totals stay."""
        rp = self.replicas.get(replica)
        if rp is None:
            return
        for c in list(rp.open.values()):
            self._close(rp, c)
        if rp.alarm:
            self._changes.append(ParityChange(replica, rp.model, False, rp.fails_in_row, forgotten=True))
        rp.known.clear()
        rp.alarm, rp.fails_in_row, rp.last, rp.forgotten = False, 0, "", True

    def take_changes(self) -> list[ParityChange]:
        out, self._changes = self._changes, []
        return out

    def totals_by_model(self) -> dict[str, tuple[int, int, int]]:
        """model -> (passed, failed, unknown) over every replica it had."""
        out: dict[str, tuple[int, int, int]] = {}
        for rp in self.replicas.values():
            p, f, u = out.get(rp.model, (0, 0, 0))
            out[rp.model] = (p + rp.passed, f + rp.failed, u + rp.unknown)
        return out

    # ---------------------------------------------------------------- inside
    def _replica(self, replica: Replica, model: str) -> ReplicaParity:
        rp = self.replicas.get(replica)
        if rp is None:
            if len(self.replicas) >= MAX_SERIES:
                gone = next((k for k, v in self.replicas.items() if v.forgotten), None)
                if gone is not None:
                    del self.replicas[gone]
            rp = self.replicas[replica] = ReplicaParity(model)
        elif rp.forgotten:
            rp.forgotten = False
            rp.adds = rp.resets = 0
        rp.model = model
        return rp

    def _close(self, rp: ReplicaParity, c: _Check) -> None:
        rp.open.pop(c.id, None)
        self._checks.pop(c.id, None)
        for h in c.expected:
            s = rp.by_hash.get(h)
            if s is not None:
                s.discard(c.id)
                if not s:
                    del rp.by_hash[h]

    def _count(self, replica: Replica, rp: ReplicaParity, outcome: str) -> None:
        if outcome == "pass":
            rp.passed += 1
        elif outcome == "fail":
            rp.failed += 1
        else:
            rp.unknown += 1

    def _verdict(self, replica: Replica, rp: ReplicaParity, outcome: str,
                 proven: Hashable | None = None) -> None:
        self._count(replica, rp, outcome)
        if outcome == "unknown":
            return
        rp.last = outcome
        if outcome == "pass":
            if proven is not None:
                known = rp.known
                known[proven] = None
                known.move_to_end(proven)
                if len(known) > self.config.known_per_replica:
                    known.popitem(last=False)
            if rp.alarm:
                self._changes.append(ParityChange(replica, rp.model, False, rp.fails_in_row))
            rp.alarm, rp.fails_in_row = False, 0
            return
        rp.fails_in_row += 1
        if not rp.alarm and rp.fails_in_row >= self.config.alarm_after:
            rp.alarm = True
            self._changes.append(ParityChange(replica, rp.model, True, rp.fails_in_row))
