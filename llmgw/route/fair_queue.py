"""A model's wait queue with priority bands and fair shares (pure): what WaitRoom holds.

The same face as :class:`~.admission.WaitQueue` (enqueue, on_capacity, expire, cancel, requeue,
next_deadline, admit_now, retry_after, snapshot, len/iter/in), in another order:

- **Bands first.** A ticket of a higher band (``llmgw.tenants.model.band_rank``: batch 0 … critical
  4) always leaves before any ticket of a lower band.
- **Weighted fair queueing on cost within a band.** Each ticket gets virtual tags when it comes:
  ``start = max(V, the tenant's last finish)``, ``finish = start + cost / weight``, where ``V`` is
  the band's virtual time (the start tag of the ticket served last) and ``cost`` the request's
  tokens (prompt estimate + max_tokens). The smallest finish tag goes first (ties: the older).
  So two tenants that both keep tickets waiting are served tokens in the ratio of their weights —
  after any number of services, ``|served_a / w_a - served_b / w_b|`` is at most one request's
  ``cost / weight`` — and one tenant's many small requests weigh what another's few long ones
  do. A tenant's own tickets keep their order (its tags only grow). An idle tenant banks no
  credit: it comes back at ``V``. A request that leaves unserved (expired, cancelled, displaced)
  as its tenant's last gives its tags back.
- **Requeue** (a woken ticket that found no room) keeps its tags and goes first of its band.
- **Full queue: displacement.** An arrival takes the place of another ticket when the queue is
  full and that ticket is of a lower band, or of its own band and of a tenant with more queued
  cost than the arrival's tenant would have with it (longest-queue drop). The victim is the last
  ticket (largest finish tag) of the tenant with the most queued cost in the lowest band that
  waits below the arrival's (or, failing one, in its own band). A higher band's ticket is never
  displaced. The victim leaves the queue with ``displaced = True`` and is handed to the shell by
  :meth:`FairQueue.take_displaced` (it answers 429). Otherwise the arrival is refused (None).

Every ticket leaves in exactly one way: on_capacity, expire, cancel, or displacement.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from typing import Any

from llmgw.tenants.model import BANDS, DEFAULT_BAND, band_rank

from .admission import Ticket, suggest_retry_after

__all__ = ["FairQueue", "band_name", "ANONYMOUS", "NORMAL", "NORMAL_NAME"]

ANONYMOUS = "-"  # the tenant of a request that names none (the eval runner, tests, an open router)
NORMAL_NAME = DEFAULT_BAND
NORMAL = band_rank(DEFAULT_BAND)


def band_name(band: int) -> str:
    return BANDS[band] if 0 <= band < len(BANDS) else str(band)


class _Flow:
    """One tenant's tickets in one band."""

    __slots__ = ("tickets", "cost", "last_finish", "weight")

    def __init__(self, weight: float) -> None:
        self.tickets: dict[int, Ticket] = {}
        self.cost = 0
        self.last_finish = 0.0
        self.weight = weight


class _Band:
    __slots__ = ("vtime", "heap", "flows", "n")

    def __init__(self) -> None:
        self.vtime = 0.0
        self.heap: list[tuple[int, float, int]] = []  # (0 requeued | 1, finish, seq); stale entries skipped
        self.flows: dict[str, _Flow] = {}
        self.n = 0  # tickets waiting


class FairQueue:
    """A bounded queue of requests waiting for capacity (module docstring for the order)."""

    __slots__ = ("max_size", "_q", "_bands", "_deadlines", "_seq", "_stats", "_displaced", "_displaced_by")

    def __init__(self, max_size: int) -> None:
        if max_size < 0:
            raise ValueError("max_size must be >= 0")
        self.max_size = max_size  # 0 = never queue: refuse at once when saturated
        self._q: dict[int, Ticket] = {}
        self._bands: dict[int, _Band] = {}
        self._deadlines: list[tuple[float, int]] = []  # heap; entries of removed tickets are skipped
        self._seq = 0
        self._displaced: list[Ticket] = []
        self._displaced_by: dict[str, int] = {}  # band name -> tickets displaced
        self._stats = {"enqueued_total": 0, "rejected_full_total": 0, "admitted_total": 0,
                       "expired_total": 0, "cancelled_total": 0, "requeued_total": 0, "displaced_total": 0}

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Ticket]:
        """The waiting tickets in the order they would leave."""
        return iter(sorted(self._q.values(), key=_order))

    def __contains__(self, ticket: object) -> bool:
        return isinstance(ticket, Ticket) and self._q.get(ticket.seq) is ticket

    def admit_now(self, saturated: bool | Callable[[], bool]) -> bool:
        """May a new arrival skip the queue? Only when nobody is waiting and there is room."""
        if self._q:
            return False
        return not (saturated() if callable(saturated) else saturated)

    # -- arrivals ---------------------------------------------------------------------------------
    def enqueue(self, request_id: str, deadline: float, now: float | None = None, *, tenant: str = ANONYMOUS,
                band: int = NORMAL, weight: float = 1.0, cost: int = 1) -> Ticket | None:
        """A ticket, or None when the queue is full and the arrival may displace nobody (answer
        429 with Retry-After). When it displaced a ticket, that one is in :meth:`take_displaced`."""
        weight = weight if weight > 0 else 1.0
        cost = max(int(cost), 1)
        if len(self._q) >= self.max_size:
            victim = self._victim(tenant, band, cost) if self.max_size else None
            if victim is None:
                self._stats["rejected_full_total"] += 1
                return None
            self._remove(victim)
            victim.displaced = True
            victim.displaced_by = "displaced by a higher band" if victim.band < band else "fair share"
            self._displaced.append(victim)
            name = band_name(victim.band)
            self._displaced_by[name] = self._displaced_by.get(name, 0) + 1
            self._stats["displaced_total"] += 1
        self._seq += 1
        t = Ticket(self._seq, request_id, deadline, now, tenant=tenant, band=band, cost=cost)
        b = self._bands.get(band)
        if b is None:
            b = self._bands[band] = _Band()
        f = b.flows.get(tenant)
        if f is None:
            f = b.flows[tenant] = _Flow(weight)
        f.weight = weight
        t.start = max(b.vtime, f.last_finish)
        t.finish = f.last_finish = t.start + cost / weight
        self._add(t, b, f, 1)
        if len(self._deadlines) > 2 * len(self._q) + 64:  # drop entries of tickets that left
            self._deadlines = [(d, s) for d, s in self._deadlines if s in self._q]
            heapq.heapify(self._deadlines)
        heapq.heappush(self._deadlines, (deadline, t.seq))
        self._stats["enqueued_total"] += 1
        return t

    def take_displaced(self) -> list[Ticket]:
        """The tickets displaced since the last call (each once): wake them; they get a 429."""
        out, self._displaced = self._displaced, []
        return out

    def _victim(self, tenant: str, band: int, cost: int) -> Ticket | None:
        b: _Band | None
        flow: _Flow | None
        lower = [k for k, b in self._bands.items() if k < band and b.n]
        if lower:
            b = self._bands[min(lower)]
            flow = max(b.flows.values(), key=lambda f: (f.cost, len(f.tickets)))
            return max(flow.tickets.values(), key=_order)
        b = self._bands.get(band)
        if b is None or not b.n:
            return None  # everything waiting is of a higher band
        mine = b.flows.get(tenant)
        own = (mine.cost if mine is not None else 0) + cost
        name, flow = max(((n, f) for n, f in b.flows.items() if n != tenant and f.tickets),
                         key=lambda nf: (nf[1].cost, len(nf[1].tickets)), default=(None, None))
        if flow is None or flow.cost <= own:
            return None  # the arrival's tenant holds (or would hold) the most: it is the one refused
        return max(flow.tickets.values(), key=_order)

    # -- departures -------------------------------------------------------------------------------
    def on_capacity(self, free: int = 1, saturated: bool | Callable[[], bool] | None = None) -> list[Ticket]:
        """Tickets that may proceed now, highest band first and fairly within a band: up to `free`
        of them. When `saturated` says everything is still full, none. Deadlines are not checked
        here: call expire(now) first."""
        if saturated is not None and (saturated() if callable(saturated) else saturated):
            return []
        out: list[Ticket] = []
        while self._q and len(out) < free:
            t = self._pop()
            if t is None:
                break
            out.append(t)
        self._stats["admitted_total"] += len(out)
        return out

    def _pop(self) -> Ticket | None:
        for k in sorted(self._bands, reverse=True):
            b = self._bands[k]
            if not b.n:
                continue
            h = b.heap
            while h:
                _, _, seq = heapq.heappop(h)
                t = self._q.get(seq)
                if t is None or t.band != k:
                    continue
                t.share = self.share(t.tenant, k)
                self._remove(t, served=True)
                b.vtime = max(b.vtime, t.start)
                self._prune(b)
                return t
        return None

    def expire(self, now: float) -> list[Ticket]:
        """Remove and return the tickets whose deadline is <= now, in deadline order."""
        out: list[Ticket] = []
        h = self._deadlines
        while h and h[0][0] <= now:
            _, seq = heapq.heappop(h)
            t = self._q.get(seq)
            if t is not None:
                self._remove(t)
                out.append(t)
        self._stats["expired_total"] += len(out)
        return out

    def cancel(self, ticket: Ticket) -> bool:
        """The waiting client went away. False if the ticket had already left the queue."""
        if self._q.get(ticket.seq) is not ticket:
            return False
        self._remove(ticket)
        self._stats["cancelled_total"] += 1
        return True

    def requeue(self, ticket: Ticket) -> None:
        """Put a ticket that was let through but found no room back: first of its band, its tags
        kept. Allowed past max_size: it already held a place. Not a displaced ticket."""
        if ticket.seq in self._q or ticket.displaced:
            return
        b = self._bands.get(ticket.band)
        if b is None:
            b = self._bands[ticket.band] = _Band()
        f = b.flows.get(ticket.tenant)
        if f is None:
            f = b.flows[ticket.tenant] = _Flow(1.0)
            f.last_finish = ticket.finish
        self._add(ticket, b, f, 0)
        heapq.heappush(self._deadlines, (ticket.deadline, ticket.seq))
        self._stats["admitted_total"] -= 1
        self._stats["requeued_total"] += 1

    def _add(self, t: Ticket, b: _Band, f: _Flow, first: int) -> None:
        self._q[t.seq] = t
        f.tickets[t.seq] = t
        f.cost += t.cost
        b.n += 1
        heapq.heappush(b.heap, (first, t.finish, t.seq))
        if len(b.heap) > 2 * b.n + 64:
            b.heap = [e for e in b.heap if (x := self._q.get(e[2])) is not None and x.band == t.band]
            heapq.heapify(b.heap)

    def _remove(self, t: Ticket, served: bool = False) -> None:
        """Out of the queue. A ticket that leaves unserved (expired, cancelled, displaced) and was
        its tenant's last gives its virtual time back: the tenant's next request is not charged
        for service it never got."""
        del self._q[t.seq]
        b = self._bands[t.band]
        b.n -= 1
        f = b.flows[t.tenant]
        del f.tickets[t.seq]
        f.cost -= t.cost
        if not served and f.last_finish == t.finish:
            f.last_finish = t.start

    @staticmethod
    def _prune(b: _Band) -> None:
        """Forget tenants with nothing waiting whose last tag the band's time has passed (they
        would start at V anyway): the flows stay as many as the tenants that matter."""
        if len(b.flows) > 64:
            for name in [n for n, f in b.flows.items() if not f.tickets and f.last_finish <= b.vtime]:
                del b.flows[name]

    # -- looks --------------------------------------------------------------------------------------
    def share(self, tenant: str, band: int) -> float:
        """`tenant`'s weight over the weights of the tenants waiting in `band` (counting itself):
        the fraction of the band's service it gets while they all wait. 1.0 alone."""
        b = self._bands.get(band)
        if b is None:
            return 1.0
        mine = b.flows.get(tenant)
        w = mine.weight if mine is not None else 1.0
        total = sum(f.weight for n, f in b.flows.items() if f.tickets and n != tenant) + w
        return w / total

    def next_deadline(self) -> float | None:
        """The earliest deadline of a waiting ticket (when to call expire next)."""
        h = self._deadlines
        while h and self._q.get(h[0][1]) is None:
            heapq.heappop(h)
        return h[0][0] if h else None

    def retry_after(self, drain_rate: float | None, *, default: int = 5) -> int:
        return suggest_retry_after(len(self._q), drain_rate, default=default)

    def bands(self) -> dict[str, int]:
        """Tickets waiting per band name (bands with none left out)."""
        return {band_name(k): b.n for k, b in sorted(self._bands.items()) if b.n}

    def displaced_by_band(self) -> dict[str, int]:
        """Tickets displaced so far, per band name of the displaced one (a counter)."""
        return dict(self._displaced_by)

    def tenants(self) -> dict[str, dict[str, Any]]:
        """Per tenant waiting: {waiting, cost, share} — share in the highest band it waits in."""
        out: dict[str, dict[str, Any]] = {}
        for k in sorted(self._bands, reverse=True):
            for name, f in self._bands[k].flows.items():
                if not f.tickets:
                    continue
                e = out.get(name)
                if e is None:
                    out[name] = {"waiting": len(f.tickets), "cost": f.cost, "share": self.share(name, k)}
                else:
                    e["waiting"] += len(f.tickets)
                    e["cost"] += f.cost
        return out

    def snapshot(self, now: float | None = None) -> dict[str, Any]:
        oldest = None
        if now is not None and self._q:
            times = [t.enqueued_at for t in self._q.values() if t.enqueued_at is not None]
            oldest = now - min(times) if times else None
        return {"length": len(self._q), "max_size": self.max_size, "oldest_wait": oldest,
                "next_deadline": self.next_deadline(), **self._stats, "bands": self.bands(),
                "tenants": self.tenants()}


def _order(t: Ticket) -> tuple[int, float, int]:
    """The order tickets leave in, ignoring requeues: higher band, smaller finish tag, older."""
    return (-t.band, t.finish, t.seq)
