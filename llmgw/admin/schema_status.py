"""The admin API's status answers (see :mod:`.schema`, which names them for the route table): the
router's own state and its store's, and the routers sharing that store (docs/ha.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from llmgw.admin.typeinfo import prop

__all__ = ["RouterView", "RoutersView", "Status", "StoreStatus"]


@dataclass(slots=True)
class StoreStatus:
    """The router's store. `degraded` while it cannot write: the router keeps running (and routing)
    from memory, admin changes that must persist answer 503, and the whole state is written back
    once the store can write again."""
    state: Literal["ok", "degraded"]
    path: str = prop("the store file")
    reason: str | None = prop("why it cannot write, in a few words: disk full, read-only, I/O error, "
                              "locked, corrupted")
    detail: str | None = prop("SQLite's own message")
    since_s: float | None = prop("how long it has been degraded")
    errors: int = prop("store operations that failed since the daemon started")
    pending_history: int = prop("history events kept in memory until the store can write")
    history_dropped: int = prop("history events lost to long faults (the oldest go first)")


@dataclass(slots=True)
class Status:
    version: str = prop("llmgw's version")
    router_id: str
    nodes: dict[str, int] = prop("node state → count")
    assignments: int = prop("replicas placed on nodes")
    partition_suspected: bool = prop("the partition guard holds losses back: a domain has most of its nodes "
                                     "holding replicas silent (one lost per interval), or no node answers (none lost)")
    control_port: int | None = prop("the agents' control listener, if it runs")
    unplaceable: dict[str, str] = prop("model → why its replicas cannot all be placed")
    store: StoreStatus
    unknown_engines: dict[str, list[str]] = prop(
        "node → engines it runs that the store does not know (a deleted or replaced store): left running, "
        "not routed, and nothing new is placed on the node; `llmgw daemon --adopt` adopts them")
    adopt: bool = prop("started with --adopt: engines the store does not know are adopted as replicas")
    kv_parity_alarms: dict[str, str] = prop(
        "replica → its model, for each replica whose tier-2 parity alarm is on: its engine's KV events never "
        "carry the block hashes the router computes (another hash algorithm, PYTHONHASHSEED, block size or "
        "vLLM release), so tier 2 cannot route to what it caches. `GET /api/v1/kv` has the details",
        factory=dict)
    role: Literal["alone", "leader", "follower"] = prop(
        "this router's part in the control plane: `alone` on its own store (it always leads), or, with "
        "several routers on one store, `leader` (it places, reconciles and writes the fleet's state) or "
        "`follower` (it routes and follows the store; its admin changes are made by the leader)", "alone")
    leader: str | None = prop("the router that leads, as this one last saw (several routers)", None)
    epoch: int = prop("the leader's lease epoch: every leader's writes carry it, and an older one is refused", 0)
    routers: int = prop("live routers on this store (1 when alone)", 1)


@dataclass(slots=True)
class RouterView:
    """One router sharing the store (its row in the store's `routers`)."""
    id: str
    role: Literal["leader", "follower", "gone"] = prop(
        "`gone`: its row has not been refreshed for 3 leases (stopped, crashed, cut off from the store)")
    this: bool = prop("the router that answered")
    host: str = prop("its host name")
    pid: int | None = prop("its process id on that host")
    worker: int | None = prop("its worker index under `llmgw daemon --workers N`")
    version: str = prop("its llmgw version")
    url: str | None = prop("its OpenAI endpoint")
    control: str | None = prop("where agents reach it")
    feed: str | None = prop("its tier-1 feed for the other routers")
    started_at: float = prop("when it started (Unix time)")
    seen_s: float = prop("seconds since it last refreshed its row, on the store's clock")
    agents: int | None = prop("agents streaming to it, as it last said")


@dataclass(slots=True)
class RoutersView:
    """The routers sharing this router's store, and who leads (docs/ha.md)."""
    this_router: str
    ha: bool = prop("several routers may share the store (PostgreSQL or `--workers`); false: a single router")
    leader: str | None = prop("the router holding the lease, as this one last saw")
    epoch: int = prop("the lease's epoch")
    lease_s: float | None = prop("the lease's length: a lost leader is replaced within it")
    leadership_changes: int = prop("times this router took or lost the lead")
    store_ok: bool = prop("this router's last call to the store succeeded")
    store_error: str | None = prop("why its last call failed")
    store_latency_ms: float | None = prop("the mean time of its calls to the store, in milliseconds")
    routers: list[RouterView] = prop("every router with a row in the store", factory=list)
