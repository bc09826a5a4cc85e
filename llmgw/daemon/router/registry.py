"""The router's endpoint registry: every replica's live state — the router's own inflight count,
its breaker, the last scrape against its engine's metric contract, staleness and drain rate —
and the scrape loop that keeps it fresh.

A failed scrape only marks the metrics stale (and counts a scrape error): it never trips the
breaker, since the engine may be serving fine while its /metrics is slow."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import trio

from llmgw.config import Config
from llmgw.daemon.net.upstream import UpstreamError, UpstreamPool
from llmgw.route.cache_stats import CacheStats
from llmgw.route.contract import scrape
from llmgw.route.replicas import ModelEntry, Replica, ReplicaTable

log = logging.getLogger("llmgw.router")

__all__ = ["Replica", "ModelEntry", "Registry"]  # the first two: llmgw.route.replicas


class Registry(ReplicaTable):
    """The replica table and what keeps it fresh: the scrape loop, and the cache statistics it
    feeds (the router's prefix decisions are counted there too)."""

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg)
        self.on_capacity: Any = None  # called with a replica when its cache capacity changes
        self.cache_stats = CacheStats()  # prefix decisions (the router's) and engine hit rates (scraped)

    # -- scraping ---------------------------------------------------------------------------
    async def scrape_loop(self, pool: UpstreamPool) -> None:
        interval = self.cfg.router.scrape_interval_s
        tick = 0
        while True:
            async with trio.open_nursery() as nursery:
                for rep in list(self.replicas.values()):
                    nursery.start_soon(self.scrape_one, pool, rep, tick % 10 == 0)
            tick += 1
            await trio.sleep(interval)

    async def scrape_one(self, pool: UpstreamPool, rep: Replica, models_too: bool = False) -> None:
        v = rep.view
        timeout = max(0.5, self.cfg.router.scrape_interval_s * 2)
        inflight_before = v.inflight
        try:
            with trio.fail_after(timeout):
                reply = await pool.request(v.url, "GET", "/metrics", connect_timeout=timeout,
                                           first_byte_timeout=timeout, idle_timeout=timeout,
                                           max_body_bytes=8 << 20)
            if reply.status != 200:
                raise UpstreamError(f"/metrics answered {reply.status}")
            result = scrape(v.engine, rep.metric_overrides, reply.body)
        except (UpstreamError, trio.TooSlowError, OSError) as e:
            rep.scrape_errors += 1
            rep.scrape_error = f"scrape failed: {e or type(e).__name__}"
            return
        now = trio.current_time()
        prev = rep.last_scrape
        rep.last_scrape = result
        if self.on_capacity and (prev is None or (prev.kv_blocks, prev.block_size) != (result.kv_blocks,
                                                                                       result.block_size)):
            self.on_capacity(rep)
        rep.scrape_error = "; ".join(result.errors) or None
        if result.errors:
            rep.scrape_errors += 1
        v.running, v.waiting, v.kv_usage = result.running, result.waiting, result.kv_usage
        v.scraped_at = now
        if result.prefix_hits_total is not None and result.prefix_queries_total is not None:
            self.cache_stats.engine(v.model, rep.id, result.prefix_hits_total, result.prefix_queries_total, now)
        v.inflight_at_scrape = inflight_before
        total = result.finished_total if result.finished_total is not None else rep.completed
        rep.drain.observe(now, total)
        v.drain_rate = rep.drain.rate(now)
        if models_too:
            await self._learn_models(pool, rep)

    async def _learn_models(self, pool: UpstreamPool, rep: Replica) -> None:
        """Adapters come and go at runtime (vLLM's load_lora_adapter): learn them from /v1/models."""
        try:
            with trio.fail_after(2):
                reply = await pool.request(rep.view.url, "GET", "/v1/models", connect_timeout=2,
                                           first_byte_timeout=2, idle_timeout=2)
            data = json.loads(reply.body).get("data", [])
        except Exception:  # noqa: BLE001 — a bad /v1/models never harms routing
            return
        if rep.view.engine == "llamacpp":
            await self._learn_slots(pool, rep)
        if rep.view.model in self.models:
            self.set_adapters(rep, {d["id"] for d in data if isinstance(d, dict) and d.get("parent")})

    async def _learn_slots(self, pool: UpstreamPool, rep: Replica) -> None:
        try:
            with trio.fail_after(2):
                reply = await pool.request(rep.view.url, "GET", "/slots", connect_timeout=2,
                                           first_byte_timeout=2, idle_timeout=2)
            slots = json.loads(reply.body) if reply.status == 200 else None
        except Exception:  # noqa: BLE001 — /slots may be disabled (--no-slots): keep the default
            return
        if isinstance(slots, list) and slots and len(slots) != rep.slots:
            rep.slots = len(slots)
            if self.on_capacity:
                self.on_capacity(rep)

    def snapshot(self) -> list[dict[str, Any]]:
        now = trio.current_time()
        out = []
        for r in self.replicas.values():
            v = r.view
            out.append({"id": r.id, "model": v.model, "url": v.url, "pool": v.pool, "inflight": v.inflight,
                        "running": v.running, "waiting": v.waiting, "kv_usage": v.kv_usage,
                        "stale": v.stale, "scrape_age_s": None if v.scraped_at is None else now - v.scraped_at,
                        "scrape_error": r.scrape_error, "drain_rate": v.drain_rate,
                        "breaker": r.breaker.snapshot(), "adapters": sorted(v.adapters),
                        "node": r.node, "draining": r.draining,
                        "wall": time.time()})
        return out
