"""The checks that span a config's sections: small functions registered with ``@_cross_check``,
each yielding (key path, message) for what it finds. :func:`llmgw.config.load.parse_config` runs
every one whose sections validated on their own; a model's own checks (pools, adapters, engines,
metrics, autoscaling) also run when one model is checked alone (the admin API's PUT)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from llmgw.config.autoscale import autoscale_problems
from llmgw.config.fields import _suggest, domain_budget
from llmgw.config.locate import KeyPath
from llmgw.config.names import SCORER_NAMES
from llmgw.config.schema import DEFAULT_POOL, Config

_CROSS_CHECKS: list[tuple[frozenset[str], Callable[[Config], Iterator[tuple[KeyPath, str]]]]] = []


def _cross_check(*needs: str):
    """Register a whole-config check; it runs when the top-level sections it needs are valid."""
    def register(fn):
        _CROSS_CHECKS.append((frozenset(needs), fn))
        return fn
    return register


@_cross_check("admin")
def _admin_tcp_needs_token(cfg: Config) -> Iterator[tuple[KeyPath, str]]:
    if cfg.admin.tcp is not None and cfg.admin.token is None:
        yield ("admin", "tcp"), "a TCP admin listener requires admin.token"


@_cross_check("ha")
def _ha_feed_advertise(cfg: Config) -> Iterator[tuple[KeyPath, str]]:
    host = cfg.ha.feed_listen.rpartition(":")[0]
    if host in ("0.0.0.0", "[::]", "*") and not cfg.ha.feed_advertise:
        yield ("ha", "feed_advertise"), ("feed_listen binds every interface: set feed_advertise to the "
                                         "address other routers dial")


@_cross_check("control")
def _control_tls_pair(cfg: Config) -> Iterator[tuple[KeyPath, str]]:
    c = cfg.control
    if (c.tls_cert is None) != (c.tls_key is None):
        yield ("control", "tls_cert" if c.tls_cert is None else "tls_key"), "tls_cert and tls_key go together"
    if c.tls is False and (c.tls_cert or c.tls_dir):
        yield ("control", "tls_cert" if c.tls_cert else "tls_dir"), "TLS settings with tls = false"
    if c.join_token and c.join_token_file:
        yield ("control", "join_token_file"), "set join_token or join_token_file, not both"
    if c.lost_after_s < c.not_ready_after_s:
        yield ("control", "lost_after_s"), "must be >= not_ready_after_s"


@_cross_check("store", "control")
def _store(cfg: Config) -> Iterator[tuple[KeyPath, str]]:
    s = cfg.store
    if s.url.startswith("sqlite:") and cfg.control.store and s.url.removeprefix("sqlite:") != cfg.control.store:
        yield ("store", "url"), "names another SQLite file than control.store: set one of them"
    if s.password_file is not None and not s.url.startswith(("postgresql://", "postgres://")):
        yield ("store", "password_file"), "is for a PostgreSQL store (store.url = \"postgresql://…\")"
    if s.password_file is not None and _url_password(s.url):
        yield ("store", "password_file"), "the url has a password already: set one of them"
    if s.lease_s <= s.timeout_s:
        yield ("store", "lease_s"), f"must be > timeout_s ({s.timeout_s}): a renewal that times out must end before the lease"
    if s.poll_s >= s.lease_s:
        yield ("store", "poll_s"), f"must be < lease_s ({s.lease_s})"


def _url_password(url: str) -> bool:
    from urllib.parse import parse_qsl, urlsplit

    try:
        parts = urlsplit(url)
        return bool(parts.password) or any(k == "password" for k, _ in parse_qsl(parts.query))
    except ValueError:
        return False


@_cross_check("agent")
def _agent_token(cfg: Config) -> Iterator[tuple[KeyPath, str]]:
    a = cfg.agent
    if a.join_token and a.join_token_file:
        yield ("agent", "join_token_file"), "set join_token or join_token_file, not both"
    for key in ("tls_ca", "tls_ca_pem", "tls_server_name"):
        if getattr(a, key) and a.tls is False:
            yield ("agent", key), f"{key} with tls = false"
    if a.tls_ca and a.tls_ca_pem:
        yield ("agent", "tls_ca_pem"), "set tls_ca or tls_ca_pem, not both"


@_cross_check("facility")
def _facility_budgets(cfg: Config) -> Iterator[tuple[KeyPath, str]]:
    for key, watts in cfg.facility.budgets.items():
        if (msg := domain_budget(key, watts)) is not None:
            yield ("facility", "budgets", key), msg


@_cross_check("strategies")
def _strategy_weights(cfg: Config) -> Iterator[tuple[KeyPath, str]]:
    for i, st in enumerate(cfg.strategies):
        w = st.weights
        if not any(getattr(w, k) for k in SCORER_NAMES):
            yield ("strategies", i, "weights"), "at least one weight must be > 0"


@_cross_check("models", "pools")
def _pool_references(cfg: Config) -> Iterator[tuple[KeyPath, str]]:
    known = [DEFAULT_POOL] + [p.name for p in cfg.pools]
    for i, m in enumerate(cfg.models):
        refs = [(("pools", j), p) for j, p in enumerate(m.pools)]
        refs += [(("replicas", j, "pool"), r.pool) for j, r in enumerate(m.replicas)]
        if m.deploy is not None:
            refs.append((("deploy", "pool"), m.deploy.pool))
        for sub, name in refs:
            if name not in known:
                yield ("models", i, *sub), f"unknown pool {name!r}{_suggest(name, known)}"


@_cross_check("models")
def _metric_pairs(cfg: Config) -> Iterator[tuple[KeyPath, str]]:
    """The prefix-cache counters are read as a pair (hits over queries): renaming one alone
    would pair it with a default spelling of the other, from another version."""
    for i, m in enumerate(cfg.models):
        q, h = m.metrics.prefix_queries, m.metrics.prefix_hits
        if (q is None) != (h is None):
            yield (("models", i, "metrics", "prefix_queries" if q is None else "prefix_hits"),
                   "prefix_queries and prefix_hits go together")


@_cross_check("models")
def _kv_events_engine(cfg: Config) -> Iterator[tuple[KeyPath, str]]:
    for i, m in enumerate(cfg.models):
        if m.deploy is not None and m.deploy.kv_events and m.engine != "vllm":
            yield ("models", i, "deploy", "kv_events"), f"needs engine = \"vllm\" ({m.engine} publishes no KV events)"


@_cross_check("models")
def autoscale_settings(cfg: Config) -> Iterator[tuple[KeyPath, str]]:
    yield from autoscale_problems(cfg.models)


@_cross_check("models")
def multi_node_engine(cfg: Config) -> Iterator[tuple[KeyPath, str]]:
    """A real vLLM multi-node replica runs on Ray (docs/placement.md, "vLLM multi-node replicas"):
    its args may not pick another executor backend."""
    for i, m in enumerate(cfg.models):
        d = m.deploy
        if d is None or d.nodes <= 1 or m.engine != "vllm" or d.simulate:
            continue
        for j, a in enumerate(d.args):
            flag, eq, val = a.partition("=")
            if flag.replace("_", "-") != "--distributed-executor-backend":
                continue
            if not eq:
                val = d.args[j + 1] if j + 1 < len(d.args) else ""
            if val != "ray":
                yield (("models", i, "deploy", "args"),
                       f"a multi-node vLLM replica (nodes = {d.nodes}) runs on Ray: "
                       f"--distributed-executor-backend must be ray (or left out), got {val!r}")


@_cross_check("models")
def _adapter_names(cfg: Config) -> Iterator[tuple[KeyPath, str]]:
    """An adapter's name is a model name clients use: it may not shadow a model or another model's adapter."""
    owner: dict[str, str] = {m.name: m.name for m in cfg.models}
    for i, m in enumerate(cfg.models):
        for j, a in enumerate(m.adapters):
            if a.name in owner:
                other = owner[a.name]
                what = "a model" if other == a.name else f"an adapter of model {other!r}"
                yield ("models", i, "adapters", j, "name"), f"{a.name!r} is already {what}"
            else:
                owner[a.name] = m.name



#: vLLM's --max-lora-rank choices (0.23 and 0.33 refuse any other value; 0.11 takes these too).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@_cross_check("models")
def _adapter_sources(cfg: Config) -> Iterator[tuple[KeyPath, str]]:
    """What each engine can load: llama.cpp loads every adapter at start from a GGUF file (its
    ``--lora-scaled FILE:SCALE[,...]`` splits at commas); vLLM takes only its own rank choices."""
    for i, m in enumerate(cfg.models):
        if m.engine == "llamacpp":
            for j, a in enumerate(m.adapters):
                if problem := llamacpp_adapter_problem(a.source):
                    yield ("models", i, "adapters", j, "source"), problem
        elif m.adapters and m.max_lora_rank not in VLLM_LORA_RANKS:
            yield (("models", i, "max_lora_rank"),
                   f"vLLM takes {', '.join(map(str, VLLM_LORA_RANKS))} (its --max-lora-rank choices)")


def llamacpp_adapter_problem(source: str) -> str | None:
    """Why ``source`` cannot be a llama.cpp adapter, or None."""
    if not source.lower().endswith(".gguf"):
        return (f"{source!r} is not a .gguf file: llama.cpp loads adapters at start from GGUF files on the "
                "engine's node (a repository id is for vLLM)")
    if "," in source:
        return f"{source!r} has a comma, which llama-server's --lora-scaled takes as a separator"
    if any(ord(c) < 32 or ord(c) == 127 for c in source):
        return f"{source!r} has a control character"
    return None


@_cross_check("models")
def disaggregation(cfg: Config) -> Iterator[tuple[KeyPath, str]]:
    """Prefill/decode groups (docs/disaggregation.md): a vLLM model's, with [models.pd] to route
    them; a disaggregated model needs somewhere to decode; its groups' counts are not autoscaled."""
    for i, m in enumerate(cfg.models):
        d = m.deploy
        roles = {r.role for r in m.replicas} | ({g.role for g in d.roles} if d is not None else set())
        split = bool(roles - {"both"})
        if split and m.engine != "vllm":
            yield ("models", i, "engine"), f"prefill/decode roles need engine = \"vllm\" ({m.engine} has no KV transfer)"
        if split and m.pd is None:
            yield ("models", i), "replicas with a prefill or decode role need a [models.pd] section to route them"
        if m.pd is not None and m.engine != "vllm":
            yield ("models", i, "pd"), f"needs engine = \"vllm\" ({m.engine} has no KV transfer)"
        elif m.pd is not None and "prefill" not in roles:
            yield (("models", i, "pd"), "no replica prefills: give some a prefill role (a static replica's role, or a "
                   "[[models.deploy.roles]] group)")
        if d is not None and d.roles:
            if m.autoscale is not None:
                yield ("models", i, "autoscale"), "not with [[models.deploy.roles]]: prefill and decode groups keep their counts"
            if d.nodes > 1:
                yield ("models", i, "deploy", "roles"), "not with multi-node replicas (nodes > 1)"
            if "decode" not in roles and not any(r.role == "both" for r in m.replicas):
                yield ("models", i, "deploy", "roles"), "a decode group is needed: prefill replicas only prefill"
        if m.pd is not None and m.pd.keep_within is not None and (d is None or not d.roles):
            yield ("models", i, "pd", "keep_within"), "places [[models.deploy.roles]] groups: this model has none"
