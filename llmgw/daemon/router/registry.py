"""The router's endpoint registry: every replica's live state — the router's own inflight count,
its breaker, the last scrape against its engine's metric contract, staleness and drain rate —
and the scrape loop that keeps it fresh.

A failed scrape only marks the metrics stale (and counts a scrape error): it never trips the
breaker, since the engine may be serving fine while its /metrics is slow.

What an engine answers is untrusted input: each answer is read under its own small cap
(:mod:`llmgw.route.engine_answers`; an answer over it is dropped as it arrives, its connection
closed), parsed by code that names what is wrong instead of raising, and no exception from a
replica's URL or answer leaves :meth:`Registry.scrape_one`: the replica is marked (its
``scrape_error``), the failure counted, and logged when it starts, then at most once a minute
(with the URL, and how often it failed meanwhile)."""

from __future__ import annotations

import logging
import time
from typing import Any

import trio

from llmgw.config import Config
from llmgw.daemon.net.log_limit import LogLimiter, repeats
from llmgw.daemon.net.upstream import UpstreamError, UpstreamPool
from llmgw.route.cache_stats import CacheStats
from llmgw.route.engine_answers import (
    MAX_LORA_BYTES,
    MAX_METRICS_BYTES,
    MAX_MODELS_BYTES,
    MAX_SLOTS_BYTES,
    BadAnswer,
    adapters_of,
    lora_adapters_of,
    restarted,
    slot_count_of,
)
from llmgw.route.metric_reader import MetricReader
from llmgw.route.replicas import ModelEntry, Replica, ReplicaTable
from llmgw.route.scrape_pace import ScrapePace

log = logging.getLogger("llmgw.router")

__all__ = ["Replica", "ModelEntry", "Registry"]  # the first two: llmgw.route.replicas

_PATHS = ("/metrics", "/v1/models", "/slots", "/lora-adapters")
_EXPECTED = (UpstreamError, trio.TooSlowError, OSError, BadAnswer)  # logged without a traceback


class Registry(ReplicaTable):
    """The replica table and what keeps it fresh: the scrape loop, and the cache statistics it
    feeds (the router's prefix decisions are counted there too)."""

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg)
        self.on_capacity: Any = None  # called with a replica when its cache capacity changes
        self.on_scraped: Any = None  # called with a replica after each read of its /metrics (or failure)
        self._soon = trio.Event()  # set by scrape_soon: the next round starts early
        # called with (replica, adapters listed, when asked) after each /v1/models; None: set_adapters
        self.on_adapters: Any = None
        self.cache_stats = CacheStats()  # prefix decisions (the router's) and engine hit rates (scraped)
        # failed reads of /v1/models, /slots, /lora-adapters by (replica id, path); /metrics: Replica.scrape_errors
        self.answer_errors: dict[tuple[str, str], int] = {}
        self._faults = LogLimiter(60.0)
        rc = cfg.router
        # when each replica is read next: every round while busy, less often while idle
        self.pace = ScrapePace(rc.scrape_interval_s, rc.scrape_idle_factor, rc.stale_after_s)
        self._readers: dict[str, tuple[Replica, MetricReader]] = {}  # by replica id: its readings

    # -- scraping ---------------------------------------------------------------------------
    async def scrape_loop(self, pool: UpstreamPool) -> None:
        """A round every scrape interval (a quarter of one after scrape_soon): the replicas due
        (``self.pace``: all of them every round while anything happens, idle ones less often)
        are read, each its /metrics, and every tenth interval its slow answers too."""
        interval = self.cfg.router.scrape_interval_s
        pace = self.pace
        while True:
            now = trio.current_time()
            async with trio.open_nursery() as nursery:
                for rep in list(self.replicas.values()):
                    # never read (new, or re-added under the same id within a round): at once, whole
                    first = rep.view.scraped_at is None
                    if first or pace.due(rep.id, now, rep.view.inflight, rep.completed):
                        nursery.start_soon(self.scrape_one, pool, rep, pace.models_due(rep.id, now) or first)
            self._forget_gone()
            self._soon = trio.Event()
            await trio.sleep(interval / 4)  # the shortest gap, however often scrape_soon is asked
            with trio.move_on_after(interval * 3 / 4):
                await self._soon.wait()
            if self._soon.is_set():
                pace.hurry()  # requests wait for room: every replica read now, at the normal cadence

    def scrape_soon(self) -> None:
        """A request waits for room the last readings do not show: read the engines again at
        the earliest (a quarter interval after the last round), not a whole interval later."""
        self._soon.set()

    def _forget_gone(self) -> None:
        ids = self.replicas
        self._faults.keep({(rid, p) for rid in ids for p in _PATHS})
        self.pace.keep(ids)
        for rid in [r for r in self._readers if r not in ids]:
            del self._readers[rid]
        for key in [k for k in self.answer_errors if k[0] not in ids]:
            del self.answer_errors[key]

    async def scrape_one(self, pool: UpstreamPool, rep: Replica, models_too: bool = False) -> None:
        """Scrape one replica (and, with ``models_too``, learn its adapters and slots).
        Never raises but Cancelled: whatever its URL or answers do is caught here."""
        prev = rep.last_scrape
        quiet = False
        try:
            quiet = await self._scrape_metrics(pool, rep)
        except Exception as e:  # noqa: BLE001 — an engine's URL and answers are untrusted input
            self._failed(rep, "/metrics", e)
            return
        finally:
            self.pace.read(rep.id, trio.current_time(), quiet=quiet, completed=rep.completed)
            if self.on_scraped is not None:  # a reading that shows room lets waiters through
                self.on_scraped(rep)
        if not models_too and rep.last_scrape is not prev and restarted(prev, rep.last_scrape):
            models_too = True  # its adapters (and llama.cpp's ids) are learned again now, not in 10 scrapes
        if (n := self._faults.clear((rep.id, "/metrics"), trio.current_time())) is not None:
            log.info("replica %s: /metrics answers again%s", rep.id, repeats(n), extra={"endpoint": rep.id})
        # llama.cpp's adapter ids: at once for a new replica, then with the slow round
        if self._lora_by_id(rep) and (models_too or rep.lora_ids is None):
            try:
                await self._learn_lora(pool, rep)
            except Exception as e:  # noqa: BLE001 — unusable: its adapters leave it, base requests go on
                self.set_lora_ids(rep, None)
                self._failed(rep, "/lora-adapters", e)
        if not models_too:
            return
        try:
            await self._learn_models(pool, rep)
        except Exception as e:  # noqa: BLE001 — a bad /v1/models never harms routing
            self._failed(rep, "/v1/models", e)
        if rep.view.engine == "llamacpp" and rep.slots is None:  # -np is fixed for the engine's life
            try:
                await self._learn_slots(pool, rep)
            except Exception as e:  # noqa: BLE001 — /slots may be off (--no-slots): keep the default
                self._failed(rep, "/slots", e)

    def _failed(self, rep: Replica, path: str, e: Exception) -> None:
        text = str(e) or type(e).__name__
        if path == "/metrics":
            rep.scrape_errors += 1
            rep.scrape_error = f"scrape failed: {text}"
        else:
            key = (rep.id, path)
            self.answer_errors[key] = self.answer_errors.get(key, 0) + 1
        n = self._faults.hit((rep.id, path), trio.current_time())
        if n is not None:
            log.warning("replica %s: %s from %s failed: %s%s", rep.id, path, rep.view.url, text, repeats(n),
                        exc_info=None if isinstance(e, _EXPECTED) else e, extra={"endpoint": rep.id})

    async def _get(self, pool: UpstreamPool, rep: Replica, path: str, timeout: float, cap: int) -> bytes | None:
        """GET ``path`` from the replica: its body (at most ``cap`` bytes), None when the engine
        has no such route (404, 501: e.g. llama.cpp's --no-slots), or raise."""
        with trio.fail_after(timeout):
            reply = await pool.request(rep.view.url, "GET", path, connect_timeout=timeout,
                                       first_byte_timeout=timeout, idle_timeout=timeout, max_body_bytes=cap)
        if reply.status in (404, 501) and path != "/metrics":
            return None
        if reply.status != 200:
            raise UpstreamError(f"{path} answered {reply.status}")
        return reply.body

    def reader(self, rep: Replica) -> MetricReader:
        """The replica's readings (a new reader for a new replica, engine kind or overrides)."""
        got = self._readers.get(rep.id)
        if got is not None and got[0] is rep:
            reader = got[1].for_engine(rep.view.engine, rep.metric_overrides)
        else:
            reader = MetricReader(rep.view.engine, rep.metric_overrides)
        if got is None or got[1] is not reader:
            self._readers[rep.id] = (rep, reader)
        return reader

    async def _scrape_metrics(self, pool: UpstreamPool, rep: Replica) -> bool:
        """Read the replica's /metrics into its view. True: a quiet reading (nothing the contract
        reads moved, the engine runs and queues nothing, no request of ours was on it)."""
        v = rep.view
        inflight_before = v.inflight
        body = await self._get(pool, rep, "/metrics", max(0.5, self.cfg.router.scrape_interval_s * 2),
                               MAX_METRICS_BYTES)
        reader = self.reader(rep)
        result = reader.read(body or b"")  # the last result again when nothing it reads moved
        del body
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
        return (result is prev and not result.errors and inflight_before == 0 and v.inflight == 0
                and not result.running and not result.waiting)

    async def _learn_models(self, pool: UpstreamPool, rep: Replica) -> None:
        """Adapters come and go at runtime (vLLM's load_lora_adapter): learn them from /v1/models."""
        asked_at = trio.current_time()
        body = await self._get(pool, rep, "/v1/models", 2, MAX_MODELS_BYTES)
        if body is None:
            return
        adapters = adapters_of(body)
        if rep.view.model in self.models and self.replicas.get(rep.id) is rep and not self._lora_by_id(rep):
            if self.on_adapters is not None:
                self.on_adapters(rep, adapters, asked_at)
            else:
                self.set_adapters(rep, adapters)
        self._faults.clear((rep.id, "/v1/models"), trio.current_time())

    def _lora_by_id(self, rep: Replica) -> bool:
        """llama.cpp replicas of a model with declared adapters: their adapters are learned from
        /lora-adapters (its /v1/models lists none) and applied by id in each request."""
        entry = self.models.get(rep.view.model)
        return rep.view.engine == "llamacpp" and entry is not None and bool(entry.declared)

    async def _learn_lora(self, pool: UpstreamPool, rep: Replica) -> None:
        body = await self._get(pool, rep, "/lora-adapters", 2, MAX_LORA_BYTES)
        if body is None:  # no such route: an engine without LoRA
            self.set_lora_ids(rep, {})
            return
        by_path = lora_adapters_of(body)
        if rep.view.model in self.models:
            self.set_lora_ids(rep, by_path)
        self._faults.clear((rep.id, "/lora-adapters"), trio.current_time())

    async def _learn_slots(self, pool: UpstreamPool, rep: Replica) -> None:
        body = await self._get(pool, rep, "/slots", 2, MAX_SLOTS_BYTES)
        if body is None:
            return
        n = slot_count_of(body)
        self._faults.clear((rep.id, "/slots"), trio.current_time())
        if n != rep.slots:
            rep.slots = n
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
                        "node": r.node, "draining": r.draining, "role": v.role,
                        "wall": time.time()})
        return out
