"""The router's tenants' usage and quotas in step with the store (docs/tenants.md, "Usage
accounting" and "Several routers"): three loops the daemon starts beside the plane's others.

- **flush**, every ``[tenants] usage_flush_s``: the router's usage records since the last flush
  (``usage_drain``) added to the store under this router's id; if the store cannot take them they
  go back to the router (``usage_put_back``) and are merged into the next flush — nothing is lost
  while the router runs; at a stop, one last flush.
- **shares and budgets**, every ``[tenants] share_sync_s``: with several routers, this router's
  recent demand per quota scope is written, every live router's read, and this router's share of
  each per-minute limit computed (llmgw.tenants.shares) and given to the router; alone on its
  store its shares are all 1. Then the tokens every router has flushed for today and this month
  (``spent``) are given to the router for the budgets.
- **roll-up**, hourly and at the start, by the leader only: raw records of the hours before this
  one rolled up, then raw records past ``raw_retention_h`` and hourly ones past
  ``hourly_retention_days`` pruned.

With several routers every call runs on Leadership's own store connection in a worker thread (as
its lease and polling do), so a slow or unreachable store never stalls routing; alone on its store,
a router calls its local file through the plane's StoreGuard. A store that cannot answer costs a
round of a loop, never the router: it is said once while it lasts (where the store is met) and the
loop goes on."""

from __future__ import annotations

import calendar
import logging
import time
from collections.abc import Callable
from typing import Any

import trio

from llmgw.daemon.control.store.guard import StoreUnavailable
from llmgw.tenants.model import TenantError
from llmgw.tenants.shares import scope_key, shares
from llmgw.tenants.shares import scope_of as parse_scope

log = logging.getLogger("llmgw.tenants")

__all__ = ["UsageSync", "period_starts", "scope_key", "scope_of"]

ROLLUP_EVERY_S = 3600.0
STOP_FLUSH_S = 2.0  # the last flush at a stop waits this long at most
ROLLUP_CHECK_S = 60.0  # a router that takes the lead rolls up within this
DEMAND_STALE_SYNCS = 3  # a router's demand older than this many share_sync_s is not counted
LIVE_LEASES = 3  # a router whose row is older than this many leases is not live (daemon/control/leader.py)


def scope_of(key: str) -> tuple[str, str] | None:
    """A stored demand's scope ("tenant:a" → ("tenant", "a")), None for one this router cannot read."""
    try:
        return parse_scope(key)
    except TenantError:
        return None


def period_starts(wall: float) -> tuple[float, float]:
    """The starts of the UTC day and month holding `wall`."""
    t = time.gmtime(wall)
    return float(calendar.timegm((t.tm_year, t.tm_mon, t.tm_mday, 0, 0, 0))), float(
        calendar.timegm((t.tm_year, t.tm_mon, 1, 0, 0, 0)))


class UsageSync:
    def __init__(self, plane: Any, *, wall: Callable[[], float] = time.time) -> None:
        self.plane = plane
        self.wall = wall
        self.flushed = 0  # records written, since start
        self.flush_failures = 0
        self.rolled = 0  # raw rows rolled up by this router, since start
        self._rolled_at = -float("inf")
        # the wall time of the last drain the store took whole: the router's use settled before it is
        # in the store's spent figures (nothing was settled before the start)
        self.flushed_as_of = wall()

    @property
    def cfg(self) -> Any:
        return self.plane.cfg.tenants

    # -- the store ------------------------------------------------------------------------------------
    async def _store(self, op: str, fn: Callable[[Any], Any]) -> Any:
        """`fn(store)`: with several routers on Leadership's connection in a worker thread (a slow or
        unreachable store never stalls routing; its faults are logged once there), alone on the
        plane's through its guard (skipped while the guard is degraded: it probes by itself).
        Raises StoreUnavailable, or the store's fault, when it cannot be done."""
        ld = self.plane.leadership
        if ld is not None:
            return await ld._call(fn, ld.store)
        guard = self.plane.guard
        if guard.degraded:
            raise StoreUnavailable(guard.reason, guard.detail)
        return guard.read(op, fn)

    def _failed(self, what: str, e: Exception) -> None:
        ld = self.plane.leadership
        faults = ld.store.faults if ld is not None else self.plane.store.faults
        if not isinstance(e, (StoreUnavailable, *faults)):  # a store's fault is said where it is met
            log.error("tenants: %s failed", what, exc_info=e)

    # -- flush --------------------------------------------------------------------------------------
    async def flush(self) -> bool:
        """This router's records since the last flush into the store; kept for the next if not."""
        router, me = self.plane.router, self.plane.router_id
        drained_at = self.wall()
        records = router.usage_drain()
        if records:
            try:
                await self._store("add_usage", lambda st: st.add_usage(me, records))
            except Exception as e:  # noqa: BLE001 — kept, and said once
                router.usage_put_back(records)
                self.flush_failures += 1
                self._failed("the usage flush", e)
                return False
        self.flushed += len(records)
        self.flushed_as_of = drained_at  # put-back records come again with each drain: all of it is in
        return True

    async def flush_loop(self) -> None:
        try:
            while True:
                await trio.sleep(self.cfg.usage_flush_s)
                await self.flush()
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(STOP_FLUSH_S):  # a stop: the last records too
                await self.flush()

    # -- shares and budgets -------------------------------------------------------------------------
    def limited_scopes(self) -> list[tuple[str, str]]:
        """The scopes with a per-minute limit (rpm, tpm or concurrency): what routers share."""
        m = self.plane.tenants
        out = []
        for kind, items in (("tenant", m.tenants.items()), ("key", m.keys.items())):
            for name, obj in items:
                q = obj.quota
                if q.rpm is not None or q.tpm is not None or q.concurrency is not None:
                    out.append((kind, name))
        return out

    async def sync_shares(self) -> None:
        plane, router = self.plane, self.plane.router
        ld = plane.leadership
        if ld is None:  # alone on its store: the whole of every limit
            router.set_quota_shares({})
            return
        me, max_age = plane.router_id, DEMAND_STALE_SYNCS * self.cfg.share_sync_s
        demand = {scope_key(s): float(v) for s, v in router.quota_demand().items()}
        demand.update(plane.autoscaling.demand())  # the autoscaler's load rides in the same row (autoscaling.py)

        def exchange(st: Any) -> dict[str, dict[str, float]]:
            st.put_demand(me, demand)
            return st.demands(max_age)

        stored = await self._store("demands", exchange)
        live = set(ld.live_routers()) | {me}
        plane.autoscaling.others_read(stored, me, live)
        demands = {rid: {sc: v for k, v in d.items() if (sc := scope_of(k)) is not None}
                   for rid, d in stored.items() if rid in live}
        router.set_quota_shares(shares(self.limited_scopes(), me, demands, sorted(live)))

    async def sync_spent(self) -> None:
        day, month = period_starts(self.wall())
        as_of = self.flushed_as_of  # before the read: a flush meanwhile is counted in the figures, not twice
        spent = await self._store("spent", lambda st: st.spent(day, month))
        self.plane.router.set_spent(spent, as_of=as_of)

    async def share_loop(self) -> None:
        while True:
            for step in (self.sync_shares, self.sync_spent):
                try:
                    await step()
                except Exception as e:  # noqa: BLE001 — the router keeps its last shares and figures
                    self._failed(step.__name__, e)
            await trio.sleep(self.cfg.share_sync_s)

    # -- roll-up and retention (the leader) -----------------------------------------------------------
    async def rollup(self) -> None:
        """Roll up and prune, if this router leads and has not in the last hour."""
        now, c = self.wall(), self.cfg
        if not self.plane.leading() or now - self._rolled_at < ROLLUP_EVERY_S:
            return
        raw_before, hourly_before = now - c.raw_retention_h * 3600.0, now - c.hourly_retention_days * 86400.0

        def roll(st: Any) -> tuple[int, int]:
            return st.rollup_usage(now), st.prune_usage(raw_before, hourly_before)

        rolled, pruned = await self._store("rollup_usage", roll)
        self._rolled_at = now
        self.rolled += rolled
        if rolled or pruned:
            log.info("usage: %d raw records rolled up into hours, %d past retention pruned", rolled, pruned)

    async def rollup_loop(self) -> None:
        while True:
            try:
                await self.rollup()
            except Exception as e:  # noqa: BLE001
                self._failed("the usage roll-up", e)
            await trio.sleep(ROLLUP_CHECK_S)

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.flush_loop)
            nursery.start_soon(self.share_loop)
            nursery.start_soon(self.rollup_loop)
