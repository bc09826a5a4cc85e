"""THE route table of the admin API: every endpoint, its query parameters, the type of the body it
reads and of the answer it gives, and the statuses it may answer. The HTTP shell dispatches by it
(and refuses to start with a handler missing or left over), the OpenAPI document is generated
from it, and a test keeps the committed document in step.

Paths are matched on the raw (still percent-encoded) path, then each parameter is decoded. Names
that may hold "/" (model names like ``org/model``, replica ids ``<model>/<hex>``) are "greedy":
they may be sent as ``%2F`` or as plain slashes. The most specific template wins, so
``/models/a/scale`` is the scale route of model ``a``; a model literally named ``a/scale`` is
reached as ``/models/a%2Fscale``."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

from llmgw.admin.lifecycle_schema import (
    EvalBody,
    JobView,
    PromoteBody,
    RevisionsView,
    SuiteBody,
    SuiteView,
    UpdateBody,
)
from llmgw.admin.schema import (
    AdapterSummary,
    CacheSummary,
    DecisionView,
    EndpointStatus,
    Event,
    HistoryEvent,
    JoinInfo,
    KvSummary,
    LabelKeysBody,
    LabelsBody,
    ModelDefinition,
    ModelView,
    NodeRevoked,
    NodeView,
    ReplicaView,
    RequestDecisions,
    ScaleBody,
    RoutersView,
    Status,
)
from llmgw.admin.schema_autoscale import AutoscaleView
from llmgw.admin.schema_config import ConfigReport
from llmgw.admin.schema_traces import TraceSummary, TraceView
from llmgw.admin.schema_facility import FacilityView, HoldBody, HoldView, PlacementExplanation
from llmgw.admin.schema_tenants import (
    KeyBody,
    KeyCreated,
    KeyPatch,
    KeyView,
    TenantBody,
    TenantPatch,
    TenantView,
    UsageReport,
)

__all__ = ["API_VERSION", "PREFIX", "ROUTES", "Link", "QueryParam", "Resolution", "Resolver", "Route"]

API_VERSION = "1"  # the document's version: bump on an incompatible change, with the prefix
PREFIX = "/api/v1"
MAX_LIMIT = 10_000  # ?limit= bound: answers stay a few MB at most
MAX_WINDOW_S = 300.0  # the cache counters' window (llmgw.route.cache_stats)

_PARAM = re.compile(r"\{([a-z_]+)\}")


@dataclass(frozen=True, slots=True)
class QueryParam:
    name: str
    type: type  # str, int, float or bool
    doc: str
    default: Any = None
    minimum: float | None = None
    maximum: float | None = None

    @property
    def constraints(self) -> dict[str, Any]:
        return {k: v for k, v in (("minimum", self.minimum), ("maximum", self.maximum)) if v is not None}


@dataclass(frozen=True, slots=True)
class Link:
    """The answer names a resource another operation takes (an OpenAPI link: clients and the
    stateful fuzzer follow it): path parameter ``param`` of ``operation`` is the answer's ``field``."""
    operation: str
    param: str
    field: str


@dataclass(frozen=True, slots=True)
class Route:
    method: str
    path: str  # template, e.g. "/api/v1/nodes/{name}"
    name: str  # operationId, and the name of the shell's handler
    summary: str
    response: Any  # the answer's type; None: no content
    status: int = 200  # on success
    body: Any = None  # the request body's type; None: reads none
    query: tuple[QueryParam, ...] = ()
    errors: tuple[int, ...] = ()  # beyond those implied (401; 400 for input; 404 for path parameters)
    tag: str = ""
    description: str = ""
    stream: bool = False  # NDJSON: one `response` a line, until the client leaves
    greedy: frozenset[str] = field(default_factory=frozenset)  # path parameters that may hold "/"
    links: tuple[Link, ...] = ()
    body_optional: bool = False  # the body may be left out (an empty request body)

    @property
    def path_params(self) -> tuple[str, ...]:
        return tuple(_PARAM.findall(self.path))

    @property
    def statuses(self) -> tuple[int, ...]:
        implied = {401}
        if self.body is not None or self.query or self.path_params:
            implied.add(400)
        if self.path_params:
            implied.add(404)
        return tuple(sorted({self.status, *implied, *self.errors}))


_DECISION_FILTERS = (
    QueryParam("model", str, "only decisions for this model (as the client named it)"),
    QueryParam("replica", str, "only decisions that chose this replica"),
    QueryParam("limit", int, "at most this many, the newest", default=100, minimum=1, maximum=MAX_LIMIT),
)

# Changes that must persist are refused while the store cannot write, rather than kept in memory:
# a 2xx means the change survives a restart.
_STORE_503 = (" 503 (with Retry-After) while the router's store cannot write, e.g. on a full disk: the "
              "change is not made, and the message says why.")

_NODE_LINKS = tuple(Link(op, "name", "name") for op in ("get_node", "set_node_labels", "remove_node_labels"))
_TENANT_LINKS = tuple(Link(op, "name", "name") for op in ("get_tenant", "update_tenant", "delete_tenant",
                                                          "create_key"))
_KEY_LINKS = tuple(Link(op, "id", "id") for op in ("get_key", "update_key", "revoke_key", "rotate_key"))
_MODEL_LINKS = tuple(Link(op, "name", "name") for op in ("get_model", "put_model", "delete_model", "scale_model"))

ROUTES: tuple[Route, ...] = (
    Route("GET", f"{PREFIX}/status", "get_status", "Daemon status", Status, tag="status",
          description="The control plane's summary and llmgw's version, the store's health (`store.state` "
                      "is `degraded` while it cannot write) and engines the store does not know."),
    Route("GET", f"{PREFIX}/routers", "list_routers", "List routers", RoutersView, tag="status",
          description="The routers sharing this router's store (several routers: docs/ha.md), which one leads "
                      "and at what epoch, and how this router's calls to the store fare."),
    # nodes
    Route("GET", f"{PREFIX}/nodes", "list_nodes", "List nodes", list[NodeView], tag="nodes"),
    Route("GET", f"{PREFIX}/nodes/{{name}}", "get_node", "Show a node", NodeView, tag="nodes"),
    Route("PUT", f"{PREFIX}/nodes/{{name}}/labels", "set_node_labels", "Set operator labels", NodeView,
          body=LabelsBody, tag="nodes", links=_NODE_LINKS, errors=(503,),
          description="Merged into the node's operator labels, which override the agent's own. A node may "
                      "be labelled before its agent first connects." + _STORE_503),
    Route("DELETE", f"{PREFIX}/nodes/{{name}}/labels", "remove_node_labels", "Remove operator labels", NodeView,
          body=LabelKeysBody, tag="nodes", links=_NODE_LINKS, errors=(503,), description=_STORE_503.strip()),
    Route("POST", f"{PREFIX}/nodes/{{name}}/revoke", "revoke_node", "Revoke a node", NodeRevoked, tag="nodes",
          description="Cuts the node off: its credential is refused from now on, its agent's connection is "
                      "closed, its replicas leave routing at once and are placed elsewhere, and the node is "
                      "forgotten. It can join again only as a new node, with the join token, after its agent's "
                      "credential file is deleted. 404 for a node the router does not know."),
    # joining
    Route("GET", f"{PREFIX}/join-info", "get_join_info", "What an agent needs to join", JoinInfo, tag="nodes",
          description="The control listener's address, the join token, and the CA agents pin. Holds the join "
                      "token: a secret."),
    Route("POST", f"{PREFIX}/join-token/rotate", "rotate_join_token", "Rotate the join token", JoinInfo,
          errors=(409,), tag="nodes",
          description="A new random join token, in force at once and written to control.join_token_file; the "
                      "old one admits nobody from now on. Nodes that joined keep their credentials. 409 when "
                      "the token is not from a file (inline in the config, made by the one-process mode, none)."),
    # models
    Route("GET", f"{PREFIX}/models", "list_models", "List models", list[ModelView], tag="models"),
    Route("POST", f"{PREFIX}/models", "create_model", "Create a model", ModelDefinition, status=201,
          body=ModelDefinition, errors=(409, 503), tag="models", links=_MODEL_LINKS,
          description="409 if a model of that name exists (PUT replaces one)." + _STORE_503),
    Route("GET", f"{PREFIX}/models/{{name}}", "get_model", "A model's definition in force", ModelDefinition,
          tag="models", greedy=frozenset({"name"}),
          description="The whole definition, defaults included, as a PUT would take it back."),
    Route("PUT", f"{PREFIX}/models/{{name}}", "put_model", "Create or replace a model", ModelDefinition,
          body=ModelDefinition, errors=(409, 503), tag="models", greedy=frozenset({"name"}), links=_MODEL_LINKS,
          description="The whole definition: its `name` must equal the path's. 409 for a "
                      "model the config file defines (change it there)." + _STORE_503),
    Route("DELETE", f"{PREFIX}/models/{{name}}", "delete_model", "Delete a model", None, status=204,
          errors=(409, 503), tag="models", greedy=frozenset({"name"}),
          description="Its placed replicas drain and stop. 409 for a model the config file defines." + _STORE_503),
    Route("POST", f"{PREFIX}/models/{{name}}/scale", "scale_model", "Scale a model", ModelDefinition,
          body=ScaleBody, errors=(409, 503), tag="models", greedy=frozenset({"name"}),
          description="Sets its deploy profile's count (409 if it has none: static replicas do not scale). "
                      "A config-file model may be scaled: the count is an operator override. On a model with "
                      "[models.autoscale] the count is pinned: the autoscaler holds it until `{\"release\": true}` "
                      "hands the count back to it (409 to release a model that has no autoscaler)." + _STORE_503),
    # autoscaling (docs/autoscaling.md)
    Route("GET", f"{PREFIX}/autoscale", "list_autoscale", "Autoscaled models", list[AutoscaleView], tag="models",
          description="Every model with [models.autoscale]: its rule, the count in force (pinned or not), its "
                      "replicas ready and starting, the latest decision with the inputs it read and what limited "
                      "it, and the decisions that changed the count. Empty when no model autoscales."),
    Route("GET", f"{PREFIX}/models/{{name}}/autoscale", "get_model_autoscale", "Explain a model's scale",
          AutoscaleView, errors=(409,), tag="models", greedy=frozenset({"name"}),
          description="What `llmgw ctl explain-scale MODEL` prints: the inputs, the rule, the decision, what "
                      "limited it, and the last decisions. 404 for no such model; 409 for a model without "
                      "[models.autoscale] (its count is the deploy profile's)."),
    # the model lifecycle: revisions, evals, jobs, suites (docs/lifecycle.md)
    Route("POST", f"{PREFIX}/models/{{name}}/update", "update_model", "Make a candidate revision", JobView,
          status=202, body=UpdateBody, body_optional=True, errors=(409, 503), tag="lifecycle",
          greedy=frozenset({"name"}), links=(Link("get_job", "id", "id"),),
          query=(QueryParam("canary", float, "percent of the model's client requests sent to the candidate once "
                            "it is ready", default=0.0, minimum=0, maximum=100),
                 QueryParam("ready_timeout_s", float, "the job fails if the candidate is not ready by then",
                            default=900.0, minimum=1, maximum=86400)),
          description="The body holds the changed parts of the definition (tables merge key by key); no body "
                      "re-rolls the current one. The candidate's replicas are placed beside the live ones and "
                      "take no client traffic (but the canary share). Answers the update job at once: it "
                      "succeeds when every candidate replica is ready, or fails with the engines' log tail "
                      "(the candidate is then discarded; live traffic is never touched). 409: a candidate or "
                      "an update job exists, a model from the config file, static replicas only." + _STORE_503),
    Route("POST", f"{PREFIX}/models/{{name}}/promote", "promote_model", "Make the candidate live", JobView,
          body=PromoteBody, body_optional=True, errors=(409, 503), tag="lifecycle", greedy=frozenset({"name"}),
          description="Its replicas take the model's client traffic at once; the old ones drain after their "
                      "in-flight requests. 409 (nothing changes) without a candidate, with candidate replicas "
                      "not ready, or when a required suite has not passed on this candidate." + _STORE_503),
    Route("POST", f"{PREFIX}/models/{{name}}/rollback", "rollback_model", "Discard the candidate, or undo a promote",
          JobView, errors=(409, 503), tag="lifecycle", greedy=frozenset({"name"}),
          description="With a candidate: it is discarded (its replicas drain and stop). Without one, within "
                      "an hour of a promote: the previous revision comes back as a candidate and is promoted "
                      "once ready. 409 when there is nothing to roll back." + _STORE_503),
    Route("POST", f"{PREFIX}/models/{{name}}/eval", "eval_model", "Run an eval suite", JobView, status=202,
          body=EvalBody, errors=(409,), tag="lifecycle", greedy=frozenset({"name"}),
          links=(Link("get_job", "id", "id"),),
          description="Runs the suite against the revision's replicas through the router's OpenAI port (so "
                      "routing, decisions and metrics apply) and answers the eval job at once; its `result` "
                      "is there when it ends. 409: no candidate to run on."),
    Route("GET", f"{PREFIX}/models/{{name}}/revisions", "get_revisions", "A model's revisions", RevisionsView,
          tag="lifecycle", greedy=frozenset({"name"}),
          description="Live, candidate (with its replicas' readiness) and the revision a rollback brings back; "
                      "with a canary, the candidate's and the live revision's error rates and TTFT."),
    Route("GET", f"{PREFIX}/jobs", "list_jobs", "Lifecycle jobs", list[JobView], tag="lifecycle",
          query=(QueryParam("model", str, "only this model's"),
                 QueryParam("kind", str, "only jobs of these kinds, comma-separated: update, eval, promote, rollback, "
                                         "scale (an autoscaler's changes of a count)"),
                 QueryParam("limit", int, "at most this many, the newest", default=100, minimum=1, maximum=1000)),
          description="Newest first, with their steps (an eval's result: GET the job)."),
    Route("GET", f"{PREFIX}/jobs/{{id}}", "get_job", "A job", JobView, tag="lifecycle"),
    Route("GET", f"{PREFIX}/suites", "list_suites", "Eval suites", list[SuiteView], tag="lifecycle"),
    Route("GET", f"{PREFIX}/suites/{{name}}", "get_suite", "An eval suite", SuiteView, tag="lifecycle"),
    Route("PUT", f"{PREFIX}/suites/{{name}}", "put_suite", "Create or replace an eval suite", SuiteView,
          body=SuiteBody, errors=(409, 503), tag="lifecycle", links=(Link("get_suite", "name", "name"),),
          description="The TOML text; 400 lists every problem as `suite NAME:LINE: key: what`." + _STORE_503),
    Route("DELETE", f"{PREFIX}/suites/{{name}}", "delete_suite", "Delete an eval suite", None, status=204,
          errors=(503,), tag="lifecycle", description="Its stored results stay." + _STORE_503),
    # replicas and endpoints
    Route("GET", f"{PREFIX}/replicas", "list_replicas", "List placed replicas", list[ReplicaView], tag="replicas",
          query=(QueryParam("model", str, "only this model's"), QueryParam("node", str, "only this node's"))),
    Route("POST", f"{PREFIX}/replicas/{{id}}/restart", "restart_replica", "Restart a replica", ReplicaView,
          status=202, tag="replicas", greedy=frozenset({"id"}), links=(Link("restart_replica", "id", "replica"),),
          description="Asks its agent to restart the engine (also how a crash loop is cleared); answers "
                      "before the engine is back."),
    Route("GET", f"{PREFIX}/endpoints", "list_endpoints", "List the router's endpoints", list[EndpointStatus],
          tag="replicas", query=(QueryParam("model", str, "only this model's"),),
          description="Every replica the scheduler knows (static and placed), with its breaker and its "
                      "scraped metrics."),
    Route("GET", f"{PREFIX}/adapters", "list_adapters", "LoRA adapters per replica", AdapterSummary,
          tag="replicas", query=(QueryParam("model", str, "only this model's replicas"),),
          description="Which vLLM replica holds which LoRA adapter (loaded on demand, or static), the loads "
                      "in progress with the requests waiting for them, failed loads in backoff, and the "
                      "load and unload counts by outcome."),
    # decisions and cache hits
    Route("GET", f"{PREFIX}/decisions", "list_decisions", "Recent routing decisions", list[DecisionView],
          tag="decisions", query=_DECISION_FILTERS, description="Newest first, each with its whole rationale."),
    Route("GET", f"{PREFIX}/decisions/{{request_id}}", "get_decision", "A request's decisions", RequestDecisions,
          tag="decisions", description="404 once the request has left the ring of recent decisions."),
    # traces
    Route("GET", f"{PREFIX}/traces", "list_traces", "Recent traces", list[TraceSummary], tag="traces",
          query=(QueryParam("model", str, "only traces of this model (as the client named it)"),
                 QueryParam("kind", str, "only `request` or `job` traces"),
                 QueryParam("outcome", str, "only traces that ended so (ok, engine_error, upstream_failed, failed, "
                                            "rejected, client_cancelled), or in_flight"),
                 QueryParam("limit", int, "at most this many, the newest", default=100, minimum=1,
                            maximum=MAX_LIMIT)),
          links=(Link("get_trace", "request_id", "id"),),
          description="Newest first, from the router's ring of recent traces (`router.traces.kept`); a "
                      "request's trace is there from its start, so in-flight requests are listed too."),
    Route("GET", f"{PREFIX}/traces/{{request_id}}", "get_trace", "A request's trace", TraceView, tag="traces",
          description="Its phases (contiguous: their durations add up to `total_ms`) and attempts, each with "
                      "its replica, the index of its decision in `GET /api/v1/decisions/{request_id}`, its "
                      "times and bytes, and why it was retried. 404 once it has left the ring. A lifecycle "
                      "job's id answers the job's trace (kind `job`: its steps as phases), kept with the job "
                      "in the store."),
    Route("GET", f"{PREFIX}/cache", "get_cache", "Cache-hit summary", CacheSummary, tag="cache",
          query=(QueryParam("window_s", float, "the window, ending now", default=MAX_WINDOW_S, minimum=10,
                            maximum=MAX_WINDOW_S),),
          description="Per model and per replica: routing decisions that sent a request to a replica "
                      "holding its prefix, and the engines' own prefix-cache hit rates."),
    Route("GET", f"{PREFIX}/kv", "get_kv", "Tier 2: KV index and parity", KvSummary, tag="cache",
          description="Per replica: the blocks the router's KV index holds for it, its KV-event feed (messages, "
                      "resets, gaps, seconds since the last message), the decisions each tier made for it, and "
                      "the parity self-check (do the engine's reported blocks carry the router's hashes?); per "
                      "model the mismatch rate. Replicas of models with `kv_events` and any with index state."),
    Route("GET", f"{PREFIX}/history", "list_history", "Event history", list[HistoryEvent], tag="history",
          query=(QueryParam("model", str, "only this model's"), QueryParam("node", str, "only this node's"),
                 QueryParam("replica", str, "only this replica's"),
                 QueryParam("limit", int, "at most this many, the newest", default=100, minimum=1,
                            maximum=MAX_LIMIT)), errors=(503,),
          description="Newest first: what the control plane did and saw, as kept in its store (503 if it "
                      "cannot be read; events of a time the store could not write join it once it can)."),
    # the facility: failure domains, holds, power, placement explained (docs/placement.md)
    Route("GET", f"{PREFIX}/facility", "get_facility", "Failure domains, holds and power", FacilityView,
          tag="facility",
          description="Every domain a node is in (from its llmgw.io/site, room, row, rack and pdu labels) with "
                      "its nodes, replicas, hold, and power draw against its budget."),
    Route("PUT", f"{PREFIX}/facility/holds/{{domain}}", "hold_domain", "Hold a domain", HoldView, body=HoldBody,
          tag="facility", errors=(503,), links=(Link("release_domain", "domain", "domain"),),
          description="Nothing new is placed in the domain (`rack=r12`, or `llmgw.io/rack=r12`); with `drain`, "
                      "its replicas are placed elsewhere first and each is stopped once its replacement is "
                      "ready and its requests have ended (with no room elsewhere, they stay). Holding a held "
                      "domain changes its reason and drain. 404, naming the known domains, for a domain no "
                      "node is in." + _STORE_503),
    Route("DELETE", f"{PREFIX}/facility/holds/{{domain}}", "release_domain", "Release a held domain", None,
          status=204, tag="facility", errors=(503,),
          description="Placement may use the domain again (replicas moved away stay where they are, unless "
                      "rebalancing moves them back). 404 for a domain not held." + _STORE_503),
    Route("GET", f"{PREFIX}/placement/{{target}}", "explain_placement", "Explain a placement",
          PlacementExplanation, tag="facility", greedy=frozenset({"target"}),
          description="For a placed replica (`<model>/<hex>`): its node and domains and why, and every other "
                      "node with the rule that refused it (held, selector, gpus, gpu_memory, memory, power, "
                      "spread, not_ready) or, if it fits, how it ranks. For a model: the same table for its "
                      "next replica, or why none can be placed. 404 for neither."),
    # tenants, API keys and usage (docs/tenants.md)
    Route("GET", f"{PREFIX}/tenants", "list_tenants", "List tenants", list[TenantView], tag="tenants",
          description="Every tenant (the static keys' one too, when [server] api_keys has keys) with its active "
                      "keys, today's usage, this router's view of its quotas, and its requests waiting."),
    Route("POST", f"{PREFIX}/tenants", "create_tenant", "Create a tenant", TenantView, status=201, body=TenantBody,
          errors=(409, 503), tag="tenants", links=_TENANT_LINKS,
          description="400 names the bad field; 409 if it exists, or for the static keys' tenant's name "
                      "([tenants] static_tenant)." + _STORE_503),
    Route("GET", f"{PREFIX}/tenants/{{name}}", "get_tenant", "Show a tenant", TenantView, tag="tenants"),
    Route("PATCH", f"{PREFIX}/tenants/{{name}}", "update_tenant", "Change a tenant", TenantView, body=TenantPatch,
          errors=(409, 503), tag="tenants",
          description="The fields given change (quota limit by limit: a null limit removes it); in force on every "
                      "router within [store] poll_s. 409 for the static keys' tenant." + _STORE_503),
    Route("DELETE", f"{PREFIX}/tenants/{{name}}", "delete_tenant", "Delete a tenant", None, status=204,
          errors=(409, 503), tag="tenants",
          description="With its keys (refused from now on); its usage records stay." + _STORE_503),
    Route("POST", f"{PREFIX}/tenants/{{name}}/keys", "create_key", "Make an API key", KeyCreated, status=201,
          body=KeyBody, body_optional=True, errors=(503,), tag="tenants", links=_KEY_LINKS,
          description="The answer holds the secret (`key`): shown this once, never again — only its hash is "
                      "kept. 404 for an unknown tenant." + _STORE_503),
    Route("GET", f"{PREFIX}/keys", "list_keys", "List API keys", list[KeyView], tag="tenants",
          query=(QueryParam("tenant", str, "only this tenant's"),),
          description="Every key with its state (active, revoked, expired); never a secret or a hash."),
    Route("GET", f"{PREFIX}/keys/{{id}}", "get_key", "Show an API key", KeyView, tag="tenants"),
    Route("PATCH", f"{PREFIX}/keys/{{id}}", "update_key", "Change an API key", KeyView, body=KeyPatch,
          errors=(503,), tag="tenants",
          description="name, expires_at, models, quota (merged), band; the secret never changes (rotate makes "
                      "a new key)." + _STORE_503),
    Route("POST", f"{PREFIX}/keys/{{id}}/revoke", "revoke_key", "Revoke an API key", KeyView, errors=(503,),
          tag="tenants",
          description="Refused (401) from now on, by every router within [store] poll_s. Revoking a revoked key "
                      "changes nothing." + _STORE_503),
    Route("POST", f"{PREFIX}/keys/{{id}}/rotate", "rotate_key", "Rotate an API key", KeyCreated, status=201,
          errors=(409, 503), tag="tenants", links=_KEY_LINKS,
          query=(QueryParam("grace_s", float, "the old key keeps working this long (0: revoked at once)",
                            default=0.0, minimum=0, maximum=90 * 86400),),
          description="A new key for the same tenant with the same settings (its `rotated_from` the old id), "
                      "its secret in the answer, once; the old key is revoked, or expires after grace_s. 409 "
                      "for a revoked key." + _STORE_503),
    Route("GET", f"{PREFIX}/usage", "get_usage", "Usage per tenant, key, model, day or hour", UsageReport,
          tag="tenants", errors=(503,),
          query=(QueryParam("tenant", str, "only this tenant's"), QueryParam("key", str, "only this key's (its id)"),
                 QueryParam("model", str, "only this model's"),
                 QueryParam("since", str, "Unix seconds, or a duration ago: 30m, 24h, 7d (default 7d)"),
                 QueryParam("until", str, "Unix seconds, or a duration ago (default now)"),
                 QueryParam("by", str, "group by tenant, model, key, day or hour", default="tenant")),
          description="Requests, prompt, cached and completion tokens, and errors, summed per group from the "
                      "store's hourly records (every router's flushed use), with this router's use not yet "
                      "flushed added. 503 if the store cannot be read."),
    # the console's feed, and this document
    Route("GET", f"{PREFIX}/events", "events", "Live event stream", Event, tag="events", stream=True,
          description="NDJSON: a snapshot line, then decision lines as they happen and update lines with "
                      "the sections that changed (checked once a second), and a ping line every 5 s. "
                      "Lossy under load: reconnect for a fresh snapshot."),
    # the config file while the daemon runs (docs/configuration.md, "Reloading the config file")
    Route("GET", f"{PREFIX}/config/check", "check_config", "What a reload would do", ConfigReport, errors=(400, 409),
          tag="config",
          description="Re-reads the config file the daemon started with and lists every difference from what runs, "
                      "each with its action (apply at once, a candidate, or at the next start) and why. Changes "
                      "nothing. 400 with every problem (file:line: key: what) when the file does not parse; 409 "
                      "when the daemon runs without a config file."),
    Route("POST", f"{PREFIX}/config/reload", "reload_config", "Reload the config file", ConfigReport,
          errors=(400, 409, 503), tag="config",
          description="What `GET /config/check` lists, done: hot changes apply at once, a model whose engines "
                      "would change gets a candidate (its update job in `jobs`; promoted by itself only with "
                      "`[models.lifecycle] auto_promote`), the rest waits for a start. SIGHUP to the daemon does the "
                      "same. A file that does not parse is refused whole (400, every problem with its line) and "
                      "nothing changes." + _STORE_503),
    Route("GET", f"{PREFIX}/openapi.json", "get_openapi", "This document", dict[str, Any], tag="meta"),
    Route("GET", f"{PREFIX}/suite-schema.json", "get_suite_schema", "The eval suites' JSON Schema", dict[str, Any],
          tag="meta", errors=(404,),
          description="A JSON Schema of an eval suite (the TOML file `llmgw ctl suites` stores, as data), for "
                      "editors and generators. 404 when this llmgw has no eval suites."),
)


@dataclass(frozen=True, slots=True)
class Resolution:
    route: Route | None  # None: 404 (allow empty) or 405 (allow lists the methods)
    params: dict[str, str]
    allow: tuple[str, ...] = ()


class Resolver:
    """Raw path + method → the route and its decoded path parameters."""

    def __init__(self, routes: tuple[Route, ...] = ROUTES) -> None:
        by_path: dict[str, dict[str, Route]] = {}
        for r in routes:
            methods = by_path.setdefault(r.path, {})
            if r.method in methods:
                raise ValueError(f"{r.method} {r.path} is in the table twice")
            methods[r.method] = r
        # the most literal segments first: /models/{name}/scale before a greedy /models/{name}
        order = sorted(by_path, key=lambda p: (-len([s for s in p.split("/") if s and "{" not in s]), p))
        self._templates = [(self._compile(p, by_path[p]), by_path[p]) for p in order]

    @staticmethod
    def _compile(path: str, methods: dict[str, Route]) -> re.Pattern[str]:
        greedy = frozenset().union(*(r.greedy for r in methods.values()))
        out, pos = [], 0
        for m in _PARAM.finditer(path):
            out.append(re.escape(path[pos:m.start()]))
            out.append(f"(?P<{m.group(1)}>{'.+' if m.group(1) in greedy else '[^/]+'})")
            pos = m.end()
        out.append(re.escape(path[pos:]))
        return re.compile("".join(out))

    def resolve(self, method: str, raw_path: str) -> Resolution:
        for pattern, methods in self._templates:
            m = pattern.fullmatch(raw_path)
            if m is None:
                continue
            route = methods.get(method)
            if route is None:
                return Resolution(None, {}, tuple(sorted(methods)))
            return Resolution(route, {k: unquote(v, errors="replace") for k, v in m.groupdict().items()})
        return Resolution(None, {})
