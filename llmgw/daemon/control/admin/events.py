"""The admin API's event stream (``GET /api/v1/events``, NDJSON): a snapshot of every section,
then each new decision as it is made, an update carrying the sections that changed (checked every
``events_tick_s``), and a ping every ``ping_s`` so a client can tell a quiet daemon from a dead
one. docs/admin-api.md describes the lines; the console reads them (llmgw/tui)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import trio

from llmgw.daemon.control.admin.routers import routers_view
from llmgw.admin.views import decision_view, dumps
from llmgw.route.types import Decision

__all__ = ["SNAPSHOT_DECISIONS", "EventStream"]

SNAPSHOT_DECISIONS = 50  # decisions in the snapshot line


def _line(obj: Any) -> bytes:
    return (dumps(obj) + "\n").encode()


class EventStream:
    """One client's stream over an AdminApp (its control plane, router port and tick settings)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    def sections(self) -> dict[str, Any]:
        app = self.app
        c = app.control
        return {"nodes": c.node_views(), "models": c.model_views(), "replicas": c.replica_views(),
                "endpoints": app._endpoints(), "cache": app._cache(), "store": c.guard.status(),
                "adapters": app.router.adapters(), "kv": app.router.kv_summary(), "routers": routers_view(c)}

    def _new_decisions(self, seen: Decision | None) -> list[Decision]:
        ring = self.app.router.decisions()
        if not ring or ring[-1] is seen:
            return []
        new = []
        for d in reversed(ring):  # newest first, back to the last one sent (all, if it left the ring)
            if d is seen:
                break
            new.append(d)
        new.reverse()
        return new

    async def lines(self) -> AsyncIterator[bytes]:
        app = self.app
        rev = 1
        sections = self.sections()
        last = {k: dumps(v) for k, v in sections.items()}
        recent = list(app.router.decisions())[-SNAPSHOT_DECISIONS:]
        seen = recent[-1] if recent else None
        yield _line({"type": "snapshot", "rev": rev, **sections, "decisions": [decision_view(d) for d in recent]})
        now = trio.current_time()
        next_check, next_ping = now + app.events_tick_s, now + app.ping_s
        while True:
            await trio.sleep(app.decisions_poll_s)
            for d in self._new_decisions(seen):
                rev += 1
                seen = d
                yield _line({"type": "decision", "rev": rev, "decision": decision_view(d)})
            now = trio.current_time()
            if now >= next_check:
                next_check = now + app.events_tick_s
                changed = {}
                for k, v in self.sections().items():
                    text = dumps(v)
                    if text != last[k]:
                        last[k], changed[k] = text, v
                if changed:
                    rev += 1
                    yield _line({"type": "update", "rev": rev, **changed})
            if now >= next_ping:
                next_ping = now + app.ping_s
                yield _line({"type": "ping", "rev": rev})
