"""The admin API's tenant types (docs/tenants.md): tenants and API keys as they are shown, the bodies
that make and change them (checked by llmgw.tenants.model, whose errors name the field), a new
key's one-time secret, and the usage report. A key's hash is never in any of them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from llmgw.admin.typeinfo import Shape, prop
from llmgw.tenants.model import BANDS

__all__ = ["KeyBody", "KeyCreated", "KeyPatch", "KeyView", "QuotaLimits", "TenantBody", "TenantPatch",
           "TenantQueue", "TenantView", "UsageCounts", "UsageReport"]


@dataclass(slots=True)
class QuotaLimits:
    """Limits; a missing (or null) one is no limit. Tokens are prompt + completion."""
    rpm: int | None = prop("requests per minute", None, minimum=0)
    tpm: int | None = prop("tokens per minute (charged up front from the prompt and max_tokens, settled from "
                           "the usage)", None, minimum=0)
    concurrency: int | None = prop("requests in flight at once", None, minimum=0)
    tokens_per_day: int | None = prop("a budget per UTC day", None, minimum=0)
    tokens_per_month: int | None = prop("a budget per UTC calendar month", None, minimum=0)


@dataclass(slots=True)
class _TenantFields:
    name: str = prop("1–63 characters of a-z, 0-9, '.', '_', '-', starting with a letter or digit")
    band: str = prop(f"priority band under saturation: {', '.join(BANDS)} (highest served first)", "normal")
    weight: float = prop("its share against the other tenants of its band (weighted fair queueing), in (0, 1000]",
                         1.0, minimum=0, maximum=1000)
    quota: QuotaLimits | None = prop("its limits", None)
    models: list[str] | None = prop("the models its keys may use; null: every model", None)
    description: str = prop("", "", maxLength=1000)


@dataclass(slots=True)
class _KeyFields:
    name: str = prop("a label to recognise it by", "", maxLength=1000)
    expires_at: float | None = prop("Unix time it stops working; null: never", None)
    models: list[str] | None = prop("narrows the tenant's models; null: the tenant's", None)
    quota: QuotaLimits | None = prop("its own limits, checked besides the tenant's", None)
    band: str | None = prop("its own band; null: the tenant's", None)


_BAND_ENUM = {"band": {"enum": list(BANDS)}}
TenantBody = Annotated[dict[str, Any], Shape(
    _TenantFields, "TenantBody", "A new tenant; every field but name may be left out.",
    refine=_BAND_ENUM, nulls=True, example={"name": "team-a", "band": "high", "quota": {"rpm": 600, "tokens_per_day": 2000000}})]
TenantPatch = Annotated[dict[str, Any], Shape(
    _TenantFields, "TenantPatch", "The fields to change (not name); quota is merged limit by limit, a null "
                                  "limit removes it.", refine=_BAND_ENUM, nulls=True, example={"weight": 2, "quota": {"rpm": None}})]
KeyBody = Annotated[dict[str, Any], Shape(
    _KeyFields, "KeyBody", "A new key's settings; all may be left out (an empty object).",
    nulls=True, example={"name": "ci", "expires_at": 1798761600, "models": ["llama-3-8b"]})]
KeyPatch = Annotated[dict[str, Any], Shape(
    _KeyFields, "KeyPatch", "The fields to change; quota is merged limit by limit, a null limit removes it.",
    nulls=True, example={"quota": {"rpm": 60}})]


@dataclass(slots=True)
class UsageCounts:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = prop("of the prompt tokens, those the engine had cached", 0)
    completion_tokens: int = 0
    errors: int = prop("requests answered with a status other than 2xx", 0)


@dataclass(slots=True)
class TenantQueue:
    waiting: int = prop("its requests waiting in the admission queues now", 0)
    share: float = prop("its share of its band among the tenants waiting (1: alone)", 1.0)


@dataclass(slots=True)
class TenantView:
    name: str
    band: str
    weight: float
    quota: dict[str, int] = prop("the limits set (rpm, tpm, concurrency, tokens_per_day, tokens_per_month)")
    models: list[str] | None = prop("the models it may use; null: every model")
    description: str
    created_at: float = prop("Unix time")
    static: bool = prop("the tenant of [server] api_keys: the config's, not changed here")
    keys: int = prop("its active keys")
    usage_today: UsageCounts = prop("since the UTC day began: every router's flushed use, and this router's "
                                    "not yet flushed")
    quota_use: dict[str, dict[str, Any]] = prop(
        "this router's view of each limit: rpm and tpm {limit, remaining}, concurrency {limit, inflight}, day and "
        "month {limit, used}")
    queue: TenantQueue = prop("this router's admission queues")


@dataclass(slots=True)
class KeyView:
    id: str = prop("the key's id, also in its secret: sk-llmgw-<id>-…")
    tenant: str
    name: str
    prefix: str = prop("how the key starts, to recognise it")
    state: str = prop("active, revoked or expired")
    created_at: float
    expires_at: float | None
    revoked_at: float | None
    models: list[str] | None = prop("narrows the tenant's; null: the tenant's")
    quota: dict[str, int] = prop("its own limits (checked besides the tenant's)")
    band: str | None = prop("its own band; null: the tenant's")
    rotated_from: str | None = prop("the id of the key this one replaced")


@dataclass(slots=True)
class KeyCreated:
    """A new key, with its secret: shown here once and never again (only its hash is kept)."""
    key: str = prop("the secret: send it as `Authorization: Bearer <key>`")
    id: str
    tenant: str
    name: str
    prefix: str
    state: str
    created_at: float
    expires_at: float | None
    revoked_at: float | None
    models: list[str] | None
    quota: dict[str, int]
    band: str | None
    rotated_from: str | None


@dataclass(slots=True)
class UsageReport:
    since: float = prop("Unix time: the start of the first hour counted (usage is kept per hour)")
    until: float = prop("Unix time: hours starting before it are counted")
    by: str = prop("tenant, model, key, day or hour")
    rows: list[dict[str, Any]] = prop(
        "one per group: its fields (tenant; model; tenant and key; day or hour with start, its Unix time), then "
        "requests, prompt_tokens, cached_tokens, completion_tokens, errors, total_tokens")
    total: dict[str, int] = prop("the counters over every row")
    filters: dict[str, str] = prop("the tenant, key and model asked for", factory=dict)
