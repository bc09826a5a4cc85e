"""The admin API's LoRA adapter types (GET /api/v1/adapters, the event stream's `adapters`):
which vLLM replica holds which adapter as the router counts them (docs/lora.md)."""

from __future__ import annotations

from dataclasses import dataclass

from llmgw.admin.typeinfo import prop

__all__ = ["AdapterFailure", "AdapterHeld", "AdapterSummary", "ReplicaAdapters"]


@dataclass(slots=True)
class AdapterHeld:
    adapter: str
    state: str = prop("`loaded`, `pinned` (static: never unloaded by llmgw), `loading`, or `unloading` (the "
                      "model no longer serves it: removed from its declaration, or listed by the engine without "
                      "one)")
    inflight: int = prop("requests running on it on this replica")
    idle_s: float | None = prop("seconds since it was last used through the router; null if never (or loading)")
    waiting: int = prop("requests waiting for its load (while loading)")
    unloading: str | None = prop("the idle adapter unloaded to make room for it (while loading)")


@dataclass(slots=True)
class AdapterFailure:
    adapter: str
    reason: str = prop("the engine's reason, or the router's (a timeout; not listed after a 200)")
    failures: int = prop("failed loads in a row on this replica")
    retry_in_s: float = prop("seconds until a request may make it try again (backoff)")


@dataclass(slots=True)
class ReplicaAdapters:
    """One vLLM replica's adapters as the router counts them (its count is the truth: vLLM never
    refuses a load when full)."""
    replica: str
    model: str
    cap: int = prop("the model's max_loaded_adapters")
    used: int = prop("adapters held plus loads in progress (never above cap)")
    adapters: list[AdapterHeld]
    failed: list[AdapterFailure] = prop("adapters whose last load here failed")


@dataclass(slots=True)
class AdapterSummary:
    replicas: list[ReplicaAdapters]
    loads: dict[str, int] = prop("loads by outcome since the start: ok, failed, timeout, not_listed")
    unloads: dict[str, int] = prop("unloads to make room by outcome: ok, failed")
    waiting: int = prop("requests waiting for a load now")
