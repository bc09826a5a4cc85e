"""The router's endpoint registry: every replica's live state — the router's own inflight count,
its breaker, the last scrape against its engine's metric contract, staleness and drain rate —
and the scrape loop that keeps it fresh.

A failed scrape only marks the metrics stale (and counts a scrape error): it never trips the
breaker, since the engine may be serving fine while its /metrics is slow."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import trio

from llmgw.config import Config, ModelConfig
from llmgw.daemon.net.upstream import UpstreamError, UpstreamPool
from llmgw.route.breaker import Breaker, BreakerConfig
from llmgw.route.cache_stats import CacheStats
from llmgw.route.contract import DrainRate, ScrapeResult, scrape
from llmgw.route.types import EndpointView

log = logging.getLogger("llmgw.router")

__all__ = ["Replica", "ModelEntry", "Registry"]


@dataclass
class Replica:
    view: EndpointView
    breaker: Breaker
    metric_overrides: Any
    drain: DrainRate = field(default_factory=DrainRate)
    scrape_error: str | None = None
    scrape_errors: int = 0
    last_scrape: ScrapeResult | None = None
    completed: int = 0  # requests this router finished on it (llama.cpp has no such counter)
    slots: int | None = None  # llama.cpp: -np, from /slots (its cache is its slots' last prompts)
    served_models: frozenset[str] = frozenset()
    draining: bool = False  # leaving: no new requests, in-flight ones finish
    node: str | None = None  # the agent's node, for replicas the control plane placed

    @property
    def id(self) -> str:
        return self.view.id

    def refresh_view(self, now: float) -> None:
        """Fold the breaker's verdict into the scheduler's view (cheap; called per decision)."""
        v = self.view
        b = self.breaker
        v.available = b.can_pass(now)
        v.breaker_state = b.state
        v.retry_at = b.retry_at


@dataclass
class ModelEntry:
    name: str
    engine: str
    strategy: str
    replicas: list[Replica]
    adapters: dict[str, set[str]] = field(default_factory=dict)  # adapter -> replica ids


class Registry:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        rc = cfg.router
        self.breaker_cfg = BreakerConfig(
            failure_threshold=rc.breaker.failure_threshold, base_cooldown=rc.breaker.cooldown_s,
            max_cooldown=max(rc.breaker.max_cooldown_s, rc.breaker.cooldown_s),
            half_open_max_probes=rc.breaker.half_open_probes)
        self.pool_priority = {p.name: p.priority for p in cfg.pools}
        self.pool_cap = {p.name: p.max_inflight_per_replica for p in cfg.pools}
        self.models: dict[str, ModelEntry] = {}
        self.replicas: dict[str, Replica] = {}
        self.on_capacity: Any = None  # called with a replica when its cache capacity changes
        self.cache_stats = CacheStats()  # prefix decisions (the router's) and engine hit rates (scraped)
        for m in cfg.models:
            self.add_model(m)

    def add_model(self, m: ModelConfig) -> ModelEntry:
        if m.name in self.models:  # a redefinition keeps the live replicas
            old = self.models[m.name]
            old.engine, old.strategy = m.engine, m.strategy
            return old
        entry = ModelEntry(m.name, m.engine, m.strategy, [])
        self.models[m.name] = entry
        for i, r in enumerate(m.replicas):
            self.add_replica(m, f"{m.name}/{i}", r.url, r.pool, r.weight)
        return entry

    def add_replica(self, m: ModelConfig, rid: str, url: str, pool: str, weight: float) -> Replica:
        view = EndpointView(id=rid, model=m.name, url=url.rstrip("/"), engine=m.engine, pool=pool,
                            pool_priority=self.pool_priority.get(pool, 0), weight=weight,
                            max_inflight=self.pool_cap.get(pool))
        rep = Replica(view, Breaker(self.breaker_cfg), m.metrics)
        self.replicas[rid] = rep
        self.models[m.name].replicas.append(rep)
        return rep

    def remove_replica(self, rid: str) -> Replica | None:
        rep = self.replicas.pop(rid, None)
        if rep is None:
            return None
        entry = self.models.get(rep.view.model)
        if entry is not None:
            entry.replicas = [r for r in entry.replicas if r.id != rid]
            for ids in entry.adapters.values():
                ids.discard(rid)
            for a in [a for a, ids in entry.adapters.items() if not ids]:
                del entry.adapters[a]
        return rep

    def remove_model(self, name: str) -> list[Replica]:
        entry = self.models.pop(name, None)
        if entry is None:
            return []
        for r in entry.replicas:
            self.replicas.pop(r.id, None)
        return entry.replicas

    def resolve(self, name: str) -> tuple[ModelEntry, str | None] | None:
        """A requested model name → (base model entry, adapter or None)."""
        entry = self.models.get(name)
        if entry is not None:
            return entry, None
        for entry in self.models.values():
            if name in entry.adapters:
                return entry, name
        return None

    def views(self, entry: ModelEntry, now: float) -> list[EndpointView]:
        out = []
        for r in entry.replicas:
            if r.draining:
                continue
            r.refresh_view(now)
            r.view.stale = self.is_stale(r, now)
            out.append(r.view)
        return out

    def is_stale(self, rep: Replica, now: float) -> bool:
        at = rep.view.scraped_at
        return at is None or now - at > self.cfg.router.stale_after_s

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
        entry = self.models[rep.view.model]
        if rep.view.engine == "llamacpp":
            await self._learn_slots(pool, rep)
        adapters = {d["id"] for d in data if isinstance(d, dict) and d.get("parent")}
        rep.view.adapters = frozenset(adapters)
        for names in entry.adapters.values():
            names.discard(rep.id)
        for a in adapters:
            entry.adapters.setdefault(a, set()).add(rep.id)
        for a in [a for a, ids in entry.adapters.items() if not ids]:
            del entry.adapters[a]

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

    def all_replicas(self) -> Iterable[Replica]:
        return self.replicas.values()

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
