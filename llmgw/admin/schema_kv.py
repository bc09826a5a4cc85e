"""The admin API's tier-2 types (GET /api/v1/kv, the event stream's `kv`): per replica the KV
index, its event feed, the decisions each tier made and the parity self-check
(docs/prefix-routing.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from llmgw.admin.typeinfo import prop

__all__ = ["KvModelParity", "KvParity", "KvReplica", "KvReplicaParity", "KvSummary"]


@dataclass(slots=True)
class KvParity:
    passed: int = prop("checks whose blocks the engine reported with the router's hashes")
    failed: int = prop("checks where the engine reported other blocks, never the router's")
    unknown: int = prop("checks without a verdict (no events came, a reset came between, table full)")
    mismatch_rate: float | None = prop("failed / (passed + failed); null before a verdict")


@dataclass(slots=True)
class KvReplicaParity(KvParity):
    status: Literal["ok", "suspect", "alarm", "unchecked"] = prop(
        "ok: the last verdict passed; suspect: the last failed; alarm: several failed in a row (the "
        "engine hashes differently: tier 2 cannot route to it); unchecked: no verdict yet")
    pending: int = prop("checks waiting for their verdict")


@dataclass(slots=True)
class KvReplica:
    """One replica's tier-2 state: its index, its KV-event feed, its decisions and its parity."""
    replica: str
    model: str
    node: str | None
    blocks: int = prop("KV blocks the router's index holds for it")
    bytes: int = prop("estimated memory of those blocks in the index")
    overflowed: bool = prop("emptied for exceeding the per-replica cap, until its agent's next reset")
    messages: int = prop("kv_events messages applied")
    block_events: int = prop("block additions and removals applied")
    resets: int = prop("resets (a new engine, a new agent session, lost events)")
    gaps: int = prop("resets that cleared a non-empty index: events lost between engine and router, or the "
                     "engine cleared its cache")
    event_seq: int | None = prop("the engine's event sequence number the index reaches")
    lag_s: float | None = prop("seconds since its last kv_events message; null before the first")
    tier1_decisions: int = prop("decisions that chose it with tier 1 deciding (tier 2 had no vote)")
    tier2_decisions: int = prop("decisions that chose it with tier 2 voting")
    parity: KvReplicaParity


@dataclass(slots=True)
class KvModelParity(KvParity):
    model: str = prop("")


@dataclass(slots=True)
class KvSummary:
    """Tier 2 of cache-aware routing: the router's KV index fed by the engines' KV events."""
    enabled: bool = prop("the router has a tier-2 index (it accepts agents)")
    blocks: int = prop("KV blocks indexed, all replicas")
    bytes: int = prop("estimated memory of the index")
    messages: int = prop("kv_events messages applied")
    gaps: int
    refused: dict[str, int] = prop("kv_events refused, by reason (unknown_replica, other_node)")
    decisions: dict[str, int] = prop("decisions of kv_events models by tier 2's outcome: decided, or why "
                                     "tier 1 decided (miss, no_events, timeout, ...)")
    replicas: list[KvReplica]
    models: list[KvModelParity]
