"""The admin API's handlers for tenants, API keys and usage (routes tagged `tenants` in
llmgw.admin.routes; docs/tenants.md). Each is ``async (app, call) -> answer``; admin/server.py
registers them by route name. The plane's TenantsManager (daemon/control/tenants.py) makes every
change; its TenantError becomes a 400 naming the field, UnknownTenant a 404, TenantConflict a
409. A key's secret is answered once, by the call that made it; its hash never."""

from __future__ import annotations

import re
import time
from dataclasses import replace
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import quote

from llmgw.admin.routes import PREFIX
from llmgw.admin.schema import Problem
from llmgw.admin.schema_tenants import KeyCreated, KeyView, TenantQueue, TenantView, UsageCounts, UsageReport
from llmgw.daemon.control.admin.errors import AdminFail, invalid
from llmgw.daemon.control.store.guard import StoreUnavailable
from llmgw.daemon.control.tenants import TenantConflict, UnknownTenant
from llmgw.daemon.control.usage_sync import period_starts
from llmgw.daemon.control.store.usage_rows import hour_of
from llmgw.daemon.net.http_types import Response
from llmgw.admin.views import dumps
from llmgw.inputs.echo import echo
from llmgw.tenants.model import ApiKey, Tenant, TenantError, quota_doc, static_tenant
from llmgw.tenants.usage import COUNTERS, aggregate

__all__ = ["TENANT_HANDLERS", "key_view", "parse_when"]

Handler = Callable[[Any, Any], Awaitable[Any]]
DEFAULT_SINCE_S = 7 * 86400.0
_AGO = re.compile(r"(\d+(?:\.\d+)?)(s|m|h|d|w)")
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


def parse_when(name: str, raw: str, now: float) -> float:
    """A query's time: Unix seconds, or a duration ago ("30m", "24h", "7d"); Invalid names `name`."""
    m = _AGO.fullmatch(raw.strip())
    if m is not None:
        return now - float(m.group(1)) * _UNITS[m.group(2)]
    try:
        t = float(raw)
    except ValueError:
        t = -1.0
    if not 0 <= t < 1e11:
        raise invalid([Problem(name, f"expected Unix seconds or a duration like 30m, 24h, 7d; got {echo(raw)}")],
                      "invalid_query")
    return t


def _fail(e: Exception) -> AdminFail:
    if isinstance(e, TenantError):
        return invalid([Problem(e.field, e.message)], "invalid_body")
    if isinstance(e, UnknownTenant):
        return AdminFail(404, str(e))
    return AdminFail(409, str(e))


def key_view(k: ApiKey, now: float) -> KeyView:
    return KeyView(id=k.id, tenant=k.tenant, name=k.name, prefix=k.prefix, state=k.state(now),
                   created_at=k.created_at, expires_at=k.expires_at, revoked_at=k.revoked_at,
                   models=None if k.models is None else list(k.models), quota=quota_doc(k.quota), band=k.band,
                   rotated_from=k.rotated_from)


def _created(secret: str, k: ApiKey, now: float) -> Any:
    v = key_view(k, now)
    body = KeyCreated(key=secret, **{f: getattr(v, f) for f in v.__dataclass_fields__})
    return _json(201, body, [("location", f"{PREFIX}/keys/{quote(k.id, safe='')}"), ("cache-control", "no-store")])


def _json(status: int, obj: Any, headers: list[tuple[str, str]]) -> Response:
    return Response(status, [("content-type", "application/json"), *headers], dumps(obj).encode())


# -- tenants --------------------------------------------------------------------------------------------
def _today(app: Any, now: float) -> dict[str, UsageCounts]:
    """Today's use per tenant: the store's (every router's flushed) and this router's not flushed."""
    day, _ = period_starts(now)
    try:
        rows = app.control.guard.read("usage", lambda st: st.usage(day))
    except StoreUnavailable:
        rows = []
    rows = [*rows, *(r for r in app.router.usage_peek() if r.minute >= day)]
    return {g["tenant"]: UsageCounts(*(g[c] for c in COUNTERS)) for g in aggregate(rows, "tenant")}


def _use_of(use: dict[Any, Any], kind: str, name: str) -> dict[str, Any]:
    got = use.get((kind, name), use.get(f"{kind}:{name}"))
    return dict(got) if isinstance(got, dict) else {}


def _views(app: Any, only: str | None = None) -> list[TenantView]:
    m = app.control.tenants
    now = m.wall()
    c, api_keys = app.control.cfg.tenants, app.control.cfg.server.api_keys
    # a stored tenant of the static one's name (made before [tenants] static_tenant named it) is not used
    tenants: list[Tenant] = [t for t in m.tenants.values() if t.name != c.static_tenant]
    if api_keys:
        tenants.insert(0, replace(static_tenant(c.static_tenant), band=c.static_band))
    if only is not None:
        tenants = [t for t in tenants if t.name == only]
    today = _today(app, now)
    use, queues = app.router.quota_use(), app.router.queue_by_tenant()
    out = []
    for t in tenants:
        q = queues.get(t.name) or {}
        out.append(TenantView(
            name=t.name, band=t.band, weight=t.weight, quota=quota_doc(t.quota),
            models=None if t.models is None else list(t.models), description=t.description,
            created_at=t.created_at, static=t.static,
            keys=len(api_keys) if t.static else m.active_keys(t.name), usage_today=today.get(t.name, UsageCounts()),
            quota_use=_use_of(use, "tenant", t.name),
            queue=TenantQueue(waiting=int(q.get("waiting", 0)), share=float(q.get("share", 1.0)))))
    return out


def _view(app: Any, name: str) -> TenantView:
    got = _views(app, name)
    if not got:
        raise AdminFail(404, f"No tenant {echo(name)}.")
    return got[0]


def _static(app: Any, name: str) -> None:
    if name == app.control.cfg.tenants.static_tenant:
        raise AdminFail(409, f"Tenant {echo(name)} is the static keys' tenant ([tenants] static_tenant): the config's "
                             "[server] api_keys, not changed here.")


async def list_tenants(app: Any, call: Any) -> Any:
    return _views(app)


async def create_tenant(app: Any, call: Any) -> Any:
    try:
        t = app.control.tenants.create_tenant(call.body)
    except (TenantError, UnknownTenant, TenantConflict) as e:
        raise _fail(e) from None
    return _json(201, _view(app, t.name), [("location", f"{PREFIX}/tenants/{quote(t.name, safe='')}")])


async def get_tenant(app: Any, call: Any) -> Any:
    return _view(app, call.params["name"])


async def update_tenant(app: Any, call: Any) -> Any:
    name = call.params["name"]
    _static(app, name)
    try:
        app.control.tenants.update_tenant(name, call.body)
    except (TenantError, UnknownTenant, TenantConflict) as e:
        raise _fail(e) from None
    return _view(app, name)


async def delete_tenant(app: Any, call: Any) -> Any:
    name = call.params["name"]
    _static(app, name)
    try:
        app.control.tenants.delete_tenant(name)
    except (UnknownTenant, TenantConflict) as e:
        raise _fail(e) from None
    return None


# -- keys -----------------------------------------------------------------------------------------------
async def create_key(app: Any, call: Any) -> Any:
    m = app.control.tenants
    try:
        secret, k = m.create_key(call.params["name"], call.body or {})
    except (TenantError, UnknownTenant, TenantConflict) as e:
        raise _fail(e) from None
    return _created(secret, k, m.wall())


async def list_keys(app: Any, call: Any) -> Any:
    m = app.control.tenants
    now, only = m.wall(), call.query["tenant"]
    keys = sorted(m.keys.values(), key=lambda k: (k.tenant, k.created_at, k.id))
    return [key_view(k, now) for k in keys if only is None or k.tenant == only]


async def get_key(app: Any, call: Any) -> Any:
    m = app.control.tenants
    try:
        return key_view(m.key(call.params["id"]), m.wall())
    except UnknownTenant as e:
        raise _fail(e) from None


async def update_key(app: Any, call: Any) -> Any:
    m = app.control.tenants
    try:
        return key_view(m.update_key(call.params["id"], call.body), m.wall())
    except (TenantError, UnknownTenant) as e:
        raise _fail(e) from None


async def revoke_key(app: Any, call: Any) -> Any:
    m = app.control.tenants
    try:
        return key_view(m.revoke_key(call.params["id"]), m.wall())
    except UnknownTenant as e:
        raise _fail(e) from None


async def rotate_key(app: Any, call: Any) -> Any:
    m = app.control.tenants
    try:
        secret, k = m.rotate_key(call.params["id"], call.query["grace_s"])
    except (TenantError, UnknownTenant, TenantConflict) as e:
        raise _fail(e) from None
    return _created(secret, k, m.wall())


# -- usage ----------------------------------------------------------------------------------------------
async def get_usage(app: Any, call: Any) -> Any:
    q = call.query
    now = time.time()
    since = parse_when("since", q["since"], now) if q["since"] else now - DEFAULT_SINCE_S
    until = parse_when("until", q["until"], now) if q["until"] else now
    by = q["by"]
    if by not in ("tenant", "model", "key", "day", "hour"):
        raise invalid([Problem("by", f"expected one of tenant, model, key, day, hour; got {echo(by)}")],
                      "invalid_query")
    if until < since:
        raise invalid([Problem("until", "must not be before since")], "invalid_query")
    try:
        rows = app.control.guard.read("usage", lambda st: st.usage(since, until, q["tenant"], q["key"], q["model"]))
    except StoreUnavailable as e:
        raise AdminFail(503, f"The router's store cannot be read ({e.reason}: {e.detail}).",
                        headers=[("retry-after", "5")]) from None
    lo = hour_of(since)
    for r in app.router.usage_peek():  # this router's use not flushed yet
        if (r.minute >= lo and hour_of(r.minute) < until and q["tenant"] in (None, r.tenant)
                and q["key"] in (None, r.key) and q["model"] in (None, r.model)):
            rows.append(r)
    groups = aggregate(rows, by)
    total = {c: sum(g[c] for g in groups) for c in (*COUNTERS, "total_tokens")}
    filters = {k: q[k] for k in ("tenant", "key", "model") if q[k] is not None}
    return UsageReport(since=float(lo), until=until, by=by, rows=groups, total=total, filters=filters)


TENANT_HANDLERS: dict[str, Handler] = {
    "list_tenants": list_tenants, "create_tenant": create_tenant, "get_tenant": get_tenant,
    "update_tenant": update_tenant, "delete_tenant": delete_tenant, "create_key": create_key,
    "list_keys": list_keys, "get_key": get_key, "update_key": update_key, "revoke_key": revoke_key,
    "rotate_key": rotate_key, "get_usage": get_usage,
}
