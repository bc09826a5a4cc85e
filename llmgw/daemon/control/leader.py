"""Several routers, one fleet: this router's place among them (docs/ha.md).

`Leadership` runs beside the control plane when routers share a store. On its own connection to
the store (every call in a worker thread, so a slow or unreachable store never stalls routing) it

- registers this router (its row in `routers`: where agents, peers and operators reach it) and
  keeps the row fresh;
- asks for the lease every `lease_s / 3` (fleet/leadership.py decides what the answers mean):
  taking it makes the plane lead with the lease's epoch — the store refuses any later write
  stamped with an older one (the fence) —, losing it makes the plane follow;
- while following, polls the store's `generation` every `poll_s` and, when it moved, reads the
  whole state and hands it to the plane (plane/follow.py);
- while leading, takes the admin writes other routers queued for it (admin/forward.py) and runs
  them through this router's admin API, answering each in the store.

A single router on its own store runs no Leadership: it always leads, at epoch 0, unfenced."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from llmgw.daemon.control.plane.follow import read_snapshot
from llmgw.daemon.control.store.port import FleetStore
from llmgw.fleet.leadership import Lead, LeaseKeeper, LeaseView, StepDown

log = logging.getLogger("llmgw.control.leader")

__all__ = ["Leadership", "StoreLatency"]

ROUTER_GONE_AFTER_LEASES = 3  # a router row not refreshed for this many leases is not live
ROUTER_FORGET_AFTER_S = 3600.0  # the leader deletes rows this old
ADMIN_KEEP_S = 3600.0  # answered or abandoned admin requests are pruned after this


@dataclass(slots=True)
class StoreLatency:
    """What the store's answers cost this router's Leadership (for /metrics and ctl routers)."""
    count: int = 0
    total_s: float = 0.0
    errors: int = 0
    last_s: float = 0.0
    buckets: dict[float, int] = field(default_factory=lambda: {b: 0 for b in (0.001, 0.005, 0.02, 0.1, 0.5, 2.0,
                                                                                float("inf"))})

    def observe(self, s: float) -> None:
        self.count += 1
        self.total_s += s
        self.last_s = s
        for b in self.buckets:
            if s <= b:
                self.buckets[b] += 1


class Leadership:
    def __init__(self, plane: Any, store: FleetStore, *, router_id: str, lease_s: float, poll_s: float,
                 info: Callable[[], dict[str, Any]]) -> None:
        """`store`: a connection of its own (not the plane's); `info`: this router's row, as it
        stands (addresses, version, ...)."""
        self.plane = plane
        self.store = store
        self.router_id = router_id
        self.keeper = LeaseKeeper(router_id, lease_s)
        self.poll_s = poll_s
        self.info = info
        self.started_at = time.time()
        self.routers: dict[str, Any] = {}  # id -> RouterRow, as last read
        self.store_ok = True
        self.store_error = ""
        self.latency = StoreLatency()
        self.followed = -1  # the generation this follower last applied
        self.follows = 0  # snapshots applied
        self.admin_app: Any = None  # set once the admin API runs: forwarded writes go through it
        self._admin_after = 0
        self._wake = trio.Event()
        self._registered = False
        self._info: dict[str, Any] | None = None
        self._pruned_at = float("-inf")
        self._took = -1  # the epoch the plane took the lead at (take_lead done); -1: it follows
        self.feed: Any = None  # the router's peer feed, when it shares tier 1 (cluster.py)
        self._feeds: dict[str, Any] = {}

    # -- what the plane asks ----------------------------------------------------------------------
    def leading(self) -> bool:
        """True while this router leads; a router that slept past its lease steps down here."""
        now = trio.current_time()
        if (sd := self.keeper.expired(now)) is not None:
            self._step_down(sd)
        # and the plane has taken the lead (its state read, its guard writing): not merely the lease
        return self.keeper.leading(now) and self._took == self.keeper.epoch

    @property
    def epoch(self) -> int:
        return self.keeper.epoch

    @property
    def leader_id(self) -> str | None:
        return self.keeper.holder

    def fenced(self) -> None:
        """The store refused a write of our epoch (StoreGuard's on_fenced)."""
        if (sd := self.keeper.fenced()) is not None:
            self._step_down(sd)
        self._wake.set()

    def live_routers(self) -> dict[str, Any]:
        limit = ROUTER_GONE_AFTER_LEASES * self.keeper.lease_s
        return {rid: r for rid, r in self.routers.items() if r.age_s <= limit}

    # -- the loops --------------------------------------------------------------------------------
    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            out = await trio.to_thread.run_sync(lambda: fn(*args), abandon_on_cancel=True)
        except Exception as e:
            self.latency.errors += 1
            if isinstance(e, self.store.faults):
                if self.store_ok:
                    log.error("store %s: %s failed: %s — %s", self.store.path, getattr(fn, "__name__", "call"),
                              self.store.describe(e), e)
                self.store_ok, self.store_error = False, f"{self.store.describe(e)}: {e}"
            raise
        self.latency.observe(time.perf_counter() - t0)
        if not self.store_ok:
            log.warning("store %s answers again", self.store.path)
        self.store_ok, self.store_error = True, ""
        return out

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._lease_loop)
                nursery.start_soon(self._poll_loop)
                task_status.started()
        finally:  # a clean stop gives the lease back: another router leads at once, not after it expires
            with trio.CancelScope(shield=True):
                await self.stop()

    def _deaf(self) -> str | None:
        """Why this router should not lead: it hears no agent while another live router hears some
        (cut off from the nodes, it could neither tell them anything nor see them). None: it may."""
        if self.info().get("agents", 0):
            return None
        for rid, r in self.live_routers().items():
            n = r.info.get("agents") if isinstance(r.info, dict) else None
            if rid != self.router_id and isinstance(n, int) and n > 0:
                return f"it hears no agent while router {rid} hears {n}"
        return None

    async def _lease_loop(self) -> None:
        deaf_rounds = 0
        while True:
            sent = trio.current_time()
            deaf = self._deaf()
            deaf_rounds = deaf_rounds + 1 if deaf else 0
            try:
                if deaf and self.keeper.leading(sent) and deaf_rounds >= 3:  # a whole lease of it: yield
                    log.warning("router %s gives up the lead: %s", self.router_id, deaf)
                    if (sd := self.keeper.resign(deaf)) is not None:
                        self._step_down(sd)
                    await self._release()
                    row = await self._call(self.store.lease)
                elif deaf and not self.keeper.leading(sent):  # does not stand: only looks
                    row = await self._call(self.store.lease)
                else:
                    row = await self._call(self.store.try_lead, self.router_id, self.keeper.lease_s)
            except Exception as e:  # noqa: BLE001 — a store fault, or a bug: the lease is not renewed
                if not isinstance(e, self.store.faults):
                    log.exception("asking for the lease failed")
                change: Lead | StepDown | None = self.keeper.unreachable(trio.current_time())
            else:
                if row is None:  # no lease at all yet
                    change = None
                else:
                    change = self.keeper.renewed(LeaseView(row.holder, row.epoch, row.mine), sent)
            if isinstance(change, Lead):
                await self._lead(change.epoch)
            elif isinstance(change, StepDown):
                self._step_down(change)
            with trio.move_on_after(self.keeper.interval_s):
                await self._wake.wait()
            self._wake = trio.Event()

    async def _lead(self, epoch: int) -> None:
        try:
            snap = await self._call(read_snapshot, self.store)
        except Exception as e:  # noqa: BLE001
            if not isinstance(e, self.store.faults):
                log.exception("reading the state to take the lead failed")
            self.keeper.fenced()  # not leading after all: the plane was never told
            log.warning("router %s does not take the lead (epoch %d): the store's state could not be read; "
                        "the lease is given back", self.router_id, epoch)
            await self._release()
            return
        if not self.keeper.leading(trio.current_time()):
            return  # the read took longer than the lease
        log.warning("router %s leads the control plane (epoch %d)", self.router_id, epoch)
        self.followed = snap.generation
        self.plane.take_lead(epoch, snap)
        self._took = epoch

    def _step_down(self, sd: StepDown) -> None:
        self._took = -1
        log.warning("router %s no longer leads: %s", self.router_id, sd.reason)
        self.plane.step_down(sd.reason)
        self.followed = -1  # follow the store from a fresh snapshot
        self._wake.set()

    async def _release(self) -> None:
        try:
            await self._call(self.store.release_lead, self.router_id)
        except Exception:  # noqa: BLE001 — it expires by itself
            pass

    async def _poll_loop(self) -> None:
        while True:
            try:
                await self._poll_once()
            except Exception as e:  # noqa: BLE001 — a store fault is counted in _call; anything else is a bug
                if not isinstance(e, self.store.faults):
                    log.exception("following the store failed; retrying")
            await trio.sleep(self.poll_s)

    async def _poll_once(self) -> None:
        info = self.info()
        if not self._registered:
            await self._call(lambda: self.store.register_router(self.router_id, info, started_at=self.started_at))
            self._registered = True
            self._info = info
        elif info != self._info:
            await self._call(lambda: self.store.register_router(self.router_id, info, started_at=self.started_at))
            self._info = info
        else:
            await self._call(self.store.router_seen, self.router_id)
        before = set(self.live_routers())
        self.routers = await self._call(self.store.routers)
        if set(self.live_routers()) != before:
            self.plane.routers_changed()
        feeds = {rid: r.info.get("feed") for rid, r in self.live_routers().items()
                 if isinstance(r.info, dict) and r.info.get("feed")}
        if feeds != self._feeds and self.feed is not None:
            self._feeds = feeds
            self.feed.set_peers(feeds)  # tier 1 shared with every live router (daemon/router/peer_feed.py)
        if self.leading():
            await self._serve_admin_queue()
            return
        gen = await self._call(self.store.generation)
        if gen != self.followed:
            snap = await self._call(read_snapshot, self.store)
            if not self.leading():  # the lead may have come meanwhile: _lead applied its own
                self.plane.follow(snap)
                self.followed = snap.generation
                self.follows += 1

    async def _serve_admin_queue(self) -> None:
        if self.admin_app is None:
            return
        epoch = self.keeper.epoch
        for qid, request in await self._call(self.store.admin_requests, epoch, self._admin_after):
            self._admin_after = max(self._admin_after, qid)
            answer = await self.admin_app.run_forwarded(request)
            await self._call(self.store.answer_admin, qid, answer)
        now = trio.current_time()
        if now - self._pruned_at >= 60.0:
            self._pruned_at = now
            await self._call(self.store.prune_admin, ADMIN_KEEP_S)
            for rid, r in self.routers.items():
                if r.age_s > ROUTER_FORGET_AFTER_S and rid != self.router_id:
                    await self._call(self.store.forget_router, rid)

    async def stop(self) -> None:
        """A clean stop: the lease is given back so another router leads at once."""
        if self.keeper.leading(trio.current_time()):
            with trio.move_on_after(2):
                await self._release()


class LeadershipMetrics:
    """The cluster's figures for the router's /metrics (a prometheus_client Collector)."""

    def __init__(self, ld: Leadership, forwarder: Any = None) -> None:
        self.ld = ld
        self.forwarder = forwarder

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        ld = self.ld
        g = GaugeMetricFamily("llmgw_leader", "1 while this router leads the control plane (several routers).")
        g.add_metric([], 1.0 if ld.leading() else 0.0)
        yield g
        e = GaugeMetricFamily("llmgw_leader_epoch", "The lease's epoch as this router last saw it.")
        e.add_metric([], float(ld.epoch))
        yield e
        c = CounterMetricFamily("llmgw_leadership_changes", "Times this router took or lost the lead.")
        c.add_metric([], ld.keeper.changes)
        yield c
        r = GaugeMetricFamily("llmgw_routers_live", "Routers whose row in the shared store is fresh.")
        r.add_metric([], float(len(ld.live_routers())))
        yield r
        f = CounterMetricFamily("llmgw_store_follows", "Snapshots of the store's state a follower applied.")
        f.add_metric([], ld.follows)
        yield f
        lat = ld.latency
        h = HistogramMetricFamily("llmgw_leadership_store_call_seconds",
                                  "How long this router's cluster calls to the store took (lease, poll, follow).")
        cum, buckets = 0, []
        for b, n in sorted(lat.buckets.items()):
            cum = n  # observe() counts each call in every bucket it fits: already cumulative
            buckets.append(("+Inf" if b == float("inf") else repr(b), cum))
        h.add_metric([], buckets, sum_value=lat.total_s)
        yield h
        err = CounterMetricFamily("llmgw_leadership_store_call_errors", "This router's cluster calls to the store that failed.")
        err.add_metric([], lat.errors)
        yield err
        if self.forwarder is not None:
            fw = CounterMetricFamily("llmgw_admin_forwarded", "Admin changes this follower handed to the leader, by "
                                     "outcome.", labels=["outcome"])
            fw.add_metric(["answered"], self.forwarder.forwarded)
            fw.add_metric(["failed"], self.forwarder.failed)
            yield fw
