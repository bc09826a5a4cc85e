"""The control plane's side of several routers on one store (docs/ha.md): whether it leads, and
what taking, losing and following the lead do to it. ControlPlane (plane/plane.py) is a
`Leading`; daemon/control/leader.py drives it (take_lead, step_down, follow, routers_changed) and
the agents' sessions ask it (leading, epoch, router_addrs)."""

from __future__ import annotations

from typing import Any

import trio

from llmgw.daemon.control.plane.config_reload import load_models, reconcile_file
from llmgw.daemon.control.plane.follow import Snapshot, apply_snapshot, router_addrs
from llmgw.fleet.types import RouterAddr

__all__ = ["Leading"]


class Leading:
    """A mixin of ControlPlane: `self` has its store, guard, agents, nodes, cfg and leadership."""

    leadership: Any
    router_id: str
    store: Any
    guard: Any
    agents: Any
    nodes: Any
    cfg: Any
    _wake: trio.Event
    _from_store: set[str]
    _settle_until: float

    def leading(self) -> bool:
        """Whether this router's control plane acts: places, reconciles, sends desired sets, writes
        the store. Always, for a router alone on its store."""
        return self.leadership is None or self.leadership.leading()

    def epoch(self) -> int:
        """The lease's epoch this router leads with (agents refuse a desired set of an older one); a
        router alone on its store leads at epoch 1."""
        return 1 if self.leadership is None else self.leadership.epoch

    def follow(self, snap: Snapshot) -> None:
        """A follower: the store's state, as read (plane/follow.py)."""
        apply_snapshot(self, snap)

    def take_lead(self, epoch: int, snap: Snapshot) -> None:
        """This router now leads at `epoch`: its writes carry the epoch (the store refuses them once
        another router leads), its memory starts from the store, its config file's models are applied
        as at a start, jobs in flight resume, and every agent is sent its desired set."""
        self.store.set_fence(self.router_id, epoch)
        self.guard.active = True
        apply_snapshot(self, snap, resume=True)
        load_models(self, snap.state.models)
        reconcile_file(self)
        now = trio.current_time()
        # Nodes whose agents have not reached this router yet get the settle time to do so.
        self._from_store = {n for n, node in self.nodes.nodes.items() if not node.connected}
        self._settle_until = now + self.cfg.control.settle_s
        self.agents.leadership_changed()
        self._wake.set()

    def step_down(self, reason: str) -> None:
        """Another router leads (or may): stop acting at once; follow the store from now on."""
        self.guard.active = False
        self.agents.leadership_changed()

    def routers_changed(self) -> None:
        """The live routers changed: agents are told where to reach each."""
        self.agents.routers_changed()

    def router_addrs(self) -> list[RouterAddr]:
        """Every live router's control address and TLS pin, for the agents (fleet/wire.py RouterAddr)."""
        if self.leadership is None:
            return []
        return router_addrs(self.leadership.live_routers())


    def _ha_summary(self) -> dict[str, Any]:
        """`status`'s fields for several routers (none for a router alone)."""
        ld = self.leadership
        if ld is None:
            return {}
        leading = self.leading()
        return {"role": "leader" if leading else "follower", "leader": self.router_id if leading else ld.leader_id,
                "epoch": ld.epoch, "routers": max(1, len(ld.live_routers()))}
