"""Which vLLM release each replica runs, for tier 2's hashing (pure): the answer of its
``GET /version`` (``{"version": "0.33.0"}``, vllm-wire.md §4) read and remembered by URL for
``TTL_S`` (an engine restarted with another release is seen within that), a failure for
``RETRY_S``. The shell makes the call when the core asks for it (a :class:`~.tier2.Tokenize`
step to ``/version``) and hands the answer back.

A version tier 2 cannot hash for is a reason, not a version: the caller falls back to tier 1 and
says why — no answer, garbage, a release before 0.10.2 (int block hashes), one without the
``sha256_cbor`` algorithm kv_events engines are started with, or one newer than the hashing this
llmgw was checked against (:data:`NEWEST`): its scheme may have changed, and a silently wrong
hash would cost every request its cache hit."""

from __future__ import annotations

import json

from llmgw.fleet.engine_cmd import KV_HASH_ALGO
from llmgw.kv.hashing import BYTES_HASHES_SINCE, VllmVersion, supported_algos

__all__ = ["MAX_ANSWER_BYTES", "NEWEST", "RETRY_S", "TTL_S", "EngineReleases", "read_version", "supported"]

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


def read_version(rid: str, timeout: float, status: int | None, body: bytes, error: str) -> VllmVersion | str:
    """The release in replica `rid`'s ``/version`` answer (`status`, `body`), or why there is
    none: `error` is "timeout" or the failure's name when there was no answer (`status` None)."""
    if status is None:
        if error == "timeout":
            return f"no vLLM version from {rid} (/version timed out after {timeout:g} s)"
        return f"no vLLM version from {rid} ({error})"
    if status != 200:
        return f"no vLLM version from {rid} (/version answered {status})"
    try:
        text = json.loads(body)["version"]
        if not isinstance(text, str) or len(text) > 64:
            raise ValueError
        return VllmVersion.parse(text)
    except (ValueError, KeyError, TypeError, RecursionError):
        return f"no vLLM version from {rid} (/version answered garbage)"


class EngineReleases:
    """URL -> the release it runs (or why tier 2 cannot hash for it), until when."""

    def __init__(self) -> None:
        self.known: dict[str, tuple[VllmVersion | str, float]] = {}

    def get(self, url: str, now: float) -> VllmVersion | str | None:
        """None: not known (or no longer): ask the engine."""
        hit = self.known.get(url)
        return hit[0] if hit is not None and hit[1] > now else None

    def put(self, url: str, found: VllmVersion | str, now: float) -> VllmVersion | str:
        """Remember what `url`'s ``/version`` said (read_version); the release or why not."""
        if len(self.known) >= MAX_REPLICAS:
            self.known.clear()
        ttl = TTL_S if isinstance(found, VllmVersion) else RETRY_S
        if isinstance(found, VllmVersion):
            found = supported(found) or found
        self.known[url] = (found, now + ttl)
        return found
