"""The admin API's bodies and answers as types: the route table names them, the validator builds
the bodies from JSON, and the OpenAPI document is generated from their fields.

Request bodies are closed (an unknown field is a 400); answers may grow fields, so clients must
ignore what they do not know. Times ending in ``_s`` are seconds relative to the daemon's now;
``*_at`` fields are as the source reports them (``decided_at``, ``created_at``: Unix time;
breaker times: the daemon's monotonic clock)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from llmgw.admin.schema_adapters import (  # noqa: F401
    AdapterFailure,
    AdapterHeld,
    AdapterSummary,
    ReplicaAdapters,
)
from llmgw.admin.schema_autoscale import AutoscaleView, ScaleDecisionView  # noqa: F401
from llmgw.admin.schema_kv import (  # noqa: F401
    KvModelParity,
    KvParity,
    KvReplica,
    KvReplicaParity,
    KvSummary,
)
from llmgw.admin.schema_status import RoutersView, RouterView, Status, StoreStatus  # noqa: F401
from llmgw.admin.typeinfo import Shape, prop
from llmgw.config import ENGINES, ModelConfig, label_keys
from llmgw.config.fields import facility_label_values

__all__ = [
    "MAX_REPLICAS",
    "AdapterFailure",
    "AdapterHeld",
    "AdapterSummary",
    "AutoscaleView",
    "BreakerView",
    "CacheCounts",
    "CacheSummary",
    "CandidateView",
    "DecisionEvent",
    "DecisionView",
    "DropView",
    "EndpointStatus",
    "ErrorBody",
    "ErrorDetail",
    "Event",
    "GpuFacts",
    "HistoryEvent",
    "LabelKeysBody",
    "LabelsBody",
    "ModelCache",
    "ModelDefinition",
    "ModelView",
    "NodeFacts",
    "NodeView",
    "PingEvent",
    "Problem",
    "ReplicaAdapters",
    "ReplicaCache",
    "ReplicaView",
    "RequestDecisions",
    "RoleGroupView",
    "ScaleBody",
    "ScaleDecisionView",
    "ScrapedMetrics",
    "SnapshotEvent",
    "JoinInfo",
    "NodeRevoked",
    "Status",
    "StoreStatus",
    "UpdateEvent",
]

MAX_REPLICAS = 10_000  # a scale beyond this is a typo, not a fleet


# -- errors -----------------------------------------------------------------------------------------
@dataclass(slots=True)
class Problem:
    field: str = prop("where, e.g. `labels.rack`, `replicas[0].url`, a query parameter's name")
    message: str = prop("what is wrong with it")

    def __str__(self) -> str:
        return f"{self.field}: {self.message}" if self.field else self.message


@dataclass(slots=True)
class ErrorDetail:
    message: str = prop("human-readable; for invalid input, every problem as `field: message`")
    type: str = prop("invalid_request_error, authentication_error, permission_error, not_found_error, "
                     "method_not_allowed, conflict_error or server_error")
    param: str | None = prop("the (first) offending field or parameter, if any")
    code: str | None = prop("a stable machine-readable code, e.g. invalid_body, not_found")
    problems: list[Problem] = prop("each invalid field (400 only)", factory=list)


@dataclass(slots=True)
class ErrorBody:
    """OpenAI's error envelope, as the router's own API answers."""
    error: ErrorDetail


# -- nodes ------------------------------------------------------------------------------------------
@dataclass(slots=True)
class GpuFacts:
    index: int
    name: str
    memory_mb: int


@dataclass(slots=True)
class NodeFacts:
    cpus: int
    memory_mb: int
    hostname: str
    agent_version: str
    gpus: list[GpuFacts]
    declared_watts: int = prop("the node's own power figure ([agent] declared_watts); 0: none", default=0)
    measured_watts: float | None = prop("the sum of nvidia-smi power.draw at its last report; null: none",
                                        default=None)


@dataclass(slots=True)
class NodeView:
    name: str
    state: str = prop("ready, not_ready or lost")
    since_s: float = prop("how long it has been in this state")
    reason: str = prop("why it is in this state")
    connected: bool = prop("its agent's stream is up")
    agent_id: str | None = prop("the connected (or last) agent instance")
    last_seen_s: float | None = prop("since its agent was last heard; null if never")
    labels: dict[str, str] = prop("effective labels: operator labels override the agent's")
    agent_labels: dict[str, str] = prop("as the agent reports them")
    operator_labels: dict[str, str] = prop("set through this API")
    location: str = prop("site/room/row/rack/pdu from the llmgw.io/* labels it has")
    facts: NodeFacts = prop("what the agent found on the node")
    replicas: list[str] = prop("replica ids assigned to it")
    held: list[str] = prop("held facility domains it is in (nothing new is placed on it)", factory=list)


@dataclass(slots=True)
class LabelsBody:
    """Operator labels to merge into a node's (they override the agent's labels of the same key)."""
    labels: dict[str, str] = prop("label key → value, e.g. {\"llmgw.io/rack\": \"r12\"}")

    def problems(self) -> list[Problem]:
        return [Problem(f"labels.{k}", msg) for k, v in self.labels.items()
                if (msg := label_keys({k: ""}) or facility_label_values({k: v})) is not None]


@dataclass(slots=True)
class LabelKeysBody:
    """Operator label keys to remove (the agent's own labels of those keys show again)."""
    keys: list[str] = prop("label keys")


# -- models -----------------------------------------------------------------------------------------
ModelDefinition = Annotated[dict[str, Any], Shape(
    ModelConfig, "ModelDefinition",
    "A model's definition, as a [[models]] table of the config file (docs/configuration.md). The server "
    "checks values too (strategy and pool names, URLs...): a 400 names each bad field.",
    refine={"name": {"minLength": 1}, "engine": {"enum": list(ENGINES)}},
    example={"name": "llama-3-8b", "engine": "vllm", "deploy": {"count": 2, "gpus": 1}})]


@dataclass(slots=True)
class RoleGroupView:
    """One prefill/decode role of a disaggregated model: its deploy group and static endpoints."""
    role: str = prop("prefill or decode")
    desired: int = prop("the group's count ([[models.deploy.roles]]); 0 for a role only static endpoints have")
    replicas: int = prop("placed replicas of the group meant to run")
    ready: int = prop("of those, how many are ready")
    static: int = prop("static endpoints ([[models.replicas]]) with this role", 0)


@dataclass(slots=True)
class ModelView:
    name: str
    engine: str = prop("vllm or llamacpp")
    source: str = prop("config (the config file owns it), api, or adopted (rebuilt from an engine's spec by "
                       "`llmgw daemon --adopt`; an edit makes it api)")
    desired_replicas: int | None = prop("the deploy profile's count (with prefill/decode groups: their sum); null: "
                                        "static replicas only")
    replicas: int = prop("placed replicas meant to run")
    ready: int = prop("of those, how many are ready")
    static_replicas: int = prop("endpoints listed in the definition")
    unplaceable: str | None = prop("why the placer cannot place the missing replicas, if it cannot")
    definition: ModelDefinition = prop("the whole definition in force")
    groups: list[RoleGroupView] = prop("a disaggregated model's prefill and decode roles, each with its desired and "
                                       "ready count (deploy groups first, in the definition's order); empty for a "
                                       "model without roles", factory=list)


@dataclass(slots=True)
class ScaleBody:
    """A replica count, or (an autoscaled model) `release` to hand the count back to the autoscaler."""
    replicas: int | None = prop("desired replica count of the model's deploy profile; on a model with "
                                "[models.autoscale] the count is pinned (the autoscaler holds it until released). "
                                "Required unless `release` is true", None, minimum=0, maximum=MAX_REPLICAS)
    release: bool = prop("true: unpin an autoscaled model's count (the autoscaler decides again); "
                         "`replicas` is then left out", False)

    def problems(self) -> list[Problem]:
        if self.release and self.replicas is not None:
            return [Problem("release", "give either replicas (pin a count) or release: true (unpin it), not both")]
        if not self.release and self.replicas is None:
            return [Problem("replicas", "required (or `release: true` to hand an autoscaled model's count back to "
                                        "its autoscaler)")]
        return []


# -- replicas and endpoints -------------------------------------------------------------------------
@dataclass(slots=True)
class ReplicaView:
    """A replica the control plane placed on a node (static endpoints are under /endpoints only)."""
    replica: str = prop("its id, `<model>/<hex>`")
    model: str
    node: str
    desired: str = prop("run, drain or stop")
    state: str = prop("pending (no report yet), starting, ready, unhealthy, crashed, failed, crashloop, "
                      "stopping or stopped")
    url: str | None = prop("where the router reaches the engine, once it listens")
    pid: int | None
    restarts: int
    detail: str
    log_tail: list[str] = prop("the engine's last output lines")
    adopted: bool = prop("found running after an agent restart and kept")
    gpus: list[int] = prop("GPU indices it was given")
    generation: int = prop("bumped by each requested restart")
    reason: str = prop("why it is draining or stopping, if it is")
    routable: bool = prop("in the router's scheduler and taking new requests")
    inflight: int = prop("requests the router has on it now")
    created_at: float = prop("Unix time")
    role: str = prop("its part in prefill/decode disaggregation, as it is routed: prefill, decode (a group of "
                     "[[models.deploy.roles]]) or both", "both")


@dataclass(slots=True)
class BreakerView:
    state: str = prop("closed, open or half_open")
    retry_at: float | None = prop("when an open breaker lets a probe through (monotonic clock)")
    cooldown: float = prop("seconds of the current or last open period")
    consecutive_failures: int
    probes_in_flight: int
    half_open_successes: int
    changed_at: float | None
    opened_total: int
    failures_total: int
    successes_total: int
    last_failure: str | None = prop("kind of the last failure: connect, timeout, reset, http_5xx...")
    last_failure_at: float | None


@dataclass(slots=True)
class ScrapedMetrics:
    """The engine's last /metrics as read (llmgw/route/contract.py)."""
    engines: int = prop("data-parallel engines behind the endpoint")
    finished_total: float | None
    prefix_queries_total: float | None = prop("prompt tokens looked up in the engine's prefix cache")
    prefix_hits_total: float | None = prop("of those, tokens found")
    kv_blocks: int | None
    block_size: int | None
    kv_capacity_tokens: int | None
    lora_max: int | None
    lora_running: list[str]
    lora_waiting: list[str]
    errors: list[str] = prop("contract violations, e.g. a missing mandatory metric")


# Not the scheduler's own per-decision EndpointView (llmgw.route.types): this is the API's account of one.
@dataclass(slots=True)
class EndpointStatus:
    """A replica as the router's scheduler sees it."""
    id: str
    model: str
    url: str
    pool: str
    inflight: int
    running: float | None = prop("scraped: requests running in the engine")
    waiting: float | None = prop("scraped: requests queued in the engine")
    kv_usage: float | None = prop("scraped: KV-cache use, 0..1")
    stale: bool = prop("its metrics are older than router.stale_after_s (or never came)")
    scrape_age_s: float | None
    scrape_error: str | None
    drain_rate: float | None = prop("requests finished per second")
    breaker: BreakerView
    adapters: list[str] = prop("LoRA adapters it serves now")
    node: str | None = prop("the node of a placed replica; null for a static endpoint")
    draining: bool
    wall: float = prop("Unix time of this snapshot")
    scrape: ScrapedMetrics | None = prop("the last scrape; null before the first")
    role: str = prop("prefill, decode or both: its part in prefill/decode disaggregation", "both")


# -- decisions --------------------------------------------------------------------------------------
@dataclass(slots=True)
class CandidateView:
    endpoint: str
    scores: dict[str, float] = prop("scorer → value in [0, 1] before weights (1 = best)")
    total: float
    flags: list[str] = prop("scorer remarks, e.g. a prefix match or a KV ceiling veto")


@dataclass(slots=True)
class DropView:
    filter: str
    endpoint: str
    reason: str


@dataclass(slots=True)
class DecisionView:
    """One routing decision with its whole rationale."""
    request_id: str
    model: str = prop("the model the client asked for (a base model or an adapter)")
    strategy: str
    picker: str
    chosen: str | None = prop("the endpoint picked; null when none could be")
    weights: dict[str, float]
    candidates: list[CandidateView] = prop("the best few scored candidates")
    n_candidates: int = prop("how many were scored")
    dropped: list[DropView] = prop("endpoints filtered out, and why")
    decided_at: float = prop("Unix time")
    decide_us: float
    note: str = prop("e.g. the prefix outcome, or a breaker fallback")
    tenant: str | None = prop("the tenant that sent the request (\"-\": none named)", None)
    band: str | None = prop("its priority band in admission (batch, low, normal, high, critical)", None)
    share: float | None = prop("its tenant's share of the band when admission let it through: its weight over the "
                               "weights of the tenants waiting (1.0 when it did not wait)", None)
    phase: str = prop("a disaggregated model's split request: which step this decision chose for — prefill "
                      "(among the prefill replicas) or decode; empty otherwise", "")


@dataclass(slots=True)
class RequestDecisions:
    request_id: str
    decisions: list[DecisionView] = prop("one per attempt (a retry goes to another replica), oldest first")


# -- cache hits -------------------------------------------------------------------------------------
@dataclass(slots=True)
class CacheCounts:
    prefix_hits: int = prop("routing decisions whose chosen replica held the request's prefix")
    prefix_misses: int = prop("prefix decisions whose chosen replica did not")
    prefix_hit_rate: float | None = prop("hits / decisions; null without decisions")
    engine_hit_tokens: float = prop("prompt tokens the engines found in their prefix caches")
    engine_query_tokens: float = prop("prompt tokens the engines looked up")
    engine_hit_rate: float | None = prop("the engines' own rate; null without lookups")
    prefix_hit_rate_series: list[float | None] = prop("per bucket, oldest first (for sparklines)")
    engine_hit_rate_series: list[float | None] = prop("per bucket, oldest first")


@dataclass(slots=True)
class ModelCache(CacheCounts):
    model: str = prop("the base model")


@dataclass(slots=True)
class ReplicaCache(CacheCounts):
    replica: str = prop("")
    model: str = prop("")


@dataclass(slots=True)
class CacheSummary:
    window_s: float = prop("the window the counts cover, ending now")
    bucket_s: float = prop("width of one series bucket")
    total: CacheCounts
    models: list[ModelCache]
    replicas: list[ReplicaCache]


# -- history ----------------------------------------------------------------------------------------
@dataclass(slots=True)
class HistoryEvent:
    """One event of the store's history: placements, engine state changes, node states, operator edits."""
    id: int
    ts: float = prop("Unix time")
    event: str = prop("e.g. `replica placed`, `engine ready`, `node lost`, `model saved`")
    replica: str | None
    model: str | None
    node: str | None
    detail: str


# -- node identity ----------------------------------------------------------------------------------
@dataclass(slots=True)
class NodeRevoked:
    """What revoking a node did."""
    node: str
    had_credential: bool = prop("it had a credential in force, now refused")
    was_connected: bool = prop("its agent's connection was up, and is closed")
    replicas_withdrawn: list[str] = prop("its replicas, out of routing now and placed elsewhere at the next "
                                         "reconcile")
    persisted: bool = prop("the store recorded the revocation; if false (the store cannot write) it holds until "
                           "the router restarts: revoke again then")


@dataclass(slots=True)
class JoinInfo:
    """What an agent needs to join this router. Holds the join token: treat it as a secret."""
    router: str | None = prop("the control listener's address as agents dial it (a wildcard listen address "
                              "becomes this host's name); null without a listener")
    join_token: str | None = prop("admits new nodes; null: this router has none")
    join_token_source: str = prop("config (inline), file (control.join_token_file, rotatable), generated "
                                  "(one-process mode) or none")
    tls: bool = prop("the control stream is TLS")
    ca_pem: str | None = prop("the CA agents pin (agent.tls_ca_pem), when the router made its own; null: "
                              "the CA that signed control.tls_cert, or no TLS")
    ca_sha256: str | None = prop("the CA certificate's SHA-256 fingerprint")
    server_name: str | None = prop("the name in the router's certificate agents verify (agent.tls_server_name)")


# -- the event stream (NDJSON, one of these per line) ------------------------------------------------
@dataclass(slots=True)
class SnapshotEvent:
    """The first line: the whole state."""
    type: Literal["snapshot"]
    rev: int = prop("this stream's revision; each later snapshot, update or decision line adds one")
    nodes: list[NodeView]
    models: list[ModelView]
    replicas: list[ReplicaView]
    endpoints: list[EndpointStatus]
    decisions: list[DecisionView] = prop("the last 50, oldest first")
    cache: CacheSummary
    store: StoreStatus
    adapters: AdapterSummary | None = prop("LoRA adapters per vLLM replica (null from a daemon before them)", None)
    kv: KvSummary | None = prop("tier 2's index and parity per replica (null from a daemon before it)", None)


@dataclass(slots=True)
class DecisionEvent:
    """A routing decision, as it happens."""
    type: Literal["decision"]
    rev: int
    decision: DecisionView


@dataclass(slots=True)
class UpdateEvent:
    """The sections that changed since the last line carrying them, each whole (checked once a second)."""
    type: Literal["update"]
    rev: int
    nodes: list[NodeView] | None = None
    models: list[ModelView] | None = None
    replicas: list[ReplicaView] | None = None
    endpoints: list[EndpointStatus] | None = None
    cache: CacheSummary | None = None
    store: StoreStatus | None = None
    adapters: AdapterSummary | None = None
    kv: KvSummary | None = None


@dataclass(slots=True)
class PingEvent:
    """Every 5 s: a client that hears nothing for longer has lost the daemon."""
    type: Literal["ping"]
    rev: int = prop("the current revision")


Event = SnapshotEvent | DecisionEvent | UpdateEvent | PingEvent
