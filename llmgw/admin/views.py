"""The admin API's answers from the core's own types, and their JSON form.

The control plane and the admin app build their answers as the schema's dataclasses
(llmgw.admin.schema); the builders here make the ones that come from other parts of the core —
a routing decision (llmgw.route.types.Decision), the cache-hit summary (CacheStats.summary's
dict), a breaker's snapshot, an engine's last scrape, a node's facts. ``dumps`` writes an answer
as JSON at the HTTP edge: each dataclass becomes an object with its fields in declaration order,
so the schema's field order is the wire's."""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any

from llmgw.admin.schema import (
    AdapterFailure,
    AdapterHeld,
    AdapterSummary,
    BreakerView,
    CacheCounts,
    CacheSummary,
    CandidateView,
    DecisionView,
    DropView,
    GpuFacts,
    ModelCache,
    NodeFacts,
    ReplicaAdapters,
    ReplicaCache,
    ScrapedMetrics,
)
from llmgw.fleet import types as fleet
from llmgw.route.adapters import AdapterBook
from llmgw.route.contract import ScrapeResult
from llmgw.route.types import Decision

__all__ = ["breaker_view", "cache_summary_view", "decision_view", "dumps", "node_facts_view",
           "scraped_metrics_view"]

_FIELDS: dict[type, tuple[str, ...]] = {}


def dumps(obj: Any) -> str:
    """``obj`` as compact JSON text (UTF-8 left as is): dataclasses as objects with their fields in
    order, tuples as arrays, everything else as json.dumps writes it."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, default=_as_object)


def _as_object(obj: Any) -> dict[str, Any]:
    cls = type(obj)
    names = _FIELDS.get(cls)
    if names is None:
        if not hasattr(cls, "__dataclass_fields__") or isinstance(obj, type):
            raise TypeError(f"Object of type {cls.__name__} is not JSON serializable")
        names = _FIELDS[cls] = tuple(f.name for f in fields(obj))
    return {n: getattr(obj, n) for n in names}


def decision_view(d: Decision) -> DecisionView:
    return DecisionView(
        request_id=d.request_id, model=d.model, strategy=d.strategy, picker=d.picker, chosen=d.chosen,
        weights=d.weights,
        candidates=[CandidateView(c.endpoint_id, c.scores, c.total, list(c.flags)) for c in d.candidates],
        n_candidates=d.n_candidates, dropped=[DropView(x.filter, x.endpoint_id, x.reason) for x in d.dropped],
        decided_at=d.decided_at, decide_us=d.decide_us, note=d.note, tenant=d.tenant, band=d.band, share=d.share,
        phase=d.phase)


def _counts(c: dict[str, Any]) -> dict[str, Any]:
    return {k: c[k] for k in ("prefix_hits", "prefix_misses", "prefix_hit_rate", "engine_hit_tokens",
                              "engine_query_tokens", "engine_hit_rate", "prefix_hit_rate_series",
                              "engine_hit_rate_series")}


def adapter_summary_view(book: AdapterBook, now: float, models: dict[str, str],
                         model: str | None = None) -> AdapterSummary:
    """From the router's adapter book (``llmgw.route.adapters``); ``models``: replica → model."""
    reps = []
    for row in book.snapshot(now):
        rid = str(row["replica"])
        m = models.get(rid, "")
        if model is not None and m != model:
            continue
        held = [AdapterHeld(adapter=a["adapter"], state=a["state"], inflight=a["inflight"], idle_s=a["idle_s"],
                            waiting=a.get("waiting", 0), unloading=a.get("unloading"))
                for a in row["adapters"]]  # type: ignore[attr-defined]
        failed = [AdapterFailure(**f) for f in row["failed"]]  # type: ignore[attr-defined]
        reps.append(ReplicaAdapters(replica=rid, model=m, cap=row["cap"], used=row["used"],  # type: ignore[arg-type]
                                    adapters=held, failed=failed))
    return AdapterSummary(replicas=reps, loads=dict(book.loads_total), unloads=dict(book.unloads_total),
                          waiting=book.waiting())


def cache_summary_view(s: dict[str, Any]) -> CacheSummary:
    """From ``llmgw.route.cache_stats.CacheStats.summary()``."""
    return CacheSummary(window_s=s["window_s"], bucket_s=s["bucket_s"], total=CacheCounts(**_counts(s["total"])),
                        models=[ModelCache(**_counts(m), model=m["model"]) for m in s["models"]],
                        replicas=[ReplicaCache(**_counts(r), replica=r["replica"], model=r["model"])
                                  for r in s["replicas"]])


def breaker_view(b: dict[str, Any]) -> BreakerView:
    """From ``llmgw.route.breaker.Breaker.snapshot()``."""
    return BreakerView(
        state=b["state"], retry_at=b["retry_at"], cooldown=b["cooldown"],
        consecutive_failures=b["consecutive_failures"], probes_in_flight=b["probes_in_flight"],
        half_open_successes=b["half_open_successes"], changed_at=b["changed_at"], opened_total=b["opened_total"],
        failures_total=b["failures_total"], successes_total=b["successes_total"], last_failure=b["last_failure"],
        last_failure_at=b["last_failure_at"])


def scraped_metrics_view(s: ScrapeResult | None) -> ScrapedMetrics | None:
    if s is None:
        return None
    return ScrapedMetrics(
        engines=s.engines, finished_total=s.finished_total, prefix_queries_total=s.prefix_queries_total,
        prefix_hits_total=s.prefix_hits_total, kv_blocks=s.kv_blocks, block_size=s.block_size,
        kv_capacity_tokens=s.kv_capacity_tokens, lora_max=s.lora_max, lora_running=list(s.lora_running),
        lora_waiting=list(s.lora_waiting), errors=list(s.errors))


def node_facts_view(f: fleet.NodeFacts) -> NodeFacts:
    """What the agent found, as the API shows it (``extra`` is not shown, as it is not sent)."""
    return NodeFacts(cpus=f.cpus, memory_mb=f.memory_mb, hostname=f.hostname, agent_version=f.agent_version,
                     gpus=[GpuFacts(g.index, g.name, g.memory_mb) for g in f.gpus],
                     declared_watts=f.declared_watts, measured_watts=f.measured_watts)
