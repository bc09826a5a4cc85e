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

A store that cannot answer costs a round of a loop, never the router: it is logged once while it
lasts (the StoreGuard's own report) and the loop goes on."""

from __future__ import annotations

import calendar
import logging
import time
from collections.abc import Callable
from typing import Any

import trio

from llmgw.daemon.control.store.guard import StoreUnavailable

log = logging.getLogger("llmgw.tenants")

__all__ = ["UsageSync", "period_starts", "scope_key", "scope_of"]

ROLLUP_EVERY_S = 3600.0
ROLLUP_CHECK_S = 60.0  # a router that takes the lead rolls up within this
DEMAND_STALE_SYNCS = 3  # a router's demand older than this many share_sync_s is not counted
LIVE_LEASES = 3  # a router whose row is older than this many leases is not live (daemon/control/leader.py)


def scope_key(scope: tuple[str, str]) -> str:
    """("tenant", "a") → "tenant:a", as the store keeps demand."""
    return f"{scope[0]}:{scope[1]}"


def scope_of(key: str) -> tuple[str, str] | None:
    kind, sep, name = key.partition(":")
    return (kind, name) if sep and kind in ("tenant", "key") and name else None


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

    # -- flush --------------------------------------------------------------------------------------
    def flush(self) -> bool:
        """This router's records since the last flush into the store; kept for the next if not."""
        router = self.plane.router
        drained_at = self.wall()
        records = router.usage_drain()
        if not records or self.plane.guard.write("add_usage", self.plane.router_id, records):
            self.flushed += len(records)
            self.flushed_as_of = drained_at  # put-back records come again with each drain: all of it is in
            return True
        router.usage_put_back(records)
        self.flush_failures += 1
        return False

    async def flush_loop(self) -> None:
        try:
            while True:
                await trio.sleep(self.cfg.usage_flush_s)
                self.flush()
        finally:
            with trio.CancelScope(shield=True):  # a stop: the last records too
                try:
                    self.flush()
                except Exception:  # noqa: BLE001 — a stop must not fail for it
                    log.exception("the last usage flush failed")

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

    def sync_shares(self) -> None:
        plane, router = self.plane, self.plane.router
        ld = plane.leadership
        if ld is None:  # alone on its store: the whole of every limit
            router.set_quota_shares({})
            return
        me = plane.router_id
        guard = plane.guard
        demand = {scope_key(s): float(v) for s, v in router.quota_demand().items()}
        guard.write("put_demand", me, demand)
        stored = guard.read("demands", lambda st: st.demands(DEMAND_STALE_SYNCS * self.cfg.share_sync_s))
        live = set(ld.live_routers()) | {me}
        demands = {rid: {sc: v for k, v in d.items() if (sc := scope_of(k)) is not None}
                   for rid, d in stored.items() if rid in live}
        from llmgw.tenants.shares import shares  # P1's; at module level once merged

        router.set_quota_shares(shares(self.limited_scopes(), me, demands, sorted(live)))

    def sync_spent(self) -> None:
        day, month = period_starts(self.wall())
        as_of = self.flushed_as_of  # before the read: a flush meanwhile is counted in the figures, not twice
        spent = self.plane.guard.read("spent", lambda st: st.spent(day, month))
        self.plane.router.set_spent(spent, as_of=as_of)

    async def share_loop(self) -> None:
        while True:
            for step in (self.sync_shares, self.sync_spent):
                try:
                    step()
                except StoreUnavailable:
                    pass  # the guard said it; the router keeps its last shares and figures
                except Exception:  # noqa: BLE001 — a bug: said, and the next round tries again
                    log.exception("tenants: %s failed", step.__name__)
            await trio.sleep(self.cfg.share_sync_s)

    # -- roll-up and retention (the leader) -----------------------------------------------------------
    def rollup(self) -> None:
        """Roll up and prune, if this router leads and has not in the last hour."""
        now, c = self.wall(), self.cfg
        if not self.plane.leading() or now - self._rolled_at < ROLLUP_EVERY_S:
            return
        guard = self.plane.guard
        before = self.rolled
        try:
            self.rolled += guard.must_write("rollup_usage", now)
            guard.must_write("prune_usage", now - c.raw_retention_h * 3600.0, now - c.hourly_retention_days * 86400.0)
        except StoreUnavailable:
            return
        self._rolled_at = now
        if self.rolled > before:
            log.info("usage: %d raw records rolled up into hours", self.rolled - before)

    async def rollup_loop(self) -> None:
        while True:
            try:
                self.rollup()
            except Exception:  # noqa: BLE001
                log.exception("tenants: the usage roll-up failed")
            await trio.sleep(ROLLUP_CHECK_S)

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.flush_loop)
            nursery.start_soon(self.share_loop)
            nursery.start_soon(self.rollup_loop)
