"""A fast router restart: probe the engines the store says were serving, so that those still
serving are routed at once — before their agents reconnect (2.5 s to ~45 s with the agents'
backoff), which used to leave the OpenAI endpoint answering 503 meanwhile.

For each stored `run` assignment with the URL its engine last answered ready at, the probe asks
`GET /health` (200) and `GET /v1/models` (the model's name among the served ids: the port may have
been taken by another engine since). Short timeouts, bounded concurrency and an overall deadline
keep the router's start fast however many engines are gone; the URL comes from the disk, so
anything but http(s)://host:port is skipped. The agent's hello then confirms or withdraws each
replica as usual."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import trio

from llmgw.fleet.engine_cmd import health_path
from llmgw.fleet.reconcile import Assignment
from llmgw.fleet.types import EngineReport, EngineSpec

if TYPE_CHECKING:
    from llmgw.daemon.net.upstream import UpstreamPool

log = logging.getLogger("llmgw.control")

__all__ = ["PROBE_CONCURRENCY", "PROBE_DEADLINE_S", "PROBE_TIMEOUT_S", "probe_replicas", "restore_routing",
           "usable_url"]

PROBE_TIMEOUT_S = 1.0  # each request
PROBE_CONCURRENCY = 32
PROBE_DEADLINE_S = 3.0  # all of them: a router start never waits longer for this
MODELS_MAX_BYTES = 1 << 20


def usable_url(url: str) -> bool:
    """http or https, with a host and a port, and nothing after the authority but a bare path."""
    try:
        u = urlsplit(url)
        port = u.port
    except ValueError:
        return False
    return u.scheme in ("http", "https") and bool(u.hostname) and port is not None and not (u.query or u.fragment)


async def _serves(pool: UpstreamPool, spec: EngineSpec, url: str) -> bool:
    t = PROBE_TIMEOUT_S
    with trio.move_on_after(2 * t + 0.5):
        health = await pool.request(url, "GET", health_path(spec), connect_timeout=t, first_byte_timeout=t,
                                    idle_timeout=t, max_body_bytes=64 << 10)
        if health.status != 200:
            return False
        models = await pool.request(url, "GET", "/v1/models", connect_timeout=t, first_byte_timeout=t,
                                    idle_timeout=t, max_body_bytes=MODELS_MAX_BYTES)
        if models.status != 200:
            return False
        data = json.loads(models.body).get("data")
        return isinstance(data, list) and any(isinstance(d, dict) and d.get("id") == spec.model for d in data)
    return False


async def probe_replicas(pool: UpstreamPool, targets: Iterable[tuple[str, EngineSpec, str]], *,
                         deadline_s: float = PROBE_DEADLINE_S, concurrency: int = PROBE_CONCURRENCY) -> dict[str, str]:
    """targets: (replica, spec, url). Answers {replica: url} for the engines that serve their model
    there, as far as `deadline_s` allowed."""
    todo = [(rid, spec, url) for rid, spec, url in targets if usable_url(url)]
    ok: dict[str, str] = {}
    if not todo:
        return ok
    limit = trio.CapacityLimiter(concurrency)

    async def one(rid: str, spec: EngineSpec, url: str) -> None:
        async with limit:
            try:
                if await _serves(pool, spec, url):
                    ok[rid] = url
            except Exception as e:  # noqa: BLE001 — any failure means "not now": its agent will say
                log.debug("probe of %s at %s failed: %s", rid, url, e)

    with trio.move_on_after(deadline_s) as cs:
        async with trio.open_nursery() as nursery:
            for rid, spec, url in todo:
                nursery.start_soon(one, rid, spec, url)
    log.info("restart: %d of %d stored replicas answered their probe and are routed before their agents "
             "reconnect%s", len(ok), len(todo), " (the probe's deadline cut it short)" if cs.cancelled_caught else "")
    return ok


async def restore_routing(pool: UpstreamPool, assignments: Mapping[str, Assignment], urls: Mapping[str, str],
                          route: Callable[[Assignment, EngineReport], None]) -> int:
    """Probe the stored `run` assignments no agent has reported yet, at their last URL; each whose
    engine serves gets `route(assignment, a ready report)`. Answers how many."""
    waiting = [(a.replica, a.spec, urls[a.replica]) for a in assignments.values()
               if a.desired == "run" and a.report is None and a.replica in urls]
    if not waiting:
        return 0
    routed = 0
    for rid, url in (await probe_replicas(pool, waiting)).items():
        a = assignments.get(rid)
        if a is None or a.report is not None:
            continue  # its agent spoke meanwhile: its word wins
        route(a, EngineReport(replica=rid, model=a.model, state="ready", spec_hash=a.spec.spec_hash(),
                              generation=a.spec.generation, url=url,
                              detail="routed at the router's start: its engine answers; waiting for its agent"))
        routed += 1
    return routed
