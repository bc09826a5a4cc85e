"""What the console knows of the daemon: the event stream's lines applied in order.

Pure: no Textual, no I/O, no clock. The admin API's answers may grow fields and are still being
shaped, so every read is defensive (``.get`` with a default, wrong types ignored): a console must
show what it can rather than crash on a daemon one version ahead of it."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["SECTIONS", "ConsoleState", "DecisionEntry", "Link", "as_dict", "as_list"]

# the sections a snapshot carries whole and an update may replace whole; decisions are apart
SECTIONS = ("nodes", "models", "replicas", "endpoints", "cache", "store", "adapters", "kv", "routers")
MAX_DECISIONS = 500


def as_list(value: Any) -> list[dict[str, Any]]:
    """A list of JSON objects, dropping anything that is not one."""
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


def as_dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


@dataclass(frozen=True, slots=True)
class DecisionEntry:
    """A decision as received, with a console-local sequence number: request ids repeat across
    retries, so the number is what the decision table keys its rows by."""

    seq: int
    decision: dict[str, Any]

    @property
    def identity(self) -> tuple[Any, ...]:
        d = self.decision
        return (d.get("request_id"), d.get("decided_at"), d.get("chosen"))


@dataclass(slots=True)
class Link:
    """The event stream's health, as the banner and the status bar show it."""

    connected: bool = False  # a snapshot arrived and the stream has not dropped since
    attempt: int = 0  # failed attempts since the last snapshot
    reason: str = ""  # why the last attempt failed


@dataclass
class ConsoleState:
    max_decisions: int = MAX_DECISIONS
    rev: int = 0
    snapshots: int = 0  # 1 + the number of reconnections that got through
    nodes: list[dict[str, Any]] = field(default_factory=list)
    models: list[dict[str, Any]] = field(default_factory=list)
    replicas: list[dict[str, Any]] = field(default_factory=list)
    endpoints: list[dict[str, Any]] = field(default_factory=list)
    cache: dict[str, Any] = field(default_factory=dict)
    store: dict[str, Any] = field(default_factory=dict)  # the router's store: {"state": "ok" | "degraded", ...}
    adapters: dict[str, Any] = field(default_factory=dict)  # LoRA adapters per vLLM replica (GET /adapters)
    kv: dict[str, Any] = field(default_factory=dict)  # tier 2: its index and parity per replica (GET /api/v1/kv)
    routers: dict[str, Any] = field(default_factory=dict)  # the routers sharing the store (GET /api/v1/routers)
    # revisions, jobs, suites and eval results: not on the stream, fetched while the Lifecycle view
    # is shown (lifecycle_fetch.py; the shape is in lifecycle_rows.py)
    lifecycle: dict[str, Any] = field(default_factory=dict)
    facility: dict[str, Any] = field(default_factory=dict)  # GET /api/v1/facility: fetched, not streamed
    tenants: list[dict[str, Any]] = field(default_factory=list)  # GET /api/v1/tenants: fetched, not streamed
    tenants_fetched: bool = False  # ... at least once
    # GET /api/v1/autoscale by model: fetched while the Models view is shown (autoscale_rows.py); empty from a
    # daemon without autoscaling
    autoscale: dict[str, dict[str, Any]] = field(default_factory=dict)
    decisions: deque[DecisionEntry] = field(init=False)  # newest first
    link: Link = field(default_factory=Link)
    _seq: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.decisions = deque(maxlen=self.max_decisions)

    # -- the event stream ---------------------------------------------------------------------------
    def apply(self, event: Mapping[str, Any]) -> frozenset[str]:
        """Apply one line of /api/v1/events; answer the sections it changed ("decisions" and
        "link" included). Unknown line types are ignored: the stream may grow new ones."""
        kind = event.get("type")
        rev = event.get("rev")
        if isinstance(rev, int):
            self.rev = rev
        if kind == "snapshot":
            for name in SECTIONS:
                self._set(name, event.get(name))
            self._merge(as_list(event.get("decisions")))
            self.snapshots += 1
            self.link = Link(connected=True)
            return frozenset((*SECTIONS, "decisions", "link"))
        if kind == "update":
            changed = {name for name in SECTIONS if event.get(name) is not None}
            for name in changed:
                self._set(name, event[name])
            return frozenset(changed)
        if kind == "decision":
            d = event.get("decision")
            if isinstance(d, dict):
                self._add(d)
                return frozenset({"decisions"})
        return frozenset()

    def lost(self, attempt: int, reason: str) -> frozenset[str]:
        """The stream dropped or could not be opened: keep what we have (shown as stale)."""
        self.link = Link(connected=False, attempt=attempt, reason=reason)
        return frozenset({"link"})

    def _set(self, name: str, value: Any) -> None:
        setattr(self, name, as_dict(value) if name in ("cache", "store", "adapters", "kv", "routers") else as_list(value))

    def _add(self, decision: dict[str, Any]) -> None:
        self._seq += 1
        self.decisions.appendleft(DecisionEntry(self._seq, decision))

    def _merge(self, oldest_first: Iterable[dict[str, Any]]) -> None:
        """A snapshot's recent decisions join the ones we kept: after a reconnection they mostly
        repeat what we have, and after a daemon restart the older ones are still history."""
        known = {e.identity for e in self.decisions}
        fresh = []
        for d in oldest_first:
            self._seq += 1
            entry = DecisionEntry(self._seq, d)
            if entry.identity not in known:
                known.add(entry.identity)
                fresh.append(entry)
        if not fresh:
            return
        merged = sorted([*self.decisions, *fresh], key=_decided_key, reverse=True)
        self.decisions = deque(merged[: self.max_decisions], maxlen=self.max_decisions)

    # -- lookups and local corrections -----------------------------------------------------------------
    def decision(self, seq: int) -> dict[str, Any] | None:
        for e in self.decisions:
            if e.seq == seq:
                return e.decision
        return None

    def present_replicas(self) -> set[str]:
        """The replicas the daemon has now: those placed on nodes (in any state, until they are gone)
        and the router's endpoints (static ones included). Summaries that cover a window (the cache
        hits) may still name a replica a scale-down removed; the console shows only these."""
        ids = {r.get("replica") for r in self.replicas} | {e.get("id") for e in self.endpoints}
        return {i for i in ids if isinstance(i, str)}

    def present_models(self) -> set[str]:
        """The models the daemon has now: defined, or with a replica or an endpoint."""
        names = {m.get("name") for m in self.models} | {r.get("model") for r in (*self.replicas, *self.endpoints)}
        return {n for n in names if isinstance(n, str)}

    def put_lifecycle(self, data: Mapping[str, Any]) -> frozenset[str]:
        """The lifecycle's state as the admin API answered it (lifecycle_fetch.py)."""
        self.lifecycle = dict(data)
        return frozenset({"lifecycle"})

    def node(self, name: str) -> dict[str, Any] | None:
        return next((n for n in self.nodes if n.get("name") == name), None)

    def put_facility(self, view: Any) -> frozenset[str]:
        """The facility's domains and holds as GET /api/v1/facility answered (not in the stream)."""
        self.facility = as_dict(view)
        return frozenset({"facility"})

    def put_tenants(self, views: Any) -> frozenset[str]:
        """The tenants as GET /api/v1/tenants answered (a list of TenantView; not in the stream)."""
        self.tenants = as_list(views)
        self.tenants_fetched = True
        return frozenset({"tenants"})

    def put_autoscale(self, views: Any) -> frozenset[str]:
        """The autoscaled models as GET /api/v1/autoscale answered (a list of AutoscaleView; None or
        anything else: a daemon without autoscaling, nothing shown)."""
        self.autoscale = {v["model"]: v for v in as_list(views) if isinstance(v.get("model"), str)}
        return frozenset({"autoscale"})

    def put_node(self, view: Mapping[str, Any]) -> frozenset[str]:
        """A node as an admin call answered it (e.g. after setting labels), ahead of the next update."""
        name = view.get("name")
        if not isinstance(name, str):
            return frozenset()
        nodes = [n for n in self.nodes if n.get("name") != name]
        nodes.append(dict(view))
        self.nodes = sorted(nodes, key=lambda n: str(n.get("name", "")))
        return frozenset({"nodes"})


def _decided_key(e: DecisionEntry) -> tuple[float, int]:
    at = e.decision.get("decided_at")
    return (float(at) if isinstance(at, (int, float)) else 0.0, e.seq)
