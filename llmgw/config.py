"""Typed llmgw configuration: one frozen-dataclass tree, read from TOML, written with tomli-w.

The schema is declarative.  Each section is a frozen dataclass: its annotations give the TOML
type (str, int, float, bool, ``X | None``, ``tuple[X, ...]`` for arrays, a nested dataclass for
a table, ``tuple[Section, ...]`` for an array of tables) and ``opt(...)`` in the field gives
the default, value checks, per-item checks and uniqueness.  One generic walker does type
checking, defaults and unknown-key detection and collects every problem; checks spanning
sections are small functions registered with ``@_cross_check``.  A new section is a new
dataclass plus a field on its parent: no new validation code.

Pure module: no I/O besides ``load_config`` reading the file, no sockets, no trio.
"""

from __future__ import annotations

import difflib
import os
import re
import socket
import tomllib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from datetime import date, datetime, time
from functools import cache
from pathlib import Path
from types import UnionType
from typing import Any, Union, get_args, get_origin, get_type_hints
from urllib.parse import urlsplit

import tomli_w

from llmgw.config_locate import KeyPath, TomlLocator

__all__ = [
    "AdminConfig", "AgentConfig", "BreakerConfig", "ControlConfig", "DeployConfig", "GpuConfig", "RestartConfig", "Config", "PrefixRoutingConfig", "RouterConfig", "ScorerWeights", "StrategyConfig", "ConfigError", "ConfigProblem", "MetricNames", "ModelConfig",
    "PoolConfig", "ReplicaConfig", "ServerConfig", "SimConfig", "DEFAULT_POOL",
    "default_admin_socket", "default_config", "dump_config", "init_config_text",
    "load_config", "model_from_dict", "model_to_dict", "parse_config",
]

ENGINES = ("vllm", "llamacpp")
STRATEGIES = ("chat", "batch", "long-context")
DEFAULT_POOL = "default"

Check = Callable[[Any], "str | None"]  # returns an error message, or None when the value is fine


def opt(default: Any = MISSING, *, factory: Any = MISSING, check: Check | tuple[Check, ...] = (),
        items: Check | tuple[Check, ...] = (), unique: str | None = None) -> Any:
    """Declare a config field.  No default and no factory = required key.

    check:  checks on the converted value; items: checks on each array element;
    unique: for an array of tables, the attribute that must be unique across elements.
    """
    tup = lambda c: c if isinstance(c, tuple) else (c,)  # noqa: E731
    return field(default=default, default_factory=factory,
                 metadata={"checks": tup(check), "items": tup(items), "unique": unique})


# ---------------------------------------------------------------------------------- checks
def one_of(*choices: str) -> Check:
    def check(v: str) -> str | None:
        if v in choices:
            return None
        near = difflib.get_close_matches(v, choices, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        return f"expected one of {', '.join(map(repr, choices))}; got {v!r}{hint}"
    return check


def in_range(lo: float, hi: float | None = None) -> Check:
    def check(v: float) -> str | None:
        if v >= lo and (hi is None or v <= hi):
            return None
        return f"must be >= {lo}, got {v!r}" if hi is None else f"must be in {lo}..{hi}, got {v!r}"
    return check


def positive(v: float) -> str | None:
    return None if v > 0 and v != float("inf") else f"must be a finite number > 0, got {v!r}"


def nonempty(v: str) -> str | None:
    return None if v.strip() else "must not be empty"


def http_url(v: str) -> str | None:
    try:
        u = urlsplit(v)
        u.port  # noqa: B018 -- raises ValueError on a bad port
    except ValueError:
        u = None
    if u is None or u.scheme not in ("http", "https") or not u.hostname or re.search(r"\s", v):
        return f"not an http(s) URL: {v!r}"
    return None


def host_port(v: str) -> str | None:
    host, sep, port = v.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if sep and host and re.fullmatch(r"[0-9]{1,5}", port) and int(port) <= 65535:
        return None
    return f"expected \"host:port\", got {v!r}"


def header_name(v: str) -> str | None:
    ok = re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", v)
    return None if ok else f"not a valid HTTP header name: {v!r}"


# ---------------------------------------------------------------------------------- schema
# Strategy names a model may use: the presets plus the file's own [[strategies]], set while a
# file is parsed so the field check sees them even when other sections have errors.
_KNOWN_STRATEGIES: ContextVar[frozenset[str]] = ContextVar("_KNOWN_STRATEGIES", default=frozenset(STRATEGIES))


def known_strategy(v: str) -> str | None:
    known = _KNOWN_STRATEGIES.get()
    if v in known:
        return None
    ordered = [*STRATEGIES, *sorted(known - set(STRATEGIES))]
    close = difflib.get_close_matches(v, ordered, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"expected one of {', '.join(repr(k) for k in ordered)}; got {v!r}{hint}"


def node_name(v: str) -> str | None:
    ok = re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9._-]{0,251}[A-Za-z0-9])?", v)
    return None if ok else f"not a valid node name (letters, digits, '.', '_', '-'; at most 253): {v!r}"


def label_keys(labels: dict[str, str]) -> str | None:
    for k in labels:
        if not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9._/-]{0,251}[A-Za-z0-9])?", k):
            return f"not a valid label key: {k!r}"
    return None


def key_value(v: str) -> str | None:
    k, sep, _ = v.partition("=")
    return None if sep and k.strip() else f"expected \"KEY=VALUE\", got {v!r}"


def _state_home() -> Path:
    return Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "llmgw"


def default_store_path() -> str:
    """$XDG_STATE_HOME/llmgw/router.db (~/.local/state/llmgw/router.db)."""
    return str(_state_home() / "router.db")


def default_agent_state_dir() -> str:
    """$XDG_STATE_HOME/llmgw/agent (~/.local/state/llmgw/agent)."""
    return str(_state_home() / "agent")


def default_node_name() -> str:
    name = socket.gethostname().split(".")[0] or "localhost"
    return name if node_name(name) is None else "localhost"


def default_admin_socket() -> str:
    """$XDG_RUNTIME_DIR/llmgw-<uid>/admin.sock, or under /tmp when XDG_RUNTIME_DIR is unset."""
    base = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    uid = os.getuid() if hasattr(os, "getuid") else os.getpid()
    return str(Path(base) / f"llmgw-{uid}" / "admin.sock")


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    host: str = opt("127.0.0.1", check=nonempty)
    port: int = opt(8000, check=in_range(0, 65535))
    api_keys: tuple[str, ...] = opt((), items=nonempty)  # empty = no auth
    max_body_bytes: int = opt(8 * 1024 * 1024, check=in_range(1))
    request_id_header: str = opt("x-request-id", check=header_name)


@dataclass(frozen=True, kw_only=True)
class AdminConfig:
    socket: str = opt(factory=default_admin_socket, check=nonempty)
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
    listen: str = opt("127.0.0.1:7070", check=host_port)  # agents connect here
    join_token: str | None = opt(None, check=nonempty)  # agents must present it; unset = no agents
    join_token_file: str | None = opt(None, check=nonempty)  # or read it from this file
    tls_cert: str | None = opt(None, check=nonempty)  # PEM; with tls_key, the stream is TLS
    tls_key: str | None = opt(None, check=nonempty)
    heartbeat_s: float = opt(1.0, check=positive)
    not_ready_after_s: float = opt(5.0, check=positive)  # silence before a node is not ready
    lost_after_s: float = opt(30.0, check=positive)  # not ready this long = lost, replicas move
    max_lost_fraction: float = opt(0.5, check=in_range(0, 1))  # more silent at once = our partition
    settle_s: float = opt(3.0, check=in_range(0))  # after a start, agents get this long to join before placing
    drain_timeout_s: float = opt(30.0, check=positive)  # a stopping replica's requests may finish
    max_message_bytes: int = opt(4 * 1024 * 1024, check=in_range(1024))
    store: str = opt(factory=default_store_path, check=nonempty)  # SQLite file; ":memory:" = none


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
    node: str = opt(factory=default_node_name, check=node_name)
    router: str = opt("127.0.0.1:7070", check=host_port)  # the router's [control] listen address
    join_token: str | None = opt(None, check=nonempty)
    join_token_file: str | None = opt(None, check=nonempty)
    tls: bool = opt(False)
    tls_ca: str | None = opt(None, check=nonempty)  # PEM bundle that signed the router's cert
    labels: dict[str, str] = opt(factory=dict, check=label_keys)  # llmgw.io/rack = "r12", ...
    advertise_host: str = opt("127.0.0.1", check=nonempty)  # engines listen here; the router dials it
    state_dir: str = opt(factory=default_agent_state_dir, check=nonempty)
    gpus: tuple[GpuConfig, ...] | None = opt(None)  # declared GPUs instead of nvidia-smi's
    memory_mb: int | None = opt(None, check=in_range(0))  # instead of /proc/meminfo
    reconnect_min_s: float = opt(0.5, check=positive)
    reconnect_max_s: float = opt(30.0, check=positive)
    stop_grace_s: float = opt(10.0, check=positive)  # TERM, this long, then KILL the engine's group
    restart: RestartConfig = opt(factory=RestartConfig)


@dataclass(frozen=True, kw_only=True)
class BreakerConfig:
    failure_threshold: int = opt(3, check=in_range(1))  # consecutive failures; 1 = a plain cooldown
    cooldown_s: float = opt(5.0, check=positive)  # first open period
    max_cooldown_s: float = opt(120.0, check=positive)  # backoff doubles up to this
    half_open_probes: int = opt(1, check=in_range(1))


@dataclass(frozen=True, kw_only=True)
class PrefixRoutingConfig:
    """Cache-aware routing, tier 1 (the `prefix` scorer; a strategy gives it its weight)."""
    guard: str = opt("imbalance", check=one_of("imbalance", "spill", "none"))
    abs_gap: float = opt(8.0, check=in_range(0))  # imbalance: holder load - least load > this ...
    rel_gap: float = opt(1.5, check=in_range(1))  # ... and holder load > this × least load
    spill_factor: float = opt(1.5, check=in_range(1))  # spill: holder load > factor × mean + slack
    spill_slack: float = opt(4.0, check=in_range(0))
    budget_mb: float = opt(64.0, check=positive)  # memory of the whole prefix index


@dataclass(frozen=True, kw_only=True)
class RouterConfig:
    scrape_interval_s: float = opt(1.0, check=positive)
    stale_after_s: float = opt(5.0, check=positive)  # scraped metrics older than this are stale
    connect_timeout_s: float = opt(3.0, check=positive)
    first_byte_timeout_s: float = opt(600.0, check=positive)  # long prefills take minutes
    idle_timeout_s: float = opt(120.0, check=positive)  # longest gap between streamed chunks
    max_attempts: int = opt(3, check=in_range(1))  # replicas tried while nothing was sent
    kv_ceiling: float = opt(0.95, check=in_range(0, 1))  # hard KV-usage penalty above this
    saturation_load: float = opt(64.0, check=positive)  # running+waiting at which a replica is saturated
    queue_size: int = opt(256, check=in_range(0))  # requests waiting when all is saturated
    queue_timeout_s: float = opt(10.0, check=positive)  # then 429 with Retry-After
    decisions_kept: int = opt(1000, check=in_range(1))  # ring of recent decisions
    breaker: BreakerConfig = opt(factory=BreakerConfig)
    prefix: PrefixRoutingConfig = opt(factory=PrefixRoutingConfig)


@dataclass(frozen=True, kw_only=True)
class ScorerWeights:
    """A strategy's weights by scorer name; unset = 0 (the scorer does not take part)."""
    load: float = opt(0.0, check=in_range(0))
    queue: float = opt(0.0, check=in_range(0))
    kv: float = opt(0.0, check=in_range(0))
    inflight: float = opt(0.0, check=in_range(0))
    weight: float = opt(0.0, check=in_range(0))
    session: float = opt(0.0, check=in_range(0))
    prefix: float = opt(0.0, check=in_range(0))


@dataclass(frozen=True, kw_only=True)
class StrategyConfig:
    """A named strategy: only weights and a picker (a preset's name may be reused to replace it)."""
    name: str = opt(check=nonempty)
    picker: str = opt("max-score", check=one_of("max-score", "power-of-two", "softmax", "round-robin"))
    temperature: float | None = opt(None, check=positive)  # softmax only
    weights: ScorerWeights = opt(factory=ScorerWeights)


@dataclass(frozen=True, kw_only=True)
class MetricNames:
    """Prometheus metric name overrides; None = the engine's standard name."""
    running: str | None = opt(None, check=nonempty)
    waiting: str | None = opt(None, check=nonempty)
    kv_usage: str | None = opt(None, check=nonempty)


@dataclass(frozen=True, kw_only=True)
class ReplicaConfig:
    url: str = opt(check=http_url)
    pool: str = opt(DEFAULT_POOL, check=nonempty)
    weight: float = opt(1.0, check=positive)


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


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    name: str = opt(check=nonempty)
    engine: str = opt(check=one_of(*ENGINES))
    strategy: str = opt("chat", check=known_strategy)  # a preset or a [[strategies]] name
    pools: tuple[str, ...] = opt((), items=nonempty)
    metrics: MetricNames = opt(factory=MetricNames)
    replicas: tuple[ReplicaConfig, ...] = opt(())  # static endpoints
    deploy: DeployConfig | None = opt(None)  # replicas placed on agents


@dataclass(frozen=True, kw_only=True)
class PoolConfig:
    name: str = opt(check=nonempty)
    priority: int = opt(0)  # lower = preferred
    max_inflight_per_replica: int | None = opt(None, check=in_range(1))


@dataclass(frozen=True, kw_only=True)
class Config:
    server: ServerConfig = opt(factory=ServerConfig)
    admin: AdminConfig = opt(factory=AdminConfig)
    control: ControlConfig = opt(factory=ControlConfig)
    agent: AgentConfig = opt(factory=AgentConfig)
    sim: SimConfig = opt(factory=SimConfig)
    router: RouterConfig = opt(factory=RouterConfig)
    models: tuple[ModelConfig, ...] = opt((), unique="name")
    pools: tuple[PoolConfig, ...] = opt((), unique="name")
    strategies: tuple[StrategyConfig, ...] = opt((), unique="name")


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


@_cross_check("control")
def _control_tls_pair(cfg: Config) -> Iterator[tuple[KeyPath, str]]:
    c = cfg.control
    if (c.tls_cert is None) != (c.tls_key is None):
        yield ("control", "tls_cert" if c.tls_cert is None else "tls_key"), "tls_cert and tls_key go together"
    if c.join_token and c.join_token_file:
        yield ("control", "join_token_file"), "set join_token or join_token_file, not both"
    if c.lost_after_s < c.not_ready_after_s:
        yield ("control", "lost_after_s"), "must be >= not_ready_after_s"


@_cross_check("agent")
def _agent_token(cfg: Config) -> Iterator[tuple[KeyPath, str]]:
    a = cfg.agent
    if a.join_token and a.join_token_file:
        yield ("agent", "join_token_file"), "set join_token or join_token_file, not both"
    if a.tls_ca and not a.tls:
        yield ("agent", "tls_ca"), "tls_ca needs tls = true"


@_cross_check("strategies")
def _strategy_weights(cfg: Config) -> Iterator[tuple[KeyPath, str]]:
    for i, st in enumerate(cfg.strategies):
        w = st.weights
        if not any((w.load, w.queue, w.kv, w.inflight, w.weight, w.session, w.prefix)):
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


# ---------------------------------------------------------------------------------- errors
@dataclass(frozen=True)
class ConfigProblem:
    file: str
    key: str  # dotted path, e.g. "models[1].replicas[0].url"; "" for file-level problems
    line: int | None
    message: str
    column: int | None = None

    def __str__(self) -> str:
        where = self.file
        if self.line is not None:
            where += f":{self.line}" + (f":{self.column}" if self.column is not None else "")
        return f"{where}: {self.key}: {self.message}" if self.key else f"{where}: {self.message}"


class ConfigError(Exception):
    def __init__(self, problems: list[ConfigProblem]):
        self.problems = list(problems)
        super().__init__("\n".join(map(str, self.problems)))


def _suggest(word: str, known: list[str]) -> str:
    near = difflib.get_close_matches(word, known, n=1)
    return f" (did you mean {near[0]!r}?)" if near else ""


def render_key(path: KeyPath) -> str:
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            text = part if re.fullmatch(r"[A-Za-z0-9_-]+", part) else tomli_w.dumps({"k": part})[4:-1]
            out += f".{text}" if out else text
    return out


# ---------------------------------------------------------------------------------- walker
_BAD = object()  # marks a value that failed validation (its problems are already recorded)
_TOML_TYPES = [(bool, "a boolean"), (int, "an integer"), (float, "a float"), (str, "a string"),
               (list, "an array"), (dict, "a table"), (datetime, "a datetime"), (date, "a date"),
               (time, "a time")]


def _type_name(value: Any) -> str:
    return next((n for t, n in _TOML_TYPES if isinstance(value, t)), type(value).__name__)


@cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def _unoptional(tp: Any) -> Any:
    if get_origin(tp) in (Union, UnionType):
        return next(a for a in get_args(tp) if a is not type(None))
    return tp


def _table(cls: type, data: dict, path: KeyPath, problems: list) -> tuple[dict[str, Any], set[str]]:
    """Convert `data` against dataclass `cls`: (valid values by field name, names that failed)."""
    values: dict[str, Any] = {}
    failed: set[str] = set()
    specs = {f.name: f for f in fields(cls)}
    for key in data:
        if key not in specs:
            known = list(specs)
            hint = _suggest(key, known) or f"; known keys: {', '.join(known)}"
            problems.append((path + (key,), f"unknown key{hint}"))
    for name, f in specs.items():
        if name in data:
            value = _convert(_hints(cls)[name], data[name], path + (name,), problems, f.metadata)
            if value is _BAD:
                failed.add(name)
            else:
                values[name] = value
        elif f.default is MISSING and f.default_factory is MISSING:
            problems.append((path + (name,), "missing required key"))
            failed.add(name)
    return values, failed


def _convert(tp: Any, value: Any, path: KeyPath, problems: list, meta: Any) -> Any:
    tp = _unoptional(tp)
    if is_dataclass(tp):
        if not isinstance(value, dict):
            problems.append((path, f"expected a table, got {_type_name(value)}"))
            return _BAD
        values, failed = _table(tp, value, path, problems)
        out = _BAD if failed else tp(**values)
    elif get_origin(tp) is dict:
        elem = get_args(tp)[1]
        if not isinstance(value, dict):
            problems.append((path, f"expected a table, got {_type_name(value)}"))
            return _BAD
        item_meta = {"checks": meta.get("items", ())}
        conv = {k: _convert(elem, v, path + (k,), problems, item_meta) for k, v in value.items()}
        out = _BAD if any(x is _BAD for x in conv.values()) else conv
    elif get_origin(tp) is tuple:
        elem = get_args(tp)[0]
        if not isinstance(value, list):
            want = "an array of tables" if is_dataclass(elem) else "an array"
            problems.append((path, f"expected {want}, got {_type_name(value)}"))
            return _BAD
        item_meta = {"checks": meta.get("items", ())}
        items = [_convert(elem, v, path + (i,), problems, item_meta) for i, v in enumerate(value)]
        out = _BAD if any(x is _BAD for x in items) else tuple(items)
        if unique := meta.get("unique"):
            seen: dict[Any, int] = {}
            for i, raw in enumerate(value):  # raw values: also catches duplicates among bad items
                key = raw.get(unique) if isinstance(raw, dict) else None
                if not isinstance(key, str | int | float):
                    continue
                if key in seen:
                    first = render_key(path + (seen[key],))
                    problems.append((path + (i, unique), f"duplicate {unique} {key!r} (first in {first})"))
                    out = _BAD
                seen.setdefault(key, i)
    else:
        if tp is float and isinstance(value, int) and not isinstance(value, bool):
            if abs(value) > 2**1023:  # tomllib accepts integers of any size
                problems.append((path, f"number too large: {value}"))
                return _BAD
            value = float(value)
        if not isinstance(value, tp) or (isinstance(value, bool) and tp is not bool):
            want = next(n for t, n in _TOML_TYPES if t is tp)
            problems.append((path, f"expected {want}, got {_type_name(value)}"))
            return _BAD
        out = value
    if out is not _BAD:
        for check in meta.get("checks", ()):
            if (msg := check(out)) is not None:
                problems.append((path, msg))
                return _BAD
    return out


# ---------------------------------------------------------------------------------- API
_SYNTAX_AT = re.compile(r"^(.*) \(at line (\d+), column (\d+)\)$", re.S)


def parse_config(text: str, filename: str = "<string>") -> Config:
    """Parse and validate TOML text; raise ConfigError listing every problem found."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        msg, line, col = str(e), text.count("\n") + 1, None
        if m := _SYNTAX_AT.match(msg):
            msg, line, col = m.group(1), int(m.group(2)), int(m.group(3))
        elif msg.endswith(" (at end of document)"):
            msg = msg.removesuffix(" (at end of document)")
        raise ConfigError([ConfigProblem(filename, "", line, f"invalid TOML: {msg}", col)]) from None
    problems: list[tuple[KeyPath, str]] = []
    raw = data.get("strategies")
    names = {st.get("name") for st in raw if isinstance(st, dict)} if isinstance(raw, list) else set()
    token = _KNOWN_STRATEGIES.set(frozenset(STRATEGIES) | {n for n in names if isinstance(n, str)})
    try:
        values, failed = _table(Config, data, (), problems)
    finally:
        _KNOWN_STRATEGIES.reset(token)
    cfg = Config(**values)  # failed sections fall back to defaults, for the cross checks below
    for needs, check in _CROSS_CHECKS:
        if not needs & failed:
            problems.extend(check(cfg))
    if problems:
        loc = TomlLocator(text)
        out = [ConfigProblem(filename, render_key(p), loc.line_of(p), m) for p, m in problems]
        out.sort(key=lambda p: p.line if p.line is not None else float("inf"))
        raise ConfigError(out)
    return cfg


def load_config(path: str | os.PathLike[str]) -> Config:
    """Read and validate a TOML config file; unreadable files also raise ConfigError."""
    name = os.fspath(path)
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except OSError as e:
        raise ConfigError([ConfigProblem(name, "", None, f"cannot read: {e.strerror or e}")]) from None
    except UnicodeDecodeError as e:
        msg = f"not valid UTF-8 (byte offset {e.start})"
        raise ConfigError([ConfigProblem(name, "", None, msg)]) from None
    return parse_config(text, name)


def default_config() -> Config:
    return Config()


def _plain(obj: Any) -> Any:
    if is_dataclass(obj):
        out = {}
        for f in fields(obj):
            value = _plain(getattr(obj, f.name))
            # tomli-w cannot write None; empty tables/arrays that equal the default add nothing
            if value is None or value == {} or (value == [] and f.default == ()):
                continue
            out[f.name] = value
        return out
    if isinstance(obj, tuple):
        return [_plain(x) for x in obj]
    return obj


def dump_config(cfg: Config) -> str:
    """TOML text for `cfg`; parse_config(dump_config(cfg)) == cfg for any valid cfg."""
    return tomli_w.dumps(_plain(cfg))


def init_config_text() -> str:
    """The commented starter file `llmgw config init` writes (equals default_config())."""
    from llmgw.config_starter import STARTER_TEXT

    return STARTER_TEXT




def model_to_dict(m: ModelConfig) -> dict[str, Any]:
    """A model's definition as plain data (what the store keeps and the admin API answers)."""
    return _plain(m)


def model_from_dict(data: Any, source: str = "<model>", *, pools: tuple[PoolConfig, ...] = ()) -> ModelConfig:
    """Validate a model definition given as plain data (`pools`: those it may name);
    ConfigError names every bad field."""
    problems: list[tuple[KeyPath, str]] = []
    out = _convert(ModelConfig, data, (), problems, {})
    if not problems:
        problems += [(p[2:], m) for p, m in _pool_references(Config(models=(out,), pools=pools))]
    if problems:
        raise ConfigError([ConfigProblem(source, render_key(p) or "", None, m) for p, m in problems])
    return out
