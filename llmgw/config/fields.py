"""How a config field is declared and checked: :func:`opt` (default, checks, uniqueness), the
value checks it takes (``one_of``, ``in_range``, ``http_url``, ``host_port``, ``node_name``, ...).
The defaults computed from the environment are :mod:`llmgw.config.defaults`'s.

A check is ``(value) -> error message | None``. The sections that use them are in
:mod:`llmgw.config.schema`; the walker that runs them and the public API are :mod:`llmgw.config`.
"""

from __future__ import annotations

import difflib
import ipaddress
import re
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import MISSING, field
from typing import Any
from urllib.parse import urlsplit

from llmgw.config.names import PRESET_NAMES
from llmgw.inputs.echo import echo

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


def unset_or(check: Check) -> Check:
    """``check``, with "" allowed: the value is unset (the shell fills in this machine's default)."""
    def unset_or_check(v: str) -> str | None:
        return None if v == "" else check(v)
    return unset_or_check


def metric_name(v: str) -> str | None:
    """A Prometheus sample name as an engine's /metrics writes it (counters with their ``_total``)."""
    if re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", v):
        return None
    return f"not a Prometheus metric name (letters, digits, '_' and ':', not starting with a digit): {v!r}"


def http_url(v: str) -> str | None:
    try:
        u = urlsplit(v)
        u.port  # noqa: B018 -- raises ValueError on a bad port
    except ValueError:
        u = None
    if u is None or u.scheme not in ("http", "https") or not u.hostname or re.search(r"\s", v):
        return f"not an http(s) URL: {v!r}"
    return None


def store_url(v: str) -> str | None:
    """[store] url: "" (the SQLite file at [control] store), "sqlite:PATH" or "postgresql://..."."""
    if v == "":
        return None
    if v.startswith("sqlite:"):
        return None if v.removeprefix("sqlite:").strip() else "sqlite: needs a file path (sqlite:/var/lib/llmgw/router.db)"
    if v.startswith(("postgresql://", "postgres://")):
        try:
            urlsplit(v).port  # noqa: B018 -- raises ValueError on a bad port
        except ValueError as e:
            return f"not a PostgreSQL URL ({e})"
        return None if not re.search(r"\s", v) else "a PostgreSQL URL has no spaces"
    return f"must be \"sqlite:PATH\" or \"postgresql://USER@HOST:PORT/DB\", got {v.split(':')[0]!r}:…"


def host_port(v: str) -> str | None:
    host, sep, port = v.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if sep and host and re.fullmatch(r"[0-9]{1,5}", port) and int(port) <= 65535:
        return None
    return f"expected \"host:port\", got {v!r}"


def host_or_host_port(v: str) -> str | None:
    """A host ("10.0.0.1", "[fd00::1]", "router-2") or "host:port"."""
    if host_port(v) is None:
        return None
    bare = v[1:-1] if v.startswith("[") and v.endswith("]") else v
    if bare and not any(c.isspace() for c in bare) and (":" not in bare or v.startswith("[")):
        return None
    return f"expected a host or \"host:port\", got {v!r}"


def cidr(v: str) -> str | None:
    try:
        ipaddress.ip_network(v.strip(), strict=False)
    except ValueError:
        return f"not a network (CIDR such as \"10.1.0.0/16\") or address: {v!r}"
    return None


def pem_certificate(v: str) -> str | None:
    if "-----BEGIN CERTIFICATE-----" in v and "-----END CERTIFICATE-----" in v:
        return None
    return "expected a PEM certificate (-----BEGIN CERTIFICATE----- ... -----END CERTIFICATE-----)"


def header_name(v: str) -> str | None:
    ok = re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", v)
    return None if ok else f"not a valid HTTP header name: {v!r}"


def header_table(headers: dict[str, str]) -> str | None:
    """HTTP headers to send (names and values); a value is never echoed (it may be a secret)."""
    for k, v in headers.items():
        if (msg := header_name(k)) is not None:
            return msg
        if not re.fullmatch(r"[\x21-\x7e]+(?:[ \t]+[\x21-\x7e]+)*", v):
            return f"the value of header {k!r} is not a valid header value (visible ASCII, no line breaks)"
    return None


# Strategy names a model may use: the presets plus the file's own [[strategies]], set while a
# file is parsed so the field check sees them even when other sections have errors.
_KNOWN_STRATEGIES: ContextVar[frozenset[str]] = ContextVar("_KNOWN_STRATEGIES", default=frozenset(PRESET_NAMES))


def known_strategy(v: str) -> str | None:
    known = _KNOWN_STRATEGIES.get()
    if v in known:
        return None
    ordered = [*PRESET_NAMES, *sorted(known - set(PRESET_NAMES))]
    close = difflib.get_close_matches(v, ordered, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"expected one of {', '.join(repr(k) for k in ordered)}; got {v!r}{hint}"


def node_name(v: str) -> str | None:
    ok = re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9._-]{0,251}[A-Za-z0-9])?", v)
    return None if ok else f"not a valid node name (letters, digits, '.', '_', '-'; at most 253): {echo(v)}"


def label_keys(labels: dict[str, str]) -> str | None:
    for k in labels:
        if not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9._/-]{0,251}[A-Za-z0-9])?", k):
            return f"not a valid label key: {echo(k)}"
    return None


def facility_label_values(labels: dict[str, str]) -> str | None:
    """The llmgw.io/site|room|row|rack|pdu labels (or their short keys, site|room|row|rack|pdu,
    expanded as `ctl label` expands them) name failure domains: their values must be names."""
    from llmgw.fleet.domains import check_label_value, expand_key, label_clash

    if (msg := label_clash(labels)) is not None:
        return msg
    for k, v in labels.items():
        if (msg := check_label_value(expand_key(k), v)) is not None:
            return msg
    return None


def domain_budget(key: str, watts: float) -> str | None:
    """One [facility.budgets] entry: the key a facility domain (LEVEL=VALUE), the value watts > 0."""
    from llmgw.fleet.domains import DomainError, parse_domain

    try:
        d = parse_domain(key)
    except DomainError as e:
        return str(e)
    if d != key:
        return f"write the domain {key!r} as {d!r}"
    if not 0 < watts < 1e9:
        return f"budget of {key}: must be > 0 and < 1e9 watts, got {watts!r}"
    return None


def facility_level(v: str | None) -> str | None:
    from llmgw.fleet.domains import LEVELS

    return None if v is None or v in LEVELS else one_of(*LEVELS)(v)


MAX_REPLICA_NODES = 64  # nodes of one multi-node replica (the agent stream's bound too)


def replica_nodes(v: int) -> str | None:
    if 1 <= v <= MAX_REPLICA_NODES:
        return None
    return f"must be 1..{MAX_REPLICA_NODES}, got {v!r}"


def key_value(v: str) -> str | None:
    k, sep, _ = v.partition("=")
    return None if sep and k.strip() else f"expected \"KEY=VALUE\", got {v!r}"


def _suggest(word: str, known: list[str]) -> str:
    near = difflib.get_close_matches(word, known, n=1)
    return f" (did you mean {near[0]!r}?)" if near else ""
