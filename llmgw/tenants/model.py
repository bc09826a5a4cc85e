"""Tenants and their API keys as data (pure): what the store keeps, what the admin API takes and
gives, and the checks that name the field at fault.

A **tenant** is who pays: a team or an application. It has a priority band (which queue it waits
in under saturation), a weight (its share within the band), optional model allow-list, and
quotas. An **API key** belongs to one tenant; it may narrow the models, carry its own quotas
(checked besides the tenant's), its own band, and an expiry. Keys are stored hashed
(:mod:`.keys`): only the hash and a short visible prefix are kept.

Both are kept in the store as documents (kinds ``tenant`` and ``api_key``), keyed by the tenant's
name and the key's id; ``*_doc``/``*_from_doc`` convert, and ``*_from_doc`` raises
:class:`TenantError` naming the field for anything malformed (a stored document as much as an
admin API body).

The static keys of ``[server] api_keys`` belong to a tenant of their own (``[tenants]
static_tenant``, default ``static``) that needs no document: :func:`static_tenant`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = [
    "BANDS", "DEFAULT_BAND", "MAX_NAME", "ApiKey", "Quota", "Tenant", "TenantError", "band_rank",
    "check_name", "key_doc", "key_from_doc", "quota_doc", "quota_from_doc", "static_tenant", "tenant_doc",
    "tenant_from_doc", "update_key", "update_tenant",
]

# Priority bands, lowest first: under saturation a higher band's waiters go before a lower one's.
BANDS = ("batch", "low", "normal", "high", "critical")
DEFAULT_BAND = "normal"
MAX_NAME = 63
_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")
QUOTA_FIELDS = ("rpm", "tpm", "concurrency", "tokens_per_day", "tokens_per_month")


class TenantError(ValueError):
    """A malformed tenant or key: ``field`` names the field (``quota.tpm``), the message says what."""

    def __init__(self, field_: str, message: str) -> None:
        super().__init__(f"{field_}: {message}")
        self.field = field_
        self.message = message


def band_rank(band: str) -> int:
    """0 for ``batch`` … 4 for ``critical``: higher is served first."""
    return BANDS.index(band)


def check_name(name: Any, what: str = "name") -> str:
    if not isinstance(name, str) or _NAME.fullmatch(name) is None:
        raise TenantError(what, f"must be 1–{MAX_NAME} characters of a-z, 0-9, '.', '_', '-', starting with a "
                                f"letter or digit; got {_show(name)}")
    return name


@dataclass(frozen=True, slots=True)
class Quota:
    """Limits; None = none. Tokens are prompt + completion."""
    rpm: int | None = None  # requests per minute
    tpm: int | None = None  # tokens per minute (charged up front from the prompt and max_tokens, settled at the end)
    concurrency: int | None = None  # requests in flight at once
    tokens_per_day: int | None = None  # budget, per UTC day
    tokens_per_month: int | None = None  # budget, per UTC calendar month

    def empty(self) -> bool:
        return all(getattr(self, f) is None for f in QUOTA_FIELDS)


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    band: str = DEFAULT_BAND
    weight: float = 1.0  # its share against the other tenants of its band (weighted fair queueing)
    quota: Quota = field(default_factory=Quota)
    models: tuple[str, ...] | None = None  # None: every model
    description: str = ""
    created_at: float = 0.0
    static: bool = False  # the tenant of [server] api_keys: from the config, not the store


@dataclass(frozen=True, slots=True)
class ApiKey:
    id: str  # the visible key id, also the store's key (keys.py)
    tenant: str
    hash: str  # sha256 of the whole secret, hex (keys.hash_secret)
    prefix: str  # what is shown to recognise it: "sk-llmgw-<id>…"
    name: str = ""
    created_at: float = 0.0
    expires_at: float | None = None  # Unix time; None: never
    revoked_at: float | None = None
    models: tuple[str, ...] | None = None  # None: the tenant's
    quota: Quota = field(default_factory=Quota)
    band: str | None = None  # None: the tenant's
    rotated_from: str | None = None  # the id of the key this one replaced (keys rotate)

    def state(self, now: float) -> str:
        """``active``, ``revoked`` or ``expired``."""
        if self.revoked_at is not None:
            return "revoked"
        if self.expires_at is not None and now >= self.expires_at:
            return "expired"
        return "active"


def static_tenant(name: str = "static") -> Tenant:
    return Tenant(name=name, description="the keys of [server] api_keys in the config", static=True)


# ------------------------------------------------------------------------------ conversions
def quota_doc(q: Quota) -> dict[str, int]:
    return {f: getattr(q, f) for f in QUOTA_FIELDS if getattr(q, f) is not None}


def quota_from_doc(d: Any, where: str = "quota") -> Quota:
    if d is None:
        return Quota()
    if not isinstance(d, dict):
        raise TenantError(where, f"must be a table of limits; got {_show(d)}")
    unknown = sorted(set(d) - set(QUOTA_FIELDS))
    if unknown:
        raise TenantError(f"{where}.{unknown[0]}", f"unknown limit (known: {', '.join(QUOTA_FIELDS)})")
    out: dict[str, int | None] = {}
    for f in QUOTA_FIELDS:
        v = d.get(f)
        if v is None:
            out[f] = None
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise TenantError(f"{where}.{f}", f"must be a whole number ≥ 0 (or null for no limit); got {_show(v)}")
        out[f] = v
    return Quota(**out)


def tenant_doc(t: Tenant) -> dict[str, Any]:
    d: dict[str, Any] = {"name": t.name, "band": t.band, "weight": t.weight, "quota": quota_doc(t.quota),
                         "description": t.description, "created_at": t.created_at}
    if t.models is not None:
        d["models"] = list(t.models)
    return d


def tenant_from_doc(d: Any) -> Tenant:
    if not isinstance(d, dict):
        raise TenantError("tenant", f"must be an object; got {_show(d)}")
    _unknown(d, ("name", "band", "weight", "quota", "models", "description", "created_at"))
    return Tenant(name=check_name(d.get("name")), band=_band(d.get("band", DEFAULT_BAND), "band"),
                  weight=_weight(d.get("weight", 1.0)), quota=quota_from_doc(d.get("quota")),
                  models=_models(d.get("models"), "models"), description=_text(d.get("description", ""), "description"),
                  created_at=_time(d.get("created_at", 0.0), "created_at") or 0.0)


def key_doc(k: ApiKey) -> dict[str, Any]:
    d: dict[str, Any] = {"id": k.id, "tenant": k.tenant, "hash": k.hash, "prefix": k.prefix, "name": k.name,
                         "created_at": k.created_at, "expires_at": k.expires_at, "revoked_at": k.revoked_at,
                         "quota": quota_doc(k.quota), "band": k.band, "rotated_from": k.rotated_from}
    if k.models is not None:
        d["models"] = list(k.models)
    return d


def key_from_doc(d: Any) -> ApiKey:
    if not isinstance(d, dict):
        raise TenantError("key", f"must be an object; got {_show(d)}")
    _unknown(d, ("id", "tenant", "hash", "prefix", "name", "created_at", "expires_at", "revoked_at", "models",
                 "quota", "band", "rotated_from"))
    h = d.get("hash")
    if not isinstance(h, str) or re.fullmatch(r"[0-9a-f]{64}", h) is None:
        raise TenantError("hash", "must be 64 hex digits (sha256)")
    kid = d.get("id")
    if not isinstance(kid, str) or re.fullmatch(r"[a-z0-9]{4,32}", kid) is None:
        raise TenantError("id", f"must be 4–32 characters of a-z and 0-9; got {_show(kid)}")
    band = d.get("band")
    return ApiKey(id=kid, tenant=check_name(d.get("tenant"), "tenant"), hash=h,
                  prefix=_text(d.get("prefix", ""), "prefix"), name=_text(d.get("name", ""), "name"),
                  created_at=_time(d.get("created_at", 0.0), "created_at") or 0.0,
                  expires_at=_time(d.get("expires_at"), "expires_at"),
                  revoked_at=_time(d.get("revoked_at"), "revoked_at"),
                  models=_models(d.get("models"), "models"), quota=quota_from_doc(d.get("quota")),
                  band=None if band is None else _band(band, "band"),
                  rotated_from=d.get("rotated_from") if isinstance(d.get("rotated_from"), str) else None)


def update_tenant(t: Tenant, changes: dict[str, Any]) -> Tenant:
    """``t`` with the admin API's PATCH-like ``changes`` (band, weight, quota — merged limit by limit,
    a null limit removes it —, models, description); the name and creation time stay."""
    _unknown(changes, ("band", "weight", "quota", "models", "description"))
    kw: dict[str, Any] = {}
    if "band" in changes:
        kw["band"] = _band(changes["band"], "band")
    if "weight" in changes:
        kw["weight"] = _weight(changes["weight"])
    if "quota" in changes:
        kw["quota"] = _merge_quota(t.quota, changes["quota"])
    if "models" in changes:
        kw["models"] = _models(changes["models"], "models")
    if "description" in changes:
        kw["description"] = _text(changes["description"], "description")
    return replace(t, **kw)


def update_key(k: ApiKey, changes: dict[str, Any]) -> ApiKey:
    """``k`` with ``changes`` (name, expires_at, models, quota merged, band); the secret never changes
    here (rotate makes a new key)."""
    _unknown(changes, ("name", "expires_at", "models", "quota", "band"))
    kw: dict[str, Any] = {}
    if "name" in changes:
        kw["name"] = _text(changes["name"], "name")
    if "expires_at" in changes:
        kw["expires_at"] = _time(changes["expires_at"], "expires_at")
    if "models" in changes:
        kw["models"] = _models(changes["models"], "models")
    if "quota" in changes:
        kw["quota"] = _merge_quota(k.quota, changes["quota"])
    if "band" in changes:
        kw["band"] = None if changes["band"] is None else _band(changes["band"], "band")
    return replace(k, **kw)


# ------------------------------------------------------------------------------ field checks
def _merge_quota(q: Quota, d: Any) -> Quota:
    if not isinstance(d, dict):
        raise TenantError("quota", f"must be a table of limits; got {_show(d)}")
    merged = {**quota_doc(q), **d}
    return quota_from_doc({k: v for k, v in merged.items() if v is not None})


def _unknown(d: dict[str, Any], known: tuple[str, ...]) -> None:
    extra = sorted(set(d) - set(known))
    if extra:
        raise TenantError(str(extra[0])[:64], f"unknown field (known: {', '.join(known)})")


def _band(v: Any, where: str) -> str:
    if v not in BANDS:
        raise TenantError(where, f"must be one of {', '.join(BANDS)}; got {_show(v)}")
    return str(v)


def _weight(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 < v <= 1000):
        raise TenantError("weight", f"must be a number in (0, 1000]; got {_show(v)}")
    return float(v)


def _models(v: Any, where: str) -> tuple[str, ...] | None:
    if v is None:
        return None
    if not isinstance(v, (list, tuple)) or not all(isinstance(m, str) and m for m in v):
        raise TenantError(where, f"must be a list of model names (or null for every model); got {_show(v)}")
    if len(v) > 1000:
        raise TenantError(where, "at most 1000 models")
    return tuple(dict.fromkeys(v))


def _text(v: Any, where: str) -> str:
    if not isinstance(v, str) or len(v) > 1000:
        raise TenantError(where, f"must be a string of at most 1000 characters; got {_show(v)}")
    return v


def _time(v: Any, where: str) -> float | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (0 <= v < 1e11):
        raise TenantError(where, f"must be a Unix time in seconds; got {_show(v)}")
    return float(v)


def _show(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 100 else f"{s[:100]}… ({len(s)} characters)"
