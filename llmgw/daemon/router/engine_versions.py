"""Which vLLM release each replica runs, for tier 2's hashing: ``GET /version`` once per replica
(``{"version": "0.33.0"}``, vllm-wire.md §4), remembered for ``TTL_S`` (an engine restarted with
another release is seen within that), a failure retried after ``RETRY_S``. Concurrent requests
for a replica not asked yet wait for the one call in flight.

A version tier 2 cannot hash for is a reason, not a version: the caller falls back to tier 1 and
says why — no answer, garbage, a release before 0.10.2 (int block hashes), one without the
``sha256_cbor`` algorithm kv_events engines are started with, or one newer than the hashing this
llmgw was checked against (:data:`NEWEST`): its scheme may have changed, and a silently wrong
hash would cost every request its cache hit."""

from __future__ import annotations

import json
from collections.abc import Callable

import trio

from llmgw.daemon.net.upstream import UpstreamError, UpstreamPool
from llmgw.fleet.engine_cmd import KV_HASH_ALGO
from llmgw.kv.hashing import BYTES_HASHES_SINCE, VllmVersion, supported_algos

__all__ = ["NEWEST", "RETRY_S", "TTL_S", "EngineVersions", "supported"]

NEWEST = VllmVersion(0, 33, 0)  # the newest release whose hashing the golden vectors check (any 0.33.x)
TTL_S = 300.0
RETRY_S = 10.0
MAX_REPLICAS = 4096  # URLs remembered; past it the table starts over
MAX_ANSWER_BYTES = 4096


def supported(v: VllmVersion) -> str | None:
    """None, or why tier 2 cannot hash for this release."""
    if v < BYTES_HASHES_SINCE:
        return f"vLLM {v} hashes blocks as ints (tier 2 needs {BYTES_HASHES_SINCE} or later)"
    if (v.major, v.minor) > (NEWEST.major, NEWEST.minor):
        return f"vLLM {v} is newer than the hashing this llmgw knows (up to {NEWEST.major}.{NEWEST.minor})"
    if KV_HASH_ALGO not in supported_algos(v):
        return f"vLLM {v} has no {KV_HASH_ALGO} hashing"
    return None


class EngineVersions:
    def __init__(self, pool: UpstreamPool, *, timeout: float, clock: Callable[[], float] = trio.current_time) -> None:
        self.pool = pool
        self.timeout = timeout
        self.clock = clock
        self.known: dict[str, tuple[VllmVersion | str, float]] = {}  # url -> (version or why not, until)
        self.pending: dict[str, trio.Event] = {}

    async def get(self, rid: str, url: str) -> VllmVersion | str:
        """The release ``url`` runs, or why tier 2 cannot hash for it. Never raises for the engine's faults."""
        hit = self.known.get(url)
        if hit is not None and hit[1] > self.clock():
            return hit[0]
        wait = self.pending.get(url)
        if wait is not None:
            with trio.move_on_after(self.timeout):
                await wait.wait()
            hit = self.known.get(url)
            return hit[0] if hit is not None else f"no vLLM version from {rid} yet"
        self.pending[url] = ev = trio.Event()
        try:
            found = await self._ask(rid, url)
        finally:
            del self.pending[url]
            ev.set()
        if len(self.known) >= MAX_REPLICAS:
            self.known.clear()
        ttl = TTL_S if isinstance(found, VllmVersion) else RETRY_S
        if isinstance(found, VllmVersion):
            found = supported(found) or found
        self.known[url] = (found, self.clock() + ttl)
        return found

    async def _ask(self, rid: str, url: str) -> VllmVersion | str:
        with trio.move_on_after(self.timeout):
            try:
                reply = await self.pool.request(url, "GET", "/version", max_body_bytes=MAX_ANSWER_BYTES)
            except UpstreamError as e:
                return f"no vLLM version from {rid} ({type(e).__name__})"
            if reply.status != 200:
                return f"no vLLM version from {rid} (/version answered {reply.status})"
            try:
                text = json.loads(reply.body)["version"]
                if not isinstance(text, str) or len(text) > 64:
                    raise ValueError
                return VllmVersion.parse(text)
            except (ValueError, KeyError, TypeError, RecursionError):
                return f"no vLLM version from {rid} (/version answered garbage)"
        return f"no vLLM version from {rid} (/version timed out after {self.timeout:g} s)"
