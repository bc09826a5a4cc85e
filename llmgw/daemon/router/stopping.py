"""A router's graceful stop (docs/ha.md "Behind a load balancer"): what `llmgw daemon` does between
SIGTERM and cancelling its tasks."""

from __future__ import annotations

import logging
from typing import Any

import trio

log = logging.getLogger("llmgw.daemon")

__all__ = ["drain_then_stop", "stopping_begins"]


def stopping_begins(router: Any, control: Any) -> None:
    """A drain begins: /ready answers 503 "draining"; evals (which go through the OpenAI port, now
    refusing connections) are cut rather than scored on refusals."""
    router.draining = True
    if cut := control.lifecycle.evals.stop():
        log.warning("%d eval job(s) under way are cut: the router is stopping", cut)


async def drain_then_stop(drain: Any, tell: Any, grace: float, signals: Any) -> None:
    """A router's graceful stop (docs/ha.md "Behind a load balancer"): its OpenAI listener closes
    (new connections are refused: clients and load balancers go to another router), /ready answers
    503 "draining", idle connections close, and requests in flight finish — each connection closing
    after its response — for up to `grace` seconds (server.shutdown_grace_s); a second signal ends
    it at once. What is still in flight after that is cut, as every task is cancelled."""
    tell()
    t0 = trio.current_time()
    n = drain.start()
    log.info("draining: %d request(s) in flight on %d connection(s); new connections are refused; waiting up to "
             "%gs for them (server.shutdown_grace_s)", n, drain.connections, grace)
    why = "grace"
    async with trio.open_nursery() as nursery:
        async def wait() -> None:
            nonlocal why
            with trio.move_on_after(grace):
                await drain.wait()
                why = "done"
            nursery.cancel_scope.cancel()

        nursery.start_soon(wait)
        async for _ in signals:
            why = "signal"
            break
        nursery.cancel_scope.cancel()
    took = trio.current_time() - t0
    if why == "done":
        log.info("drained in %.1fs: no request in flight", took)
    else:
        log.warning("%s after %.1fs: %d request(s) still in flight are cut",
                    "a second signal: stopping now" if why == "signal" else "the shutdown grace is over",
                    took, drain.in_flight)
