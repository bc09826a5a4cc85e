"""When each replica's /metrics is read next: every round while anything happens on it, less
often while it is idle.

Pure (times are passed in). The scrape loop runs a round every ``interval`` (earlier when a
request waits: ``scrape_soon``) and reads in it the replicas that are due:

- a replica is due every round while it is busy: requests of this router in flight on it, or
  finished since its last reading (``completed`` moved), and after any reading that was not
  quiet;
- a *quiet* reading (the caller decides: nothing the contract reads has moved, the engine runs
  and queues nothing, none of our requests went there, no error) doubles the gap to the next
  one, up to ``idle_max``; any other reading, a failed one included, returns it to ``interval``;
- ``hurry()`` (a request waits for room: scrape_soon) makes every replica due now and returns
  each to ``interval``.

``idle_max`` is ``interval × idle_factor``, but never more than ``stale_after − 2 × interval``
(nor less than ``interval``), in whole intervals: an idle replica's reading is at most
``idle_max + ¾ interval`` old when the next one lands (it is due a quarter interval early, and
the round that reads it starts at most an interval after the last one that did not), which
leaves more than an interval for a slow round (another replica's read that takes its timeout)
before ``stale_after``. Slowing down never makes a healthy idle replica look stale — and a
reading that does go stale (the engine stopped answering) is marked so as before."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["ScrapePace", "idle_max"]


def idle_max(interval: float, idle_factor: float, stale_after: float) -> float:
    """The longest gap between two readings of an idle replica (see the module docstring), in
    whole rounds: a replica is read in a round or not, so a factor of 2.5 reads it every 2."""
    rounds = min(idle_factor, (stale_after - 2 * interval) / interval)
    return interval * max(1, math.floor(rounds + 1e-9))


@dataclass(slots=True)
class _Pace:
    gap: float  # from the last reading to the next one
    next_at: float
    completed: int  # the replica's finished-request count at the last reading
    models_at: float  # when /v1/models (with /slots, /lora-adapters) was last asked for


class ScrapePace:
    """Per replica (by id): when it is next due, and when its slow answers are next due."""

    def __init__(self, interval: float, idle_factor: float, stale_after: float, models_every: int = 10) -> None:
        self.interval = interval
        self.idle_max = idle_max(interval, idle_factor, stale_after)
        self.models_every = models_every * interval  # the slow round: /v1/models, /slots, /lora-adapters
        self._early = interval / 4
        self._by_id: dict[str, _Pace] = {}

    def due(self, rid: str, now: float, inflight: int, completed: int) -> bool:
        """Is the replica read in the round starting ``now``?"""
        p = self._by_id.get(rid)
        return p is None or inflight > 0 or completed != p.completed or now >= p.next_at - self._early

    def models_due(self, rid: str, now: float) -> bool:
        """Is the round starting ``now`` also its slow one (its adapters and slots are asked again)?
        Asking counts: the next slow one is ``models_every`` intervals later."""
        p = self._by_id.get(rid)
        if p is not None and now < p.models_at + self.models_every - self._early:
            return False
        if p is None:
            p = self._by_id[rid] = _Pace(self.interval, now, -1, now)
        p.models_at = now
        return True

    def read(self, rid: str, now: float, *, quiet: bool, completed: int) -> float:
        """A reading (or a failed one: not quiet) finished at ``now``; the gap to the next one."""
        p = self._by_id.get(rid)
        if p is None:
            p = self._by_id[rid] = _Pace(self.interval, now, completed, float("-inf"))
        p.gap = min(p.gap * 2, self.idle_max) if quiet else self.interval
        p.next_at, p.completed = now + p.gap, completed
        return p.gap

    def gap(self, rid: str) -> float:
        p = self._by_id.get(rid)
        return self.interval if p is None else p.gap

    def hurry(self) -> None:
        """Every replica due now, back to the normal cadence (requests wait for room)."""
        for p in self._by_id.values():
            p.gap, p.next_at = self.interval, float("-inf")

    def keep(self, ids: set[str] | dict[str, object]) -> None:
        """Forget the replicas not in ``ids`` (they left)."""
        for rid in [r for r in self._by_id if r not in ids]:
            del self._by_id[rid]
