"""Types shared by the router's pure core: the scheduler's settings, what it knows of an endpoint
and of a request, and the decision it records. The trio shell fills these; the core only reads them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import Any

from .hashring import DEFAULT_C, DEFAULT_VNODES

__all__ = ["SchedulerConfig", "EndpointView", "RequestInfo", "Candidate", "FilterDrop", "Decision", "TenantTag"]


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    kv_ceiling: float = 0.95  # kv_usage at or above this vetoes a replica (preemption territory)
    # Load estimate (running + waiting + our starts since the scrape) at which a replica without
    # an admission cap counts as saturated, for pool spill-over and admission. None = never.
    saturation_load: float | None = 64.0
    bounded_load_c: float = DEFAULT_C  # session affinity: load bound c × mean (Mirrokni et al.)
    ring_vnodes: int = DEFAULT_VNODES
    record_candidates: int = 8  # candidates kept in the Decision (the best by total + the pick)

    def __post_init__(self) -> None:
        if not 0 < self.kv_ceiling <= 1:
            raise ValueError(f"kv_ceiling must be in (0, 1], got {self.kv_ceiling}")
        if self.saturation_load is not None and not self.saturation_load > 0:
            raise ValueError(f"saturation_load must be > 0 or None, got {self.saturation_load}")
        if not (self.bounded_load_c >= 1 and math.isfinite(self.bounded_load_c)):
            raise ValueError(f"bounded_load_c must be >= 1, got {self.bounded_load_c}")
        if self.ring_vnodes < 1 or self.record_candidates < 1:
            raise ValueError("ring_vnodes and record_candidates must be >= 1")


@dataclass(slots=True)
class EndpointView:
    """One replica as the scheduler sees it at decision time (a cheap, mutable snapshot)."""

    id: str  # stable name, e.g. "llama-70b/replica-2" or the URL
    model: str  # the base model it serves
    url: str
    engine: str = "vllm"  # "vllm" | "llamacpp"
    pool: str = "default"
    pool_priority: int = 0  # lower = preferred
    role: str = "both"  # prefill/decode disaggregation: "prefill", "decode" or "both" (route/pd.py)
    weight: float = 1.0
    adapters: frozenset[str] = frozenset()  # LoRA adapters it can serve now
    # breaker: "closed" | "open" | "half_open"; `available` is what the breaker allows right now
    breaker_state: str = "closed"
    available: bool = True
    retry_at: float | None = None  # when an open breaker lets a probe through
    # scraped engine state (None = never scraped / the contract has no such metric)
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None  # fraction 0..1
    scraped_at: float | None = None
    stale: bool = True
    # the router's own live view (exact, updated on every request start/end)
    inflight: int = 0
    inflight_at_scrape: int = 0  # our inflight when the last scrape was taken
    max_inflight: int | None = None  # admission cap per replica (pool setting)
    drain_rate: float | None = None  # requests finished per second, from engine counters
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class TenantTag:
    """Who sent a request, as admission weighs it (the shell makes it from the authenticated
    principal): its place in the wait queue's bands and its fair share within one."""

    tenant: str
    key: str  # the API key's id ("static", "-" for none)
    band: int  # llmgw.tenants.model.band_rank: higher goes first
    band_name: str
    weight: float  # the tenant's share of its band's service, relative to the others waiting
    cost: int  # tokens: the prompt estimate + max_tokens (what the Limiter charges)


@dataclass(slots=True)
class RequestInfo:
    """What a routing decision may look at: never the whole body."""

    request_id: str
    model: str  # the model name the client asked for (base model or adapter)
    base_model: str
    adapter: str | None = None
    session_key: str | None = None  # e.g. the `user` field or an x-session-id header
    prompt_tokens_estimate: int = 0  # bytes / 4 of the rendered prompt, for long-context weights
    strategy: str | None = None  # a named preset asked for by header; None = the model's default
    # What cache-aware scorers look at: the prompt's head as the engine caches it first
    # (route.request_head; b"" = none, e.g. embeddings) and the request's cache_salt, which
    # partitions a tenant's cache (vLLM mixes it into the first block's hash).
    head: bytes = b""
    cache_salt: str | None = None
    # Tier 2 (models with kv_events): the prompt's full-block hashes as the engine's KV events
    # name them (64-bit ints), from the shell's /tokenize step; None = not computed. kv_note says
    # why not, when it was tried and failed (it goes into the decision's note).
    kv_hashes: tuple[int, ...] | None = None
    # the prompt's full blocks (its share's denominator), hashed or not: the step stops hashing
    # where no replica holds the block before (llmgw.kv.prefix_chains); 0 = len(kv_hashes)
    kv_blocks: int = 0
    kv_note: str = ""
    kv_outcome: str = ""  # why the /tokenize step left no hashes (its outcome label), if it says


@dataclass(slots=True)
class Candidate:
    endpoint_id: str
    scores: dict[str, float]  # scorer name -> value in [0, 1] (1 = best) before weights
    total: float
    flags: tuple[str, ...] = ()  # scorer remarks, e.g. "kv 0.97 >= ceiling 0.95" (a veto)


@dataclass(slots=True)
class FilterDrop:
    filter: str
    endpoint_id: str
    reason: str


@dataclass(slots=True)
class Decision:
    request_id: str
    model: str
    strategy: str
    picker: str
    chosen: str | None  # endpoint id; None when nothing could be picked
    candidates: Sequence[Candidate]  # the best few, best first (a route.ranked.Ranked: built when read)
    dropped: list[FilterDrop]
    weights: dict[str, float]
    decided_at: float  # wall-clock seconds
    decide_us: float  # time spent deciding, microseconds
    note: str = ""  # e.g. "all breakers open: trying the one closest to recovery"
    n_candidates: int = 0  # how many were scored; `candidates` keeps only the best few of them
    # The chosen replica was kept only because every breaker was open (filters.healthy's last
    # resort): its breaker may be asked for an early probe.
    fallback: bool = False
    prefix: str | None = None  # the prefix tier's outcome: hit / miss / guarded / spilled
    # admission: the request's tenant, band and its share of the band when it was let through
    # (1.0 when it did not wait); None: not set (a decision made outside RouterCore)
    tenant: str | None = None
    band: str | None = None
    share: float | None = None
    # prefill/decode disaggregation: which step's decision ("prefill" / "decode"); "": not split
    phase: str = ""
    # What stateful scorers noted while scoring, for their observe() hook; the scheduler's
    # commit() hands it to them once and clears it (never kept in the decision ring).
    pending: list[tuple[Any, Any]] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id, "model": self.model, "strategy": self.strategy,
            "picker": self.picker, "chosen": self.chosen, "weights": self.weights,
            "candidates": [{"endpoint": c.endpoint_id, "scores": c.scores, "total": c.total,
                            "flags": list(c.flags)} for c in self.candidates],
            "n_candidates": self.n_candidates,
            "dropped": [{"filter": d.filter, "endpoint": d.endpoint_id, "reason": d.reason}
                        for d in self.dropped],
            "decided_at": self.decided_at, "decide_us": self.decide_us, "note": self.note,
            "tenant": self.tenant, "band": self.band, "share": self.share, "phase": self.phase,
        }
