"""The pure part of admission control: per-endpoint concurrency caps and a bounded FIFO wait queue.

No I/O, no trio, no clock: times are passed in. The trio shell wraps `WaitQueue` with one event per
ticket (set the events of the tickets `on_capacity` / `expire` return) and calls `ConcurrencyCaps`
around each upstream request.

Saturation ("is every candidate endpoint full?") is decided by the scheduler
(`llmgw.route.filters.is_saturated`); this module only takes its answer, as a bool or a
`Callable[[], bool]`.

Typical flow in the shell:
    if queue.admit_now(saturated):           # nobody waiting and room somewhere
        route and send
    else:
        ticket = queue.enqueue(rid, now + max_wait, now)
        if ticket is None: 429 with Retry-After: queue.retry_after(drain_rate)
        else: wait for the ticket's event (or cancel(ticket) on client disconnect)
    # whenever a request ends or a scrape shows room:
    for t in queue.on_capacity(free=1, saturated=saturated): wake t
    # on a timer at queue.next_deadline():
    for t in queue.expire(now): answer 429 with Retry-After
A woken request that still finds no room goes back to the head with `requeue(ticket)`.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["ConcurrencyCaps", "Ticket", "WaitQueue", "suggest_retry_after", "RETRY_AFTER_MIN",
           "RETRY_AFTER_MAX"]

RETRY_AFTER_MIN, RETRY_AFTER_MAX = 1, 60


# ------------------------------------------------------------------------------ concurrency caps
class ConcurrencyCaps:
    """In-flight counters with optional per-endpoint caps. `try_reserve` checks and increments in one
    call; every successful reservation must be matched by exactly one `release`."""

    __slots__ = ("default_cap", "_caps", "_inflight", "_rejected", "_over_released")

    def __init__(self, default_cap: int | None = None) -> None:
        self.default_cap = default_cap  # None = unlimited (still counted)
        self._caps: dict[str, int | None] = {}
        self._inflight: dict[str, int] = {}
        self._rejected = 0
        self._over_released = 0  # release() without a reservation: a caller bug, counted not raised

    def set_cap(self, endpoint_id: str, cap: int | None) -> None:
        """Set one endpoint's cap (None = unlimited). Lowering it below the current in-flight count
        is allowed: new reservations fail until enough requests end."""
        if cap is not None and cap < 0:
            raise ValueError("cap must be >= 0 or None")
        self._caps[endpoint_id] = cap

    def cap(self, endpoint_id: str) -> int | None:
        return self._caps.get(endpoint_id, self.default_cap)

    def inflight(self, endpoint_id: str) -> int:
        return self._inflight.get(endpoint_id, 0)

    def has_room(self, endpoint_id: str) -> bool:
        """A side-effect-free look (for filters); reserve with try_reserve, never with this."""
        cap = self.cap(endpoint_id)
        return cap is None or self._inflight.get(endpoint_id, 0) < cap

    def try_reserve(self, endpoint_id: str) -> bool:
        n = self._inflight.get(endpoint_id, 0)
        cap = self._caps.get(endpoint_id, self.default_cap)
        if cap is not None and n >= cap:
            self._rejected += 1
            return False
        self._inflight[endpoint_id] = n + 1
        return True

    def release(self, endpoint_id: str) -> None:
        n = self._inflight.get(endpoint_id, 0)
        if n <= 0:
            self._over_released += 1
            return
        if n == 1:
            del self._inflight[endpoint_id]
        else:
            self._inflight[endpoint_id] = n - 1

    def forget(self, endpoint_id: str) -> None:
        """Drop an endpoint's cap (its in-flight count stays until its requests are released)."""
        self._caps.pop(endpoint_id, None)

    def snapshot(self) -> dict[str, Any]:
        ids = sorted(set(self._caps) | set(self._inflight))
        return {"endpoints": {i: {"inflight": self.inflight(i), "cap": self.cap(i)} for i in ids},
                "default_cap": self.default_cap, "rejected_total": self._rejected,
                "over_released_total": self._over_released}


# ------------------------------------------------------------------------------------ wait queue
@dataclass(slots=True, eq=False)
class Ticket:
    seq: int  # FIFO order
    request_id: str
    deadline: float
    enqueued_at: float | None = None
    # fair queueing (llmgw.route.fair_queue; WaitQueue leaves them as they are)
    tenant: str = "-"
    band: int = 2  # llmgw.tenants.model.band_rank: higher goes first
    cost: int = 1  # tokens: the prompt estimate + max_tokens
    displaced: bool = False  # a full queue gave its place to a higher band or a fairer share: answer 429
    displaced_by: str = ""  # ... "a higher band" or "fair share" (the 429 says it)
    start: float = 0.0  # its virtual start and finish tags in its band
    finish: float = 0.0
    share: float = 1.0  # its tenant's share of the band when it was let through


def suggest_retry_after(queue_len: int, drain_rate: float | None, *, default: int = 5) -> int:
    """Seconds a refused client should wait: the time to drain the queue plus this request at the
    recent drain rate (requests finished per second), clamped to [1, 60]. Unknown rate (None) →
    `default`; a rate of 0 (nothing finishing) → 60."""
    if drain_rate is None or math.isnan(drain_rate):
        secs = float(default)
    elif drain_rate <= 0:
        secs = float(RETRY_AFTER_MAX)
    else:
        secs = float(math.ceil((max(queue_len, 0) + 1) / drain_rate))  # float: one type for secs (mypyc)
    return int(min(max(secs, RETRY_AFTER_MIN), RETRY_AFTER_MAX))


class WaitQueue:
    """A bounded FIFO of requests waiting for capacity, each with its own deadline.

    Tickets leave the queue in exactly one way: `on_capacity` (proceed), `expire` (deadline passed),
    or `cancel` (the client went away). `requeue` puts a woken ticket back at the head."""

    __slots__ = ("max_size", "_q", "_deadlines", "_seq", "_stats")

    def __init__(self, max_size: int) -> None:
        if max_size < 0:
            raise ValueError("max_size must be >= 0")
        self.max_size = max_size  # 0 = never queue: refuse at once when saturated
        self._q: OrderedDict[int, Ticket] = OrderedDict()
        self._deadlines: list[tuple[float, int]] = []  # heap; entries of removed tickets are skipped
        self._seq = 0
        self._stats = {"enqueued_total": 0, "rejected_full_total": 0, "admitted_total": 0,
                       "expired_total": 0, "cancelled_total": 0, "requeued_total": 0}

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Ticket]:
        return iter(list(self._q.values()))

    def __contains__(self, ticket: object) -> bool:
        return isinstance(ticket, Ticket) and self._q.get(ticket.seq) is ticket

    def admit_now(self, saturated: bool | Callable[[], bool]) -> bool:
        """May a new arrival skip the queue? Only when nobody is waiting (FIFO: no overtaking) and
        there is room."""
        if self._q:
            return False
        return not (saturated() if callable(saturated) else saturated)

    def enqueue(self, request_id: str, deadline: float, now: float | None = None) -> Ticket | None:
        """A ticket, or None when the queue is full (answer 429 with Retry-After)."""
        if len(self._q) >= self.max_size:
            self._stats["rejected_full_total"] += 1
            return None
        self._seq += 1
        t = Ticket(self._seq, request_id, deadline, now)
        self._q[t.seq] = t
        if len(self._deadlines) > 2 * len(self._q) + 64:  # drop entries of tickets that left
            self._deadlines = [(d, s) for d, s in self._deadlines if s in self._q]
            heapq.heapify(self._deadlines)
        heapq.heappush(self._deadlines, (deadline, t.seq))
        self._stats["enqueued_total"] += 1
        return t

    def on_capacity(self, free: int = 1, saturated: bool | Callable[[], bool] | None = None) -> list[Ticket]:
        """Tickets that may proceed now, oldest first: up to `free` of them (how many requests can
        start: 1 per finished request, or the free slots a scrape showed). When `saturated` says
        everything is still full, none. Deadlines are not checked here: call expire(now) first."""
        if saturated is not None and (saturated() if callable(saturated) else saturated):
            return []
        out: list[Ticket] = []
        while self._q and len(out) < free:
            _, t = self._q.popitem(last=False)
            out.append(t)
        self._stats["admitted_total"] += len(out)
        return out

    def expire(self, now: float) -> list[Ticket]:
        """Remove and return the tickets whose deadline is <= now, in deadline order."""
        out: list[Ticket] = []
        h = self._deadlines
        while h and h[0][0] <= now:
            _, seq = heapq.heappop(h)
            t = self._q.pop(seq, None)
            if t is not None:
                out.append(t)
        self._stats["expired_total"] += len(out)
        return out

    def cancel(self, ticket: Ticket) -> bool:
        """The waiting client went away. False if the ticket had already left the queue."""
        if self._q.get(ticket.seq) is not ticket:
            return False
        del self._q[ticket.seq]
        self._stats["cancelled_total"] += 1
        return True

    def requeue(self, ticket: Ticket) -> None:
        """Put a ticket that was let through but found no room back in its place (ahead of every
        ticket enqueued after it). Allowed past max_size: it already held a place."""
        if ticket.seq in self._q:
            return
        self._q[ticket.seq] = ticket
        # keep FIFO order by seq: move every later ticket behind it
        for seq in [s for s in self._q if s > ticket.seq]:
            self._q.move_to_end(seq)
        heapq.heappush(self._deadlines, (ticket.deadline, ticket.seq))
        self._stats["admitted_total"] -= 1
        self._stats["requeued_total"] += 1

    def next_deadline(self) -> float | None:
        """The earliest deadline of a waiting ticket (when to call expire next)."""
        h = self._deadlines
        while h and self._q.get(h[0][1]) is None:
            heapq.heappop(h)
        return h[0][0] if h else None

    def retry_after(self, drain_rate: float | None, *, default: int = 5) -> int:
        return suggest_retry_after(len(self._q), drain_rate, default=default)

    def snapshot(self, now: float | None = None) -> dict[str, Any]:
        head = next(iter(self._q.values()), None)
        oldest = None
        if now is not None and head is not None and head.enqueued_at is not None:
            oldest = now - head.enqueued_at
        return {"length": len(self._q), "max_size": self.max_size, "oldest_wait": oldest,
                "next_deadline": self.next_deadline(), **self._stats}
