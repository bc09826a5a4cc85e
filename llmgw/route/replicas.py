"""The router's replica table: every replica it may route to, grouped by model, with its live
state — the scheduler's view of it (EndpointView), its breaker, what the last scrape said,
whether it is draining — and the model entries that resolve a requested name (a base model or
one of its LoRA adapters) to the replicas serving it.

Pure: the trio shell's registry (``llmgw.daemon.router.registry``) adds the scrape loop that
keeps it fresh; the router's core (:mod:`.dispatch`) reads it for every decision."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from llmgw.config import AdapterConfig, Config, ModelConfig, PdConfig

from .breaker import Breaker, BreakerConfig
from .contract import DrainRate, ScrapeResult
from llmgw.config.names import candidate_key, is_candidate_key
from .types import EndpointView

__all__ = ["ModelEntry", "Replica", "ReplicaTable", "wanted_replicas"]


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
    # llama.cpp with declared adapters: each adapter's id on this engine, and every id it lists
    # (from /lora-adapters; None = not learned, or its last answer was unusable)
    lora_ids: dict[str, int] | None = None
    lora_all: tuple[int, ...] = ()

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
    wanted: int = 0  # replicas the config asks for (static ones + [models.deploy] count): see readiness.py
    declared: dict[str, AdapterConfig] = field(default_factory=dict)  # [[models.adapters]] by name
    max_loaded_adapters: int = 4  # per replica (vLLM: the adapter book's cap)
    # adapters removed from ``declared`` by a redefinition that an engine may still hold: never
    # served (serves_listed), unloaded once idle (adapter_routing), forgotten when no engine has them
    withdrawn: set[str] = field(default_factory=set)
    # [models.autoscale]: with no replica (scaled to zero, or all still starting) a request waits this
    # long for one instead of a 503 (llmgw.route.waiting.WaitRoom.cold); None: not autoscaled
    cold_wait_s: float | None = None
    pd: PdConfig | None = None  # [models.pd]: its requests' prefill and decode on replicas by role (pd.py)

    def serves_listed(self, adapter: str) -> bool:
        """May requests for ``adapter``, which an engine lists, be routed here? A model that
        declares adapters serves exactly those (any other an engine lists is a leftover: removed
        from the declaration, or loaded behind llmgw's back). One that declares none serves what
        its engines list (a vLLM started with ``--lora-modules`` by hand), except an adapter just
        removed from its declaration."""
        if self.declared:
            return adapter in self.declared
        return adapter not in self.withdrawn

    def on_demand(self, adapter: str | None) -> bool:
        """Is ``adapter`` loaded on demand here (a declared, non-static adapter of a vLLM model)?"""
        a = self.declared.get(adapter) if adapter is not None else None
        return a is not None and not a.static and self.engine == "vllm"


def wanted_replicas(m: ModelConfig) -> int:
    """How many replicas a model's config asks for: its static endpoints and its deploy count (an
    autoscaled model's: its minimum, so one scaled to zero is not waited for)."""
    if m.deploy is None:
        return len(m.replicas)
    return len(m.replicas) + (m.autoscale.min if m.autoscale is not None else m.deploy.replicas)


def cold_wait_of(m: ModelConfig) -> float | None:
    return m.autoscale.cold_start_wait_s if m.autoscale is not None and m.deploy is not None else None


class ReplicaTable:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        rc = cfg.router
        self.breaker_cfg = BreakerConfig(
            failure_threshold=rc.breaker.failure_threshold, base_cooldown=rc.breaker.cooldown_s,
            max_cooldown=max(rc.breaker.max_cooldown_s, rc.breaker.cooldown_s),
            half_open_max_probes=rc.breaker.half_open_probes)
        self.stale_after_s = rc.stale_after_s
        self.pool_priority = {p.name: p.priority for p in cfg.pools}
        self.pool_cap = {p.name: p.max_inflight_per_replica for p in cfg.pools}
        self.models: dict[str, ModelEntry] = {}
        self.replicas: dict[str, Replica] = {}
        for m in cfg.models:
            self.add_model(m)

    def add_model(self, m: ModelConfig) -> ModelEntry:
        if m.name in self.models:  # a redefinition keeps the live replicas
            old = self.models[m.name]
            old.engine, old.strategy, old.wanted = m.engine, m.strategy, wanted_replicas(m)
            old.cold_wait_s = cold_wait_of(m)
            old.pd = m.pd
            declared = {a.name: a for a in m.adapters}
            old.max_loaded_adapters = m.max_loaded_adapters
            old.withdrawn = (old.withdrawn | (old.declared.keys() - declared.keys())) - declared.keys()
            if declared != old.declared:  # llama.cpp: ids to learn again (its engines restart)
                old.declared = declared
                for r in old.replicas:
                    if r.lora_ids is not None:
                        self.set_lora_ids(r, None)
            return old
        entry = ModelEntry(m.name, m.engine, m.strategy, [], wanted=wanted_replicas(m),
                           declared={a.name: a for a in m.adapters}, max_loaded_adapters=m.max_loaded_adapters,
                           cold_wait_s=cold_wait_of(m), pd=m.pd)
        self.models[m.name] = entry
        for i, r in enumerate(m.replicas):
            self.add_replica(m, f"{m.name}/{i}", r.url, r.pool, r.weight, r.role)
        return entry

    def add_replica(self, m: ModelConfig, rid: str, url: str, pool: str, weight: float,
                    role: str = "both") -> Replica:
        view = EndpointView(id=rid, model=m.name, url=url.rstrip("/"), engine=m.engine, pool=pool,
                            pool_priority=self.pool_priority.get(pool, 0), weight=weight,
                            max_inflight=self.pool_cap.get(pool), role=role)
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
        """A requested model name → (base model entry, adapter or None). A candidate revision's
        key (``NAME#candidate``) resolves to nothing here: see resolve_candidate."""
        entry = self.models.get(name)
        if entry is not None and not is_candidate_key(name):
            return entry, None
        for entry in self.models.values():
            if (name in entry.adapters or name in entry.declared) and not is_candidate_key(entry.name):
                return entry, name
        return None

    def resolve_candidate(self, name: str) -> tuple[ModelEntry, str | None] | None:
        """Model `name`'s candidate revision (its entry, or the entry holding adapter `name`)."""
        entry = self.models.get(candidate_key(name))
        if entry is not None:
            return entry, None
        live = self.resolve(name)
        if live is not None and live[1] is not None:
            entry = self.models.get(candidate_key(live[0].name))
            if entry is not None and (name in entry.adapters or name in entry.declared):
                return entry, name
        return None

    def set_adapters(self, rep: Replica, adapters: Iterable[str]) -> None:
        """What the replica's engine serves now (learned from its /v1/models): those of them the
        model serves (:meth:`ModelEntry.serves_listed`)."""
        entry = self.models[rep.view.model]
        names = frozenset(a for a in adapters if entry.serves_listed(a))
        rep.view.adapters = names
        for ids in entry.adapters.values():
            ids.discard(rep.id)
        for a in names:
            entry.adapters.setdefault(a, set()).add(rep.id)
        for a in [a for a, ids in entry.adapters.items() if not ids]:
            del entry.adapters[a]

    def set_lora_ids(self, rep: Replica, by_path: dict[str, int] | None) -> None:
        """llama.cpp: what its ``/lora-adapters`` listed (file path → id; None: nothing usable).
        A declared adapter is on the replica when its source is one of the files."""
        entry = self.models[rep.view.model]
        if by_path is None:
            rep.lora_ids, rep.lora_all = None, ()
            self.set_adapters(rep, ())
            return
        rep.lora_ids = {a.name: by_path[a.source] for a in entry.declared.values() if a.source in by_path}
        rep.lora_all = tuple(sorted(by_path.values()))
        self.set_adapters(rep, rep.lora_ids)

    def views(self, entry: ModelEntry, now: float) -> list[EndpointView]:
        out = []
        by_id = bool(entry.declared) and entry.engine == "llamacpp"
        for r in entry.replicas:
            # draining; or llama.cpp whose adapter ids are unknown: no request could say which
            # adapter to run (lora_body), and without the list it would run its slot's last one
            if r.draining or (by_id and r.lora_ids is None):
                continue
            r.refresh_view(now)
            r.view.stale = self.is_stale(r, now)
            out.append(r.view)
        return out

    def is_stale(self, rep: Replica, now: float) -> bool:
        at = rep.view.scraped_at
        return at is None or now - at > self.stale_after_s

    def all_replicas(self) -> Iterable[Replica]:
        return self.replicas.values()
