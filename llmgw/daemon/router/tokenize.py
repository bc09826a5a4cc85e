"""The shell's half of tier 2's step (llmgw.route.tier2): the HTTP call a
:class:`~llmgw.route.tier2.Tokenize` asks for — ``POST /tokenize`` or ``GET /version`` on one
replica, within the step's timeout — answered as it came (status and body, or "timeout", or the
failure's name); the core reads it, caches, extends and hashes. Concurrent asks for one replica's
``/version`` share one call. Also tier 2's Prometheus metrics."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import trio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from llmgw.daemon.net.upstream import UpstreamError, UpstreamPool
from llmgw.route.tier2 import OUTCOMES, Tier2, Tokenize

__all__ = ["Answer", "Tier2Metrics", "Tokenizer"]


@dataclass(frozen=True, slots=True)
class Answer:
    """What came back: the status and body, or (status None) ``error``."""

    status: int | None
    body: bytes = b""
    error: str = ""


class Tokenizer:
    def __init__(self, pool: UpstreamPool) -> None:
        self.pool = pool
        self.pending: dict[str, tuple[trio.Event, list[Answer]]] = {}  # url -> a /version call in flight

    async def ask(self, step: Tokenize) -> Answer:
        """Make the call `step` asks for. Never raises for the engine's faults."""
        if step.body is not None:
            return await self._call(step)
        shared = self.pending.get(step.url)
        if shared is not None:  # another request asks this replica's release now: its answer is ours
            with trio.move_on_after(step.timeout):
                await shared[0].wait()
            return shared[1][0] if shared[1] else Answer(None, error="timeout")
        self.pending[step.url] = (ev, out) = (trio.Event(), [])
        try:
            out.append(await self._call(step))
        finally:
            del self.pending[step.url]
            ev.set()
        return out[0]

    async def _call(self, step: Tokenize) -> Answer:
        post = step.body is not None
        with trio.move_on_after(step.timeout):
            try:
                reply = await self.pool.request(step.url, "POST" if post else "GET", step.path,
                                                [("content-type", "application/json")] if post else [],
                                                step.body or b"", max_body_bytes=step.max_bytes)
            except UpstreamError as e:
                return Answer(None, error=type(e).__name__)
            return Answer(reply.status, reply.body)
        return Answer(None, error="timeout")


class Tier2Metrics(Collector):
    """llmgw_kv_tokenize_total{outcome}, llmgw_kv_tokenize_cache_entries, llmgw_kv_hash_blocks_total{how},
    llmgw_kv_hash_seconds_total."""

    def __init__(self, t: Tier2) -> None:
        self.t = t

    def collect(self) -> Iterable[Metric]:
        c = CounterMetricFamily("llmgw_kv_tokenize", "Tier 2's tokenize step per request of a kv_events model, "
                                "by outcome (ok, cached; else tier 1 decided).", labels=["outcome"])
        for o in OUTCOMES:
            c.add_metric([o], float(self.t.outcomes[o]))
        yield c
        g = GaugeMetricFamily("llmgw_kv_tokenize_cache_entries", "Prompts whose block hashes tier 2 keeps.")
        g.add_metric([], float(len(self.t.cache)))
        yield g
        b = CounterMetricFamily("llmgw_kv_hash_blocks", "Tier 2's prompt blocks by how their hash was had: "
                                "hashed, reused from a prompt with the same leading tokens, or skipped (no "
                                "replica held the block before them).", labels=["how"])
        b.add_metric(["hashed"], float(self.t.chains.hashed_blocks))
        b.add_metric(["reused"], float(self.t.chains.reused_blocks))
        b.add_metric(["skipped"], float(self.t.chains.skipped_blocks))
        yield b
        yield CounterMetricFamily("llmgw_kv_hash_seconds", "CPU seconds tier 2 spent hashing prompt blocks.",
                                  value=self.t.hash_seconds)
