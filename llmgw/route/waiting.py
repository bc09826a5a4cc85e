"""The models' wait queues, and when a waiter may go (pure): a request waits while every live
replica of its model is saturated (RouterCore.next, admission), and is let through as room comes
back — a request ended, a replica came or its breaker closed, a scrape showed room. Counting the
ones that give up, and their 429, stays with the core (RouterCore.left_queue)."""

from __future__ import annotations

from .admission import Ticket, WaitQueue
from .filters import is_saturated, room
from .plan import Plan
from .replicas import ModelEntry, Replica, ReplicaTable
from .types import SchedulerConfig

__all__ = ["WaitRoom"]


class WaitRoom:
    def __init__(self, queue_size: int, config: SchedulerConfig, table: ReplicaTable) -> None:
        self.queue_size = queue_size
        self.config = config
        self.table = table
        self.queues: dict[str, WaitQueue] = {}

    def queue(self, entry: ModelEntry) -> WaitQueue:
        q = self.queues.get(entry.name)
        if q is None:
            q = self.queues[entry.name] = WaitQueue(self.queue_size)
        return q

    def saturated(self, entry: ModelEntry, now: float) -> bool:
        # Replicas behind an open breaker don't count: waiting cannot help them, and the
        # scheduler's all-open fallback handles a model with none available.
        # Draining replicas take no new requests, so their room does not count either. Each
        # view's staleness is refreshed first: the last decision set it, and a scrape since may
        # have made the engine's gauges usable (a stale view counts only our own inflight).
        cfg = self.config
        table = self.table
        live = [r for r in entry.replicas if not r.draining and r.breaker.can_pass(now)]
        for r in live:
            r.view.stale = table.is_stale(r, now)
        return bool(live) and all(is_saturated(r.view, cfg) for r in live)

    def turn_passed(self, plan: Plan, now: float) -> list[Ticket]:
        """The request stops waiting just as it was let through: the room it was woken for
        passes to the next waiter."""
        t = plan.ticket
        if t is None or t in self.queue(plan.entry):
            return []
        return self.freed(plan.model, now)

    def freed(self, model: str, now: float | None = None, *, everyone: bool = False) -> list[Ticket]:
        """Tickets that may proceed now that a request on ``model`` ended (or a replica came, or
        a breaker closed: ``everyone``). Saturation is judged as at admission (:meth:`saturated`:
        live replicas, staleness refreshed), so a waiter is never kept by a reading admission
        would not trust."""
        q = self.queues.get(model)
        if not q:
            return []
        entry = self.table.models.get(model)
        if entry is None or everyone or now is None:
            return q.on_capacity(len(q))  # the model is gone, or a replica is back: all may try
        # one finished request frees room for one waiter
        return q.on_capacity(1, saturated=lambda: self.saturated(entry, now))

    def scraped(self, rep: Replica, now: float) -> list[Ticket]:
        """A scrape of ``rep`` ended (read or failed): the tickets that may proceed if the model
        now has room — as many as the live replicas' room (:func:`~.filters.room`), since the
        scrape may show that many requests left the engine at once (a burst ended between two
        scrapes: nothing the router saw finishing would have woken them)."""
        q = self.queues.get(rep.view.model)
        if not q:
            return []
        entry = self.table.models.get(rep.view.model)
        if entry is None:
            return q.on_capacity(len(q))
        if self.saturated(entry, now):
            return []
        cfg = self.config
        free = sum(room(r.view, cfg) for r in entry.replicas if not r.draining and r.breaker.can_pass(now))
        return q.on_capacity(int(min(max(free, 1), len(q))))

    def lengths(self) -> dict[str, int]:
        return {m: len(q) for m, q in self.queues.items()}
