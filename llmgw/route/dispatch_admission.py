"""The router's core, its admission half (:class:`~.dispatch.RouterCore` is made of it): a request
that waits — for room, or for a cold start's first replica —, its place given up (the client left,
its deadline passed: the 429 or the cold start's 503), and the waiters a freed place, a new replica
or a scrape lets go. Pure, as the core."""

from __future__ import annotations

from typing import Any

from llmgw.inputs.echo import echo

from .admission import Ticket, suggest_retry_after
from .openai_req import ApiError
from .plan import Plan
from .replicas import Replica

__all__ = ["Admission"]


class Admission:
    # what the core provides (dispatch.RouterCore.__init__ sets them; _done and _settle are its own)
    wait: Any  # waiting.WaitRoom
    rc: Any  # config.RouterConfig
    load: Any  # load_report.LoadReport
    counters: Any  # counters.RouterCounters
    _done: Any
    _settle: Any

    def _enqueue(self, plan: Plan, now: float, *, cold: bool = False) -> Ticket:
        """`plan` waits: for room (``queue_timeout_s``), or (`cold`) for its model's first replica
        (``[models.autoscale] cold_start_wait_s``; counted in the load report's cold waits)."""
        if plan.trace is not None and plan.trace.last_phase != "queued":
            plan.trace.mark("queued", now)
        q = self.wait.queue(plan.entry)
        plan.cold = cold
        wait_s = plan.entry.cold_wait_s if cold and plan.entry.cold_wait_s is not None else self.rc.queue_timeout_s
        t = self.wait.enqueue(q, plan, now + wait_s, now)
        if t is None:
            raise self._reject(plan, now, "queue_full", "All replicas are saturated and the wait queue is full.")
        if cold:
            self.load.cold_wait(plan.model)
        plan.ticket = t
        return t

    def displaced(self) -> list[Ticket]:
        """The waiters displaced from a full queue since the last call: the shell wakes them (each
        then gets its 429 from ``next``). Ask after every ``next`` that answered a Ticket."""
        return self.wait.displaced()

    def turn_passed(self, plan: Plan, now: float) -> list[Ticket]:
        """The request stops waiting (its client left, its deadline passed) just as it was let
        through: the room it was woken for passes to the next waiter, or that waiter would wait
        on for a wake that was spent. Call before :meth:`left_queue`."""
        return self.wait.turn_passed(plan, now)

    def left_queue(self, plan: Plan, now: float, *, timed_out: bool) -> None:
        """A waiting request stops waiting without being let through: its client went away, or
        (``timed_out``) its deadline passed — then the 429 it gets is raised here."""
        t, plan.ticket = plan.ticket, None
        if t is not None:
            self.wait.queue(plan.entry).cancel(t)
        self._settle(plan, now, count=timed_out)
        if timed_out:
            if plan.cold:
                raise self._cold_timeout(plan, now)
            if plan.adapter_wait:
                raise self._reject(plan, now, "adapter_no_room", f"{plan.wait_reason}; try again later.")
            raise self._reject(plan, now, "queue_timeout", "All replicas stayed saturated; try again later.")
        if t is not None:  # the client left while it waited: counted where it ended
            self._done(plan, "client_cancelled", 499, None, None, now)

    def _reject(self, plan: Plan, now: float, reason: str, message: str) -> ApiError:
        q = self.wait.queue(plan.entry)
        drain = sum(r.view.drain_rate or 0.0 for r in plan.entry.replicas) or None
        self.counters.rejected(plan.model, reason)
        self._done(plan, "rejected", 429, None, None, now)
        e = ApiError(429, message, type_="rate_limit", code="saturated",
                     headers=[("retry-after", str(suggest_retry_after(len(q), drain)))])
        e.counted = True
        return e

    def _cold_timeout(self, plan: Plan, now: float) -> ApiError:
        """A request waited its model's whole cold_start_wait_s and no replica became ready: 503."""
        wait_s = plan.entry.cold_wait_s or 0.0
        self.counters.rejected(plan.model, "cold_start_timeout")
        self._done(plan, "rejected", 503, None, None, now)
        e = ApiError(503, f"Model {echo(plan.model, quote='`')} is starting (a cold start): no replica became ready "
                     f"within {wait_s:g}s. Try again later.", type_="service_unavailable", code="cold_start",
                     headers=[("retry-after", str(max(1, round(wait_s / 4))))])
        e.counted = True
        return e

    def capacity_freed(self, model: str, now: float | None = None, *, everyone: bool = False) -> list[Ticket]:
        """Tickets that may proceed now that a request on ``model`` ended (or a replica came, or
        a breaker closed: ``everyone``): :meth:`.waiting.WaitRoom.freed`."""
        return self.wait.freed(model, now, everyone=everyone)

    def scraped(self, rep: Replica, now: float) -> list[Ticket]:
        """A scrape of ``rep`` ended (read or failed): the tickets that may proceed if the model
        now has room (:meth:`.waiting.WaitRoom.scraped`)."""
        return self.wait.scraped(rep, now)
