"""The models' wait queues, and when a waiter may go (pure): a request waits while every live
replica of its model is saturated (RouterCore.next, admission), and is let through as room comes
back — a request ended, a replica came or its breaker closed, a scrape showed room. Counting the
ones that give up, and their 429, stays with the core (RouterCore.left_queue). Each queue is a
:class:`~.fair_queue.FairQueue`: priority bands, fair shares within a band, displacement when full."""

from __future__ import annotations

from .admission import Ticket
from .fair_queue import ANONYMOUS, NORMAL, NORMAL_NAME, FairQueue
from .filters import is_saturated, room
from .plan import Plan
from .replicas import ModelEntry, Replica, ReplicaTable
from .types import SchedulerConfig

__all__ = ["WaitRoom"]


class WaitRoom:
    def __init__(self, queue_size: int, config: SchedulerConfig, table: ReplicaTable, *, fifo: bool = False) -> None:
        self.queue_size = queue_size
        self.fifo = fifo  # [router] queue_order = "fifo": every waiter as one tenant of one band (arrival order)
        self.config = config
        self.table = table
        self.queues: dict[str, FairQueue] = {}

    def queue(self, entry: ModelEntry) -> FairQueue:
        q = self.queues.get(entry.name)
        if q is None:
            q = self.queues[entry.name] = FairQueue(self.queue_size)
        return q

    def enqueue(self, q: FairQueue, plan: Plan, deadline: float, now: float) -> Ticket | None:
        """`plan`'s ticket in `q` under its tenant's tag (None: the anonymous tenant, band normal,
        weight 1, cost the prompt estimate), or None when the queue is full (and it displaced
        nobody). The trace's "queued" phase says the band and the share it waits with."""
        tag = plan.tenant
        if tag is None or self.fifo:
            tenant, band, name, weight, cost = ANONYMOUS, NORMAL, NORMAL_NAME, 1.0, plan.info.prompt_tokens_estimate
        else:
            tenant, band, name, weight, cost = tag.tenant, tag.band, tag.band_name, tag.weight, tag.cost
        t = q.enqueue(plan.info.request_id, deadline, now, tenant=tenant, band=band, weight=weight, cost=cost)
        trace = plan.trace
        if t is not None and trace is not None and trace.marks and trace.last_phase == "queued":
            phase, at, attempt, _ = trace.marks[-1]
            cold = "cold start: no replica yet; " if plan.cold else ""
            trace.marks[-1] = (phase, at, attempt, f"{cold}band {name}, share {q.share(tenant, band):.2f}")
        return t

    @staticmethod
    def cold(entry: ModelEntry) -> bool:
        """Does a request for `entry` wait for a cold start? An autoscaled model (``cold_wait_s``)
        with no replica that takes requests — scaled to zero, or its replicas all still starting:
        the autoscaler sees the waiter and starts one (llmgw.fleet.autoscale). A replica behind an
        open breaker still counts as one (the scheduler's fallback probes it)."""
        if entry.cold_wait_s is None:
            return False
        for r in entry.replicas:
            if not r.draining:
                return False
        return True

    @staticmethod
    def let_through(plan: Plan, t: Ticket) -> None:
        """A waiter was let through: its share of its band then, for the decision and the trace."""
        plan.share = t.share
        if plan.trace is not None:
            plan.trace.share = t.share

    @staticmethod
    def admission_of(plan: Plan) -> tuple[str, str, float]:
        """(tenant, band name, share) for the request's decision."""
        tag = plan.tenant
        return (ANONYMOUS, NORMAL_NAME, plan.share) if tag is None else (tag.tenant, tag.band_name, plan.share)

    def saturated(self, entry: ModelEntry, now: float) -> bool:
        # Replicas behind an open breaker don't count: waiting cannot help them, and the
        # scheduler's all-open fallback handles a model with none available.
        # Draining replicas take no new requests, so their room does not count either. Each
        # view's staleness is refreshed first: the last decision set it, and a scrape since may
        # have made the engine's gauges usable (a stale view counts only our own inflight).
        # One pass that stops at the first live replica with room (the common answer): the
        # views of the rest get their staleness from the decision that follows (table.views).
        cfg = self.config
        table = self.table
        any_live = False
        for r in entry.replicas:
            if r.draining or not r.breaker.can_pass(now):
                continue
            any_live = True
            v = r.view
            v.stale = table.is_stale(r, now)
            if not is_saturated(v, cfg):
                return False
        return any_live

    def turn_passed(self, plan: Plan, now: float) -> list[Ticket]:
        """The request stops waiting just as it was let through: the room it was woken for
        passes to the next waiter. A displaced ticket was given no room: it passes none."""
        t = plan.ticket
        if t is None or t.displaced or t in self.queue(plan.entry):
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
        table = self.table
        free = 0.0
        for r in entry.replicas:  # saturated() stopped at the first with room: refresh every view here
            if not r.draining and r.breaker.can_pass(now):
                r.view.stale = table.is_stale(r, now)
                free += room(r.view, cfg)
        return q.on_capacity(int(min(max(free, 1), len(q))))

    def lengths(self) -> dict[str, int]:
        return {m: len(q) for m, q in self.queues.items()}

    def displaced(self) -> list[Ticket]:
        """Every queue's tickets displaced since the last call (each once): to wake, for their 429."""
        out: list[Ticket] = []
        for q in self.queues.values():
            out += q.take_displaced()
        return out

    def by_band(self) -> dict[tuple[str, str], int]:
        """(model, band name) -> tickets waiting (the llmgw_queue_waiting gauge)."""
        return {(m, b): n for m, q in self.queues.items() for b, n in q.bands().items()}

    def displaced_by_band(self) -> dict[str, int]:
        """Band name -> tickets displaced so far, over every model (llmgw_queue_displaced_total)."""
        out: dict[str, int] = {}
        for q in self.queues.values():
            for b, n in q.displaced_by_band().items():
                out[b] = out.get(b, 0) + n
        return out

    def by_tenant(self) -> dict[str, dict[str, float]]:
        """Tenant -> {waiting, cost, share} over every model's queue (share: the largest it has)."""
        out: dict[str, dict[str, float]] = {}
        for q in self.queues.values():
            for name, e in q.tenants().items():
                o = out.get(name)
                if o is None:
                    out[name] = dict(e)
                else:
                    o["waiting"] += e["waiting"]
                    o["cost"] += e["cost"]
                    o["share"] = max(o["share"], e["share"])
        return out
