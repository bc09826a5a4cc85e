"""The daemon's human-facing ready line: ``serving sim-model at http://127.0.0.1:8000 (2/2
replicas)``, logged at info once the router can serve every model that should have replicas
(llmgw.route.readiness) — not when the listeners open, while placed engines are still starting.

Until then a warning names the models still missing, every ``warn_every_s``, and the wait goes
on: an engine that takes ten minutes to load a model is slow, not failed. The machine-readable
line on stdout (ports, sockets) is printed at once by the daemon, before this."""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from llmgw.route.readiness import Readiness

__all__ = ["POLL_S", "WARN_EVERY_S", "announce_when_ready"]

log = logging.getLogger("llmgw.daemon")

WARN_EVERY_S = 60.0
POLL_S = 0.1  # the replica table changes on the control plane's and the scrape loop's turns


def _missing(r: Readiness) -> str:
    return ", ".join(f"{m.model} ({m.routed}/{m.wanted} replicas routed, none can serve)" if m.routed
                     else f"{m.model} (0/{m.wanted} replicas routed)" for m in r.models if not m.ready)


async def announce_when_ready(check: Callable[[], Readiness], url: str, *, warn_every_s: float = WARN_EVERY_S,
                              poll_s: float = POLL_S) -> Readiness:
    """Log the ready line once ``check()`` says ready, and answer that readiness; warn meanwhile."""
    started = trio.current_time()
    warn_at = started + warn_every_s
    while True:
        r = check()
        if r.ready:
            log.info("%s", r.summary(url))
            return r
        now = trio.current_time()
        if now >= warn_at:
            log.warning("not ready after %.0f s, still waiting: %s; GET %s/ready and `llmgw ctl replicas` show "
                        "more", now - started, _missing(r), url)
            warn_at += warn_every_s
        await trio.sleep(poll_s)
