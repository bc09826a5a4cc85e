"""Wiring a router into a cluster of routers sharing one store (docs/ha.md): the daemon asks
`is_shared` before it builds the control plane, then `join` once its listeners are open.

A router is one of several when its store is PostgreSQL, or when it is a worker of
`llmgw daemon --workers N` (which share one SQLite file on one host). Alone on its store — the
embedded default, any single router on SQLite — it runs none of this and always leads."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from typing import Any

import trio

from llmgw import __version__
from llmgw.daemon.control.admin.forward import Forwarder
from llmgw.daemon.control.leader import Leadership, LeadershipMetrics
from llmgw.daemon.control.store.port import FleetStore

log = logging.getLogger("llmgw.control.leader")

__all__ = ["RouterInfo", "is_shared", "join"]


def is_shared(cfg: Any, store: FleetStore, *, worker: int | None = None) -> bool:
    """Whether other routers may share this store: a PostgreSQL one, the SQLite file of
    `--workers`, or one `[store] shared` says other routers on this host use."""
    return worker is not None or bool(getattr(store, "shared", False)) or bool(cfg.store.shared)


class RouterInfo:
    """This router's row in the store's `routers`, filled in as its listeners open."""

    def __init__(self, worker: int | None = None) -> None:
        self.fields: dict[str, Any] = {"host": socket.gethostname(), "pid": os.getpid(), "version": __version__}
        if worker is not None:
            self.fields["worker"] = worker
        self.agents: Callable[[], int] = lambda: 0

    def update(self, **kw: Any) -> None:
        self.fields.update({k: v for k, v in kw.items() if v is not None})

    def __call__(self) -> dict[str, Any]:
        return {**self.fields, "agents": self.agents()}


async def join(nursery: trio.Nursery, cfg: Any, control: Any, store: FleetStore, info: RouterInfo,
               admin_app: Any, registry: Any = None, router: Any = None) -> Leadership:
    """Start this router's Leadership on `store` (a connection of its own) and hand the admin API
    its forwarder. The plane was built a follower (ControlPlane(shared=True)): it acts once it leads."""
    lease_s, poll_s = cfg.store.lease_s, cfg.store.poll_s
    ld = Leadership(control, store, router_id=control.router_id, lease_s=lease_s, poll_s=poll_s, info=info)
    control.leadership = ld
    control.guard.on_fenced = lambda _e: ld.fenced()
    info.agents = lambda: sum(1 for n in control.nodes.nodes.values() if n.connected)
    ld.admin_app = admin_app
    if router is not None:  # tier 1 shared with the other routers (daemon/router/peer_feed.py)
        from llmgw.daemon.router.peer_feed import start_peer_feed

        key = await ld._call(store.cluster_secret)
        ld.feed = start_peer_feed(router, nursery, key, router_id=control.router_id)
        info.update(feed=ld.feed.address)
    admin_app.forwarder = Forwarder(ld)
    if registry is not None:
        registry.register(LeadershipMetrics(ld, admin_app.forwarder))
    await nursery.start(ld.run)
    log.info("router %s shares its store %s with other routers: lease %gs, polling every %gs", control.router_id,
             store.path, lease_s, poll_s)
    return ld
