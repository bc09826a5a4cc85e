"""The config's schema: one frozen dataclass per TOML section, down to :class:`Config`, with each
field's default and checks.

Each field's annotation gives the TOML type (str, int, float, bool, ``X | None``, ``tuple[X, ...]``
for arrays, a nested dataclass for a table, ``tuple[Section, ...]`` for an array of tables) and
``opt(...)`` (:mod:`llmgw.config.fields`) its default and checks. Checks spanning sections are
small functions registered with ``@_cross_check`` in :mod:`llmgw.config.cross_checks`. A new
section is a new dataclass plus a field on its parent: no new validation code. Import these from
:mod:`llmgw.config`, the public API.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmgw.config.fields import (
    cidr, facility_label_values, facility_level, header_name, header_table, replica_nodes,
    host_port, host_or_host_port, http_url, in_range, key_value, known_strategy,
    label_keys, metric_name, node_name, nonempty, one_of, opt, pem_certificate, positive, store_url, unset_or,
)
from llmgw.config.autoscale import AutoscaleConfig
from llmgw.config.tenants import TenantsConfig
from llmgw.config.names import DEFAULT_PICKER, PICKER_NAMES, SCORER_NAMES

ENGINES = ("vllm", "llamacpp")
DEFAULT_POOL = "default"
ROLES = ("both", "prefill", "decode")  # a replica's part in prefill/decode disaggregation (docs/disaggregation.md)


# ---------------------------------------------------------------------------------- sections
@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    host: str = opt("127.0.0.1", check=nonempty)
    port: int = opt(8000, check=in_range(0, 65535))
    api_keys: tuple[str, ...] = opt((), items=nonempty)  # empty = no auth
    max_body_bytes: int = opt(8 * 1024 * 1024, check=in_range(1))
    request_id_header: str = opt("x-request-id", check=header_name)
    max_connections: int = opt(0, check=in_range(0))  # 0 = from the fd limit: (limit - 256) / 2
    first_request_timeout_s: float = opt(10.0, check=positive)  # a new connection's first byte, at most
    # SIGTERM/SIGINT: requests in flight may finish this long (new connections refused); 0 = cut at once
    shutdown_grace_s: float = opt(30.0, check=in_range(0, 3600))


@dataclass(frozen=True, kw_only=True)
class AdminConfig:
    socket: str = opt("", check=unset_or(nonempty))  # "": this machine's (config/defaults.py)
    tcp: str | None = opt(None, check=host_port)  # "host:port"; requires token
    token: str | None = opt(None, check=nonempty)


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    engine: str = opt("vllm", check=one_of(*ENGINES))
    replicas: int = opt(2, check=in_range(0))
    model: str = opt("sim-model", check=nonempty)
    extra_args: tuple[str, ...] = opt(())


@dataclass(frozen=True, kw_only=True)
class ControlConfig:
    """[control]: the router's side of the agent stream, node timeouts and the store."""
    # agents connect here; unset: 127.0.0.1:7070, or in one-process mode an ephemeral loopback port
    listen: str | None = opt(None, check=host_port)
    join_token: str | None = opt(None, check=nonempty)  # admits new nodes; unset = no agents
    join_token_file: str | None = opt(None, check=nonempty)  # or read it from this file (re-read when it changes)
    tls: bool | None = opt(None)  # unset: TLS unless `listen` is loopback; false: plain TCP (the opt-out)
    tls_cert: str | None = opt(None, check=nonempty)  # PEM; with tls_key, instead of the generated CA's
    tls_key: str | None = opt(None, check=nonempty)
    tls_dir: str | None = opt(None, check=nonempty)  # the generated CA and cert; default: "tls" beside the store
    hello_timeout_s: float = opt(5.0, check=positive)  # a new connection must say hello within this
    max_hello_bytes: int = opt(65536, check=in_range(1024))  # frame cap until the hello is accepted
    max_pending_agents: int = opt(128, check=in_range(1))  # connections waiting for their hello at once
    engine_networks: tuple[str, ...] = opt((), items=cidr)  # where engines may be besides their node's address
    heartbeat_s: float = opt(1.0, check=positive)
    not_ready_after_s: float = opt(5.0, check=positive)  # silence before a node is not ready
    lost_after_s: float = opt(30.0, check=positive)  # not ready this long = lost, replicas move
    max_lost_fraction: float = opt(0.5, check=in_range(0, 1))  # more of a domain silent = our partition
    partition_lost_interval_s: float = opt(60.0, check=positive)  # then: one of its nodes lost per this
    new_nodes_per_minute: int = opt(60, check=in_range(1))  # new node names the join token may register
    # a node's KV event budget: block events (+1 per message) a second, and the burst it may save up;
    # over it kv_events are dropped undecoded (a real engine sends a few thousand a second)
    kv_events_per_s: int = opt(100_000, check=in_range(1))
    kv_events_burst: int = opt(2_000_000, check=in_range(1))
    settle_s: float = opt(3.0, check=in_range(0))  # after a start, agents get this long to join before placing
    drain_timeout_s: float = opt(30.0, check=positive)  # a stopping replica's requests may finish
    autoscale_interval_s: float = opt(1.0, check=positive)  # the leader decides autoscaled models' counts
    max_message_bytes: int = opt(4 * 1024 * 1024, check=in_range(1024))
    store: str = opt("", check=unset_or(nonempty))  # SQLite file; ":memory:" = none; "": this machine's


@dataclass(frozen=True, kw_only=True)
class StoreConfig:
    """[store]: where the fleet's state is kept, and how routers sharing it lead (docs/ha.md)."""
    url: str = opt("", check=store_url)  # "": the SQLite file at [control] store; "sqlite:PATH"; "postgresql://…"
    password_file: str | None = opt(None, check=nonempty)  # PostgreSQL's password, kept out of the config
    timeout_s: float = opt(2.0, check=positive)  # every store call, at most (PostgreSQL)
    shared: bool = opt(False)  # other routers on this host share the SQLite file (PostgreSQL: always shared)
    lease_s: float = opt(5.0, check=positive)  # the leader's lease; renewed every lease_s / 3
    poll_s: float = opt(0.5, check=positive)  # followers check the generation and the admin queue this often


@dataclass(frozen=True, kw_only=True)
class GpuConfig:
    name: str = opt("gpu", check=nonempty)
    memory_mb: int = opt(check=in_range(1))


@dataclass(frozen=True, kw_only=True)
class RestartConfig:
    base_s: float = opt(1.0, check=positive)  # first restart delay; doubles per crash
    max_s: float = opt(60.0, check=positive)
    crashloop_after: int = opt(5, check=in_range(1))  # crashes within window_s = crash loop
    window_s: float = opt(300.0, check=positive)


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    """[agent]: this node's agent."""
    node: str = opt("", check=unset_or(node_name))  # "": the hostname (config/defaults.py)
    router: str = opt("127.0.0.1:7070", check=host_port)  # the router's [control] listen address
    # more routers of the same fleet to dial from the start (several routers: docs/ha.md); the agent
    # learns the others from the first that welcomes it, and keeps a stream to each
    routers: tuple[str, ...] = opt((), items=host_port)
    join_token: str | None = opt(None, check=nonempty)  # needed at the first join only
    join_token_file: str | None = opt(None, check=nonempty)
    tls: bool | None = opt(None)  # unset: TLS when a CA is given or the router is not on loopback
    tls_ca: str | None = opt(None, check=nonempty)  # PEM file of the CA that signed the router's cert
    tls_ca_pem: str | None = opt(None, check=pem_certificate)  # or that CA inline (`llmgw ctl join-info`)
    tls_server_name: str | None = opt(None, check=nonempty)  # the name to verify; default: the router's host
    labels: dict[str, str] = opt(factory=dict, check=(label_keys, facility_label_values))  # llmgw.io/rack = "r12", ...
    advertise_host: str = opt("127.0.0.1", check=nonempty)  # engines listen here; the router dials it
    state_dir: str = opt("", check=unset_or(nonempty))  # "": this machine's (config/defaults.py)
    gpus: tuple[GpuConfig, ...] | None = opt(None)  # declared GPUs instead of nvidia-smi's
    memory_mb: int | None = opt(None, check=in_range(0))  # instead of /proc/meminfo
    reconnect_min_s: float = opt(0.5, check=positive)
    reconnect_max_s: float = opt(30.0, check=positive)
    stop_grace_s: float = opt(10.0, check=positive)  # TERM, this long, then KILL the engine's group
    restart: RestartConfig = opt(factory=RestartConfig)
    declared_watts: int = opt(0, check=in_range(0, 1_000_000))  # this node's power draw for budgets; 0: none

    def __post_init__(self) -> None:
        # The short facility keys (rack = "r12") are llmgw.io/ labels, as `ctl label` takes them.
        from llmgw.fleet.domains import expand_labels

        object.__setattr__(self, "labels", expand_labels(self.labels))


@dataclass(frozen=True, kw_only=True)
class BreakerConfig:
    failure_threshold: int = opt(3, check=in_range(1))  # consecutive failures; 1 = a plain cooldown
    cooldown_s: float = opt(5.0, check=positive)  # first open period
    max_cooldown_s: float = opt(120.0, check=positive)  # backoff doubles up to this
    half_open_probes: int = opt(1, check=in_range(1))


@dataclass(frozen=True, kw_only=True)
class PrefixRoutingConfig:
    """Cache-aware routing, tier 1 (the `prefix` scorer; a strategy gives it its weight)."""
    guard: str = opt("spill", check=one_of("imbalance", "spill", "none"))
    abs_gap: float = opt(8.0, check=in_range(0))  # imbalance: holder load - least load > this ...
    rel_gap: float = opt(1.5, check=in_range(1))  # ... and holder load > this × least load
    spill_factor: float = opt(1.5, check=in_range(1))  # spill: holder load > factor × mean + slack
    spill_slack: float = opt(4.0, check=in_range(0))
    budget_mb: float = opt(64.0, check=positive)  # memory of the whole prefix index


@dataclass(frozen=True, kw_only=True)
class TracesConfig:
    """Every request's trace (llmgw.route.trace): the ring of recent ones, and an optional JSONL file."""
    kept: int = opt(1000, check=in_range(1, 1_000_000))  # recent traces kept in memory
    file: str | None = opt(None, check=nonempty)  # append finished traces here as JSON lines; None = no file
    sample: float = opt(1.0, check=in_range(0, 1))  # the share of finished traces written to the file
    max_file_mb: float = opt(64.0, check=positive)  # the file is rotated (file.1, file.2, ...) at this size
    files_kept: int = opt(3, check=in_range(0, 100))  # rotated files kept beside the live one
    # OpenTelemetry: finished traces as spans over OTLP/HTTP (the otel extra); "" = off
    otlp_endpoint: str = opt("", check=unset_or(http_url))  # e.g. http://collector:4318/v1/traces
    otlp_headers: dict[str, str] = opt(factory=dict, check=header_table)  # e.g. authorization; never logged
    service_name: str = opt("llmgw", check=nonempty)  # the spans' service.name
    otlp_phase_spans: bool = opt(False)  # each phase a child span (a waterfall) rather than a span event
    # the share of the router's own traces (no traceparent came) marked sampled: exported, and so
    # flagged to the engines; a client's traceparent decides for its own requests
    otlp_sample: float = opt(1.0, check=in_range(0, 1))


@dataclass(frozen=True, kw_only=True)
class RouterConfig:
    scrape_interval_s: float = opt(1.0, check=positive)
    stale_after_s: float = opt(5.0, check=positive)  # scraped metrics older than this are stale
    # an idle replica (no request of ours on it, its engine runs and queues nothing, nothing the
    # contract reads moves) is read up to this many times less often (never less often than
    # stale_after_s - 2 * scrape_interval_s allows); 1 = every replica every interval
    scrape_idle_factor: float = opt(4.0, check=(in_range(1), positive))
    connect_timeout_s: float = opt(3.0, check=positive)
    first_byte_timeout_s: float = opt(600.0, check=positive)  # long prefills take minutes
    # ... but while another replica is idle, a hung engine gets this long (plus 1 s per 1,000
    # prompt tokens) before the request is retried there; 0 = always the full ceiling
    first_byte_fast_s: float = opt(30.0, check=in_range(0))
    idle_timeout_s: float = opt(120.0, check=positive)  # longest gap between streamed chunks
    max_attempts: int = opt(3, check=in_range(1))  # replicas tried while nothing was sent
    kv_ceiling: float = opt(0.95, check=in_range(0, 1))  # hard KV-usage penalty above this
    saturation_load: float = opt(64.0, check=positive)  # running+waiting at which a replica is saturated
    queue_size: int = opt(256, check=in_range(0))  # requests waiting when all is saturated
    queue_timeout_s: float = opt(10.0, check=positive)  # then 429 with Retry-After
    # "fair": highest priority band first, tenants fairly within a band (docs/tenants.md); "fifo": arrival order
    queue_order: str = opt("fair", check=one_of("fair", "fifo"))
    decisions_kept: int = opt(1000, check=in_range(1))  # ring of recent decisions
    # LoRA on demand (vLLM): a load (with the unload that makes room) ends within this, or fails
    adapter_load_timeout_s: float = opt(120.0, check=positive)
    # a failed load of an adapter on a replica is not tried again for this long, doubling per failure
    adapter_backoff_s: float = opt(5.0, check=positive)
    adapter_backoff_max_s: float = opt(300.0, check=positive)
    traces: TracesConfig = opt(factory=TracesConfig)
    breaker: BreakerConfig = opt(factory=BreakerConfig)
    prefix: PrefixRoutingConfig = opt(factory=PrefixRoutingConfig)


@dataclass(frozen=True, kw_only=True)
class ScorerWeights:
    """A strategy's weights by scorer name; unset = 0 (the scorer does not take part).
    One field per name in ``llmgw.config.names.SCORER_NAMES`` (tests/test_route_names.py)."""
    load: float = opt(0.0, check=in_range(0))
    queue: float = opt(0.0, check=in_range(0))
    kv: float = opt(0.0, check=in_range(0))
    inflight: float = opt(0.0, check=in_range(0))
    weight: float = opt(0.0, check=in_range(0))
    session: float = opt(0.0, check=in_range(0))
    prefix: float = opt(0.0, check=in_range(0))
    kv_cache: float = opt(0.0, check=in_range(0))


@dataclass(frozen=True, kw_only=True)
class StrategyConfig:
    """A named strategy: only weights and a picker (a preset's name may be reused to replace it)."""
    name: str = opt(check=nonempty)
    picker: str = opt(DEFAULT_PICKER, check=one_of(*PICKER_NAMES))
    temperature: float | None = opt(None, check=positive)  # softmax only
    weights: ScorerWeights = opt(factory=ScorerWeights)


@dataclass(frozen=True, kw_only=True)
class MetricNames:
    """Prometheus metric name overrides (llmgw/route/contract.py); None = the engine's standard
    names (for vLLM every spelling its versions used). A name set here is the only one read for
    its role, and mandatory."""
    running: str | None = opt(None, check=(nonempty, metric_name))
    waiting: str | None = opt(None, check=(nonempty, metric_name))
    kv_usage: str | None = opt(None, check=(nonempty, metric_name))
    finished: str | None = opt(None, check=(nonempty, metric_name))  # finished-requests counter
    prefix_queries: str | None = opt(None, check=(nonempty, metric_name))  # with prefix_hits
    prefix_hits: str | None = opt(None, check=(nonempty, metric_name))
    cache_info: str | None = opt(None, check=(nonempty, metric_name))  # labels num_gpu_blocks, block_size
    lora_info: str | None = opt(None, check=(nonempty, metric_name))


@dataclass(frozen=True, kw_only=True)
class ReplicaConfig:
    url: str = opt(check=http_url)
    pool: str = opt(DEFAULT_POOL, check=nonempty)
    weight: float = opt(1.0, check=positive)
    # vLLM only: the engine publishes KV cache events (loopback, agent-owned) for tier-2 routing
    kv_events: bool = opt(False)
    role: str = opt("both", check=one_of(*ROLES))  # prefill / decode: a part of a disaggregated model ([models.pd])


@dataclass(frozen=True, kw_only=True)
class RoleGroupConfig:
    """[[models.deploy.roles]]: one group of a disaggregated model's replicas (docs/disaggregation.md):
    its role, how many, and what its engines get beyond the profile's args and env."""
    role: str = opt(check=one_of("prefill", "decode"))
    count: int = opt(1, check=in_range(0))
    args: tuple[str, ...] = opt(())  # after the profile's args (e.g. --kv-transfer-config with the role)
    env: tuple[str, ...] = opt((), items=key_value)  # after the profile's env


@dataclass(frozen=True, kw_only=True)
class SpreadConfig:
    """[[models.deploy.spread]]: how evenly replicas spread over the domains of one level."""
    level: str = opt(check=facility_level)  # site, room, row, rack or pdu
    max_skew: int = opt(1, check=in_range(1, 1000))  # most replicas over the least-loaded eligible domain
    hard: bool = opt(False)  # refuse a node past it (a replica may stay unplaced); else only prefer


@dataclass(frozen=True, kw_only=True)
class FacilityConfig:
    """[facility]: power budgets per failure domain, and rebalancing replicas whose spread is off."""
    budgets: dict[str, float] = opt(factory=dict)  # "pdu=p7" = 11000 (watts); checked by _facility_budgets
    rebalance: bool = opt(True)  # move replicas when nodes join and a model's spread is past its max skew
    rebalance_interval_s: float = opt(30.0, check=positive)  # at most one round of moves this often
    rebalance_max_moves: int = opt(1, check=in_range(1, 1000))  # replicas moved per round, fleet-wide


@dataclass(frozen=True, kw_only=True)
class DeployConfig:
    """[models.deploy]: replicas the agents run for this model, placed by the router."""
    count: int = opt(1, check=in_range(0))
    model_path: str | None = opt(None, check=nonempty)  # default: the model's name
    simulate: bool = opt(False)  # run `llmgw sim` for the engine instead of the real binary
    binary: str | None = opt(None, check=nonempty)  # default: vllm / llama-server on PATH
    args: tuple[str, ...] = opt(())
    env: tuple[str, ...] = opt((), items=key_value)
    gpus: int = opt(0, check=in_range(0))  # GPUs per replica
    gpu_memory_mb: int = opt(0, check=in_range(0))  # at least this much on each of them
    memory_mb: int = opt(0, check=in_range(0))  # host memory per replica
    node_selector: dict[str, str] = opt(factory=dict)  # only nodes with these labels
    health_timeout_s: float = opt(600.0, check=positive)
    pool: str = opt(DEFAULT_POOL, check=nonempty)
    weight: float = opt(1.0, check=positive)
    # vLLM only: the engine publishes KV cache events (local, agent-owned sockets) for tier-2 routing
    kv_events: bool = opt(False)
    # facility (docs/placement.md): unset spread = soft, max skew 1, over rooms, rows, racks and PDUs
    spread: tuple[SpreadConfig, ...] | None = opt(None, unique="level")
    watts: int = opt(0, check=in_range(0, 100_000))  # declared draw of one replica, for power budgets
    nodes: int = opt(1, check=replica_nodes)  # nodes per replica: one engine process on each
    keep_within: str | None = opt(None, check=facility_level)  # a multi-node replica's nodes in one domain
    # prefill/decode groups instead of `count` alike replicas (then count is unused): docs/disaggregation.md
    roles: tuple[RoleGroupConfig, ...] = opt((), unique="role")

    @property
    def replicas(self) -> int:
        """The replicas the profile asks for: its groups' counts, or its count."""
        return sum(g.count for g in self.roles) if self.roles else self.count


@dataclass(frozen=True, kw_only=True)
class PdConfig:
    """[models.pd]: prefill/decode disaggregation — a request's prefill on a prefill replica, its
    decode on a decode replica, the KV blocks moved between them by the engines' KV connector."""
    # prompts estimated shorter than this skip the prefill step: a decode replica prefills them
    # itself (disaggregation must never make a short chat slower; docs/disaggregation.md "Measured")
    min_prompt_tokens: int = opt(1024, check=in_range(0))
    # ... and so does a prompt with less than min_prompt_tokens left to compute on the decoder it
    # is decided to, which holds the rest cached (a conversation's next turn): false counts the
    # whole prompt, split whatever the decoders hold
    skip_cached: bool = opt(True)
    prefill_strategy: str = opt("prefill", check=known_strategy)  # the prefiller's decision
    decode_strategy: str = opt("decode", check=known_strategy)  # the decoder's decision
    prefill_timeout_s: float = opt(60.0, check=positive)  # the prefill step at most; then the decoder prefills
    # all of the model's prefill and decode replicas within one domain of this level (the transfer
    # network's reach); unset: anywhere
    keep_within: str | None = opt(None, check=facility_level)


@dataclass(frozen=True, kw_only=True)
class AdapterConfig:
    """[[models.adapters]]: one LoRA adapter of a model, asked for by its own OpenAI model name."""
    name: str = opt(check=nonempty)  # what clients put in "model"
    source: str = opt(check=nonempty)  # a path on the engine's node, or a repository id
    base_model: str | None = opt(None, check=nonempty)  # when set: the adapter must be for this base
    static: bool = opt(False)  # vLLM: loaded at start (--lora-modules), never unloaded
    scale: float = opt(1.0, check=in_range(0.0))  # llama.cpp: the scale a request for it applies


@dataclass(frozen=True, kw_only=True)
class LifecycleConfig:
    """[models.lifecycle]: what happens to a candidate made from the config file (`llmgw ctl config
    reload`, SIGHUP, or a start) once its replicas are ready (docs/lifecycle.md)."""
    auto_promote: bool = opt(False)  # promote it by itself once ready and the required suites passed
    require_suites: tuple[str, ...] = opt((), items=nonempty)  # run on the candidate; all must pass


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    name: str = opt(check=nonempty)
    engine: str = opt(check=one_of(*ENGINES))
    strategy: str = opt("chat", check=known_strategy)  # a preset or a [[strategies]] name
    pools: tuple[str, ...] = opt((), items=nonempty)
    metrics: MetricNames = opt(factory=MetricNames)
    replicas: tuple[ReplicaConfig, ...] = opt(())  # static endpoints
    deploy: DeployConfig | None = opt(None)  # replicas placed on agents
    adapters: tuple[AdapterConfig, ...] = opt((), unique="name")  # LoRA adapters of this model
    max_loaded_adapters: int = opt(4, check=in_range(1, 1024))  # per replica (vLLM: loaded on demand)
    max_lora_rank: int = opt(16, check=in_range(1, 1024))  # vLLM --max-lora-rank
    lifecycle: LifecycleConfig | None = opt(None)  # a config-file candidate's way to live
    autoscale: AutoscaleConfig | None = opt(None)  # the deploy count follows load (docs/autoscaling.md)
    pd: PdConfig | None = opt(None)  # prefill/decode disaggregation (docs/disaggregation.md)


@dataclass(frozen=True, kw_only=True)
class PoolConfig:
    name: str = opt(check=nonempty)
    priority: int = opt(0)  # lower = preferred
    max_inflight_per_replica: int | None = opt(None, check=in_range(1))


@dataclass(frozen=True, kw_only=True)
class HaConfig:
    """[ha]: several routers in front of one fleet (docs/ha.md)."""
    # routing as one: the PUB socket this router publishes its prefix-tree inserts on
    feed_listen: str = opt("127.0.0.1:0", check=host_port)
    feed_advertise: str = opt("", check=unset_or(host_or_host_port))  # what peers dial; "": the bound address


@dataclass(frozen=True, kw_only=True)
class Config:
    server: ServerConfig = opt(factory=ServerConfig)
    admin: AdminConfig = opt(factory=AdminConfig)
    control: ControlConfig = opt(factory=ControlConfig)
    store: StoreConfig = opt(factory=StoreConfig)
    agent: AgentConfig = opt(factory=AgentConfig)
    sim: SimConfig = opt(factory=SimConfig)
    router: RouterConfig = opt(factory=RouterConfig)
    models: tuple[ModelConfig, ...] = opt((), unique="name")
    pools: tuple[PoolConfig, ...] = opt((), unique="name")
    strategies: tuple[StrategyConfig, ...] = opt((), unique="name")
    facility: FacilityConfig = opt(factory=FacilityConfig)
    ha: HaConfig = opt(factory=HaConfig)
    tenants: TenantsConfig = opt(factory=TenantsConfig)
