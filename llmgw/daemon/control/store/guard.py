"""The one boundary between the control plane and its store: a store that cannot write (disk full,
read-only, I/O error, locked by another process) never takes the daemon down.

Every store call of the control plane and the admin API goes through a StoreGuard. A call that
fails with a store error (one of the backend's ``store.faults``: ``sqlite3.Error``,
``psycopg.Error``...) is logged with its context — the first at once,
then at most one line a minute while the fault lasts — counted per operation
(``llmgw_store_errors_total{op}``), and turns the guard *degraded* (``llmgw_store_degraded`` 1):

- the in-memory state stays authoritative: the router keeps routing, agents keep reporting,
  reconciles go on; writes are not attempted while degraded (each would fail the same way);
- history events are kept in memory, at most MAX_PENDING_HISTORY (beyond that the oldest are
  dropped and counted);
- a background task (``run``) retries with backoff (RETRY_MIN_S doubling to RETRY_MAX_S): it
  re-writes the whole state from memory in one transaction (the control plane's ``rewrite``:
  models, nodes, assignments), then the kept history events, and the guard is healthy again.
  Re-writing everything, rather than replaying the failed writes, cannot get the order wrong and
  needs no bound on what failed;
- admin changes that must persist (``must_write``) first try that recovery at once, and raise
  StoreUnavailable with the reason if the store still cannot write: the change is not made, and
  the admin API answers 503 saying why.

Programming errors (anything but a store fault) in a background write are logged with their
traceback and counted, and that one write is dropped: they say nothing of the disk.

A write refused with ``Fenced`` (several routers: this one is no longer the leader, docs/ha.md) is
not a fault: the store works. The guard calls ``on_fenced`` (leadership steps down) once per refusal,
stays healthy, drops the write (a transaction is rolled back whole), and ``must_write`` raises
NotLeader (a StoreUnavailable: the admin API answers 503)."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import trio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from llmgw.admin.schema import StoreStatus
from llmgw.daemon.control.store.port import FleetStore
from llmgw.daemon.control.store.rows import UNFENCED_OPS, Fenced, describe

log = logging.getLogger("llmgw.control.store")

__all__ = ["MAX_PENDING_HISTORY", "NotLeader", "StoreGuard", "StoreMetrics", "StoreUnavailable", "describe"]

MAX_PENDING_HISTORY = 10_000
RETRY_MIN_S = 1.0
RETRY_MAX_S = 10.0  # a retry is one cheap transaction: no reason to leave the store stale longer
LOG_EVERY_S = 60.0


class StoreUnavailable(Exception):
    """The store cannot take a write that must persist; `reason` says why (e.g. "disk full")."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"the store cannot write ({reason}): {detail}")
        self.reason = reason
        self.detail = detail


class NotLeader(StoreUnavailable):
    """A write that must persist was refused by the fence: another router leads now. The change
    is not made; it may be made at the leader."""

    def __init__(self, detail: str) -> None:
        super().__init__("not the leader", detail)
        self.args = (f"this router is no longer the leader, so the change was not made: {detail}",)


class _Abandon(Exception):
    """Ends a transaction in which a write failed: roll back, the recovery re-writes it all."""


@dataclass(frozen=True, slots=True)
class _Event:
    event: str
    replica: str | None
    model: str | None
    node: str | None
    detail: str
    ts: float


class StoreGuard:
    """See the module docstring. `rewrite(store)` writes the whole state from memory; it is set by
    the control plane once it has loaded (before that there is nothing to re-write)."""

    def __init__(self, store: FleetStore, *, rewrite: Callable[[FleetStore], None] | None = None,
                 max_pending_history: int = MAX_PENDING_HISTORY, wall: Callable[[], float] = time.time,
                 on_fenced: Callable[[Fenced], None] | None = None) -> None:
        self.store = store
        self.rewrite = rewrite
        self.on_fenced = on_fenced
        # False on a router that follows another (docs/ha.md): the fleet's state is the leader's to
        # write, so fenced writes are skipped, history is the leader's, and must_write raises NotLeader.
        self.active = True
        self.fenced = 0  # writes refused by the fence, since start
        self._tx_fenced = False  # a write inside the current guard.transaction was fenced
        self._in_tx = 0  # guard.transaction nesting
        self._wall = wall
        self.degraded = False
        self.reason = ""
        self.detail = ""
        self.since: float | None = None  # wall time the current fault began
        self.errors: dict[str, int] = {}  # op -> store errors, since start
        self.bugs = 0  # non-store exceptions in background writes
        self.history_dropped = 0
        self.recoveries = 0
        self._pending: deque[_Event] = deque()
        self._max_pending = max_pending_history
        self._dropped_now = 0  # dropped during the current fault: written as one event on recovery
        self._logged_at = -float("inf")
        self._errors_unlogged = 0
        self._broken = trio.Event()
        self._retry_now = trio.Event()

    # -- writes ---------------------------------------------------------------------------------
    def write(self, op: str, *args: Any, **kw: Any) -> bool:
        """`store.<op>(*args, **kw)`, or nothing while degraded. True when it was written."""
        if self.degraded or self._tx_fenced or (not self.active and op not in UNFENCED_OPS):
            return False
        try:
            getattr(self.store, op)(*args, **kw)
            return True
        except Fenced as e:
            self._fenced(op, e)
        except self.store.faults as e:
            self._fail(op, e)
        except Exception:  # noqa: BLE001 — a bad value must not take the caller's task down
            self.bugs += 1
            self.errors[op] = self.errors.get(op, 0) + 1
            log.exception("store %s failed (not a store fault: this write is dropped)", op)
        return False

    def must_write(self, op: str, *args: Any, **kw: Any) -> Any:
        """A write that must persist before its change is made (an operator's): the store's
        answer, or StoreUnavailable. Other exceptions (a bad value) reach the caller."""
        if not self.active and op not in UNFENCED_OPS:
            raise NotLeader("this router follows another one, which makes the fleet's changes")
        if self.degraded and not self.try_recover():
            raise StoreUnavailable(self.reason, self.detail)
        try:
            return getattr(self.store, op)(*args, **kw)
        except Fenced as e:
            self._fenced(op, e)
            raise NotLeader(str(e)) from None
        except self.store.faults as e:
            self._fail(op, e)
            raise StoreUnavailable(self.reason, self.detail) from None

    def read(self, op: str, fn: Callable[[FleetStore], Any]) -> Any:
        """A read for an answer (the admin API's history): its result, or StoreUnavailable."""
        try:
            return fn(self.store)
        except self.store.faults as e:
            self._fail(op, e)
            raise StoreUnavailable(self.reason, self.detail) from None

    def record(self, event: str, *, replica: str | None = None, model: str | None = None,
               node: str | None = None, detail: str = "") -> None:
        """A history event: written now, or kept until the store can write again."""
        if not self.active:
            return  # the leader keeps the fleet's history
        ev = _Event(event, replica, model, node, detail, self._wall())
        if not self.degraded and self.write("record", event, replica=replica, model=model, node=node,
                                            detail=detail, ts=ev.ts):
            return
        if len(self._pending) >= self._max_pending:
            self._pending.popleft()
            self.history_dropped += 1
            self._dropped_now += 1
        self._pending.append(ev)

    @contextmanager
    def transaction(self, op: str) -> Iterator[None]:
        """One commit for the writes inside, as Store.transaction — but a store error never leaves
        it: a failed BEGIN or COMMIT degrades the guard and the block runs (or has run) in full,
        its writes skipped; a write that failed inside rolls the whole transaction back."""
        if self.degraded or self._tx_fenced or not self.active:
            yield
            return
        entered = False
        self._in_tx += 1
        try:
            with self.store.transaction():
                entered = True
                yield
                if self.degraded or self._tx_fenced:
                    raise _Abandon
        except _Abandon:
            pass
        except Fenced as e:  # raised by the block's own store call, or at COMMIT
            self._fenced(op, e)
        except self.store.faults as e:
            self._fail(op, e)
            if not entered:  # BEGIN failed: the block has not run yet
                yield
        finally:
            self._in_tx -= 1
            if self._in_tx == 0:
                self._tx_fenced = False

    # -- faults and recovery ----------------------------------------------------------------------
    def _fenced(self, op: str, e: Fenced) -> None:
        """A write the fence refused: not a fault. Tell leadership (it steps down); the rest of an
        open guard.transaction is skipped and rolled back."""
        self.fenced += 1
        if self._depth_open():
            self._tx_fenced = True
        log.warning("store %s: %s refused: %s", self.store.path, op, e)
        if self.on_fenced is not None:
            try:
                self.on_fenced(e)
            except Exception:  # noqa: BLE001 — the write's caller must not fail for it
                log.exception("store %s: on_fenced failed", self.store.path)

    def _depth_open(self) -> bool:
        return self._in_tx > 0

    def _fail(self, op: str, e: BaseException) -> None:
        self.errors[op] = self.errors.get(op, 0) + 1
        reason, detail = self.store.describe(e), str(e) or type(e).__name__
        first = not self.degraded
        if first:
            self.degraded, self.since = True, self._wall()
            self._broken.set()
        self.reason, self.detail = reason, detail
        now = time.monotonic()
        if first or now - self._logged_at >= LOG_EVERY_S:
            more = f" ({self._errors_unlogged} more errors since the last report)" if self._errors_unlogged else ""
            log.error("store %s: %s failed: %s — %s; the router keeps running from memory and will write "
                      "its state back when the store can write again%s", self.store.path, op, reason, detail,
                      more)
            self._logged_at, self._errors_unlogged = now, 0
        else:
            self._errors_unlogged += 1

    def try_recover(self) -> bool:
        """One attempt: the whole state from memory, then the kept history, in one transaction."""
        if not self.degraded:
            return True
        pending = list(self._pending)
        try:
            with self.store.transaction():
                if self.rewrite is not None and self.active:  # a follower has nothing of its own to write
                    self.rewrite(self.store)
                for ev in pending:
                    self.store.record(ev.event, replica=ev.replica, model=ev.model, node=ev.node,
                                      detail=ev.detail, ts=ev.ts)
                if self._dropped_now:
                    self.store.record("history dropped", detail=f"{self._dropped_now} events lost while the "
                                                                f"store could not write ({self.reason})")
        except Fenced as e:  # no longer the leader: the state is the new leader's to write now
            self._fenced("recover", e)
            self._recovered(pending, rewritten=False)
            return True
        except self.store.faults as e:
            self._fail("recover", e)
            return False
        except Exception:  # noqa: BLE001 — a bug in rewrite must not stop the retries
            self.bugs += 1
            self.errors["recover"] = self.errors.get("recover", 0) + 1
            log.exception("store %s: re-writing the state failed", self.store.path)
            return False
        self._recovered(pending, rewritten=True)
        return True

    def _recovered(self, pending: list[_Event], *, rewritten: bool) -> None:
        lasted = self._wall() - (self.since or self._wall())
        log.warning("store %s can write again after %.0fs (%s): %s, with %d history events kept meanwhile%s",
                    self.store.path, lasted, self.reason,
                    "the state was written back from memory" if rewritten else
                    "this router no longer leads, so its state was not written back",
                    len(pending) if rewritten else 0, f" ({self._dropped_now} dropped)" if self._dropped_now else "")
        for _ in pending:
            self._pending.popleft()
        self.degraded, self.reason, self.detail, self.since = False, "", "", None
        self._dropped_now, self._errors_unlogged = 0, 0
        self.recoveries += 1
        self._broken = trio.Event()

    def retry_soon(self) -> None:
        """Try the recovery now instead of at the end of the backoff (e.g. an operator asked)."""
        self._retry_now.set()

    async def run(self) -> None:
        """The background retry loop: sleeps until degraded, then retries with backoff."""
        while True:
            await self._broken.wait()
            delay = RETRY_MIN_S
            while self.degraded:
                with trio.move_on_after(delay):
                    await self._retry_now.wait()
                self._retry_now = trio.Event()
                # Probe from a worker thread first: a store that hangs (a blackholed server) costs
                # this task its timeout, never the trio thread; the recovery runs once it answers.
                try:
                    await trio.to_thread.run_sync(self.store.ping)
                except self.store.faults as e:
                    self._fail("ping", e)
                    ok = False
                else:
                    ok = self.try_recover()
                if not ok:
                    delay = min(delay * 2, RETRY_MAX_S)

    # -- what operators see -----------------------------------------------------------------------
    def status(self) -> StoreStatus:
        return StoreStatus(
            state="degraded" if self.degraded else "ok", path=self.store.path,
            reason=self.reason or None, detail=self.detail or None,
            since_s=None if self.since is None else round(self._wall() - self.since, 3),
            errors=sum(self.errors.values()), pending_history=len(self._pending),
            history_dropped=self.history_dropped)


class StoreMetrics(Collector):
    """The guard's counters for the router's /metrics."""

    def __init__(self, guard: StoreGuard) -> None:
        self.guard = guard

    def collect(self) -> Iterable[Metric]:
        g = self.guard
        errors = CounterMetricFamily("llmgw_store_errors", "Store operations that failed, by operation.",
                                     labels=["op"])
        for op, n in sorted(g.errors.items()):
            errors.add_metric([op], n)
        yield errors
        degraded = GaugeMetricFamily("llmgw_store_degraded",
                                     "1 while the store cannot write (the router runs from memory).")
        degraded.add_metric([], 1.0 if g.degraded else 0.0)
        yield degraded
        pending = GaugeMetricFamily("llmgw_store_pending_history", "History events waiting for the store.")
        pending.add_metric([], len(g._pending))
        yield pending
        dropped = CounterMetricFamily("llmgw_store_history_dropped", "History events lost to a long store fault.")
        dropped.add_metric([], g.history_dropped)
        yield dropped
        fenced = CounterMetricFamily("llmgw_store_fenced_writes", "Writes refused because another router leads.")
        fenced.add_metric([], g.fenced)
        yield fenced
        times = getattr(g.store, "call_times", None)  # PostgreSQL: every statement's round trip
        if times is not None:
            h = HistogramMetricFamily("llmgw_store_call_seconds", "How long the store's statements took "
                                      "(PostgreSQL), failed ones included.")
            h.add_metric([], times.cumulative(), sum_value=times.total)
            yield h
