"""The admin API's view of the routers sharing the store (docs/ha.md): who they are, who leads,
how this router's calls to the store fare. ``async (app, call) -> answer``; admin/server.py
registers it by route name."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from llmgw.admin.schema import RoutersView, RouterView

__all__ = ["ROUTER_HANDLERS", "routers_view"]

Handler = Callable[[Any, Any], Awaitable[Any]]


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _str(v: Any) -> str | None:
    return v if isinstance(v, str) and v else None


def routers_view(control: Any) -> RoutersView:
    ld = control.leadership
    if ld is None:
        return RoutersView(this_router=control.router_id, ha=False, leader=control.router_id, epoch=0, lease_s=None,
                           leadership_changes=0, store_ok=not control.guard.degraded,
                           store_error=control.guard.reason or None, store_latency_ms=None, routers=[])
    leading = ld.leading()
    live = ld.live_routers()
    out = []
    for rid, r in sorted(ld.routers.items()):
        info = r.info if isinstance(r.info, dict) else {}
        role = "gone" if rid not in live else "leader" if rid == ld.leader_id else "follower"
        out.append(RouterView(id=rid, role=role, this=rid == control.router_id, host=str(info.get("host", "")),
                              pid=_int(info.get("pid")), worker=_int(info.get("worker")),
                              version=str(info.get("version", "")), url=_str(info.get("url")),
                              control=_str(info.get("control")), feed=_str(info.get("feed")),
                              started_at=float(r.started_at), seen_s=round(max(0.0, float(r.age_s)), 3),
                              agents=_int(info.get("agents"))))
    lat = ld.latency
    return RoutersView(this_router=control.router_id, ha=True,
                       leader=control.router_id if leading else ld.leader_id, epoch=ld.epoch,
                       lease_s=ld.keeper.lease_s, leadership_changes=ld.keeper.changes, store_ok=ld.store_ok,
                       store_error=ld.store_error or None,
                       store_latency_ms=round(lat.total_s / lat.count * 1000, 3) if lat.count else None,
                       routers=out)


async def list_routers(app: Any, call: Any) -> Any:
    return routers_view(app.control)


ROUTER_HANDLERS: dict[str, Handler] = {"list_routers": list_routers}
