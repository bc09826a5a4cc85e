"""`llmgw ctl tenants|keys|usage`: tenants, their API keys and what they used (docs/tenants.md),
over the admin API. Tables by default, the API's own JSON with `-o json`. A new key's secret is
printed once, by the command that made it (keys create, keys rotate), with a line saying it is
not shown again."""

from __future__ import annotations

import argparse
import calendar
import re
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

from llmgw.cli.ctl.output import CtlError, emit, table

__all__ = ["parse_expiry", "register"]

TENANT_ACTIONS = ("list", "create", "show", "update", "delete")
KEY_ACTIONS = ("list", "create", "show", "update", "revoke", "rotate")
QUOTA_FLAGS = ("rpm", "tpm", "concurrency", "tokens_per_day", "tokens_per_month")
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(s|m|h|d|w)")
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_DATE = re.compile(r"(\d{4})-(\d{2})-(\d{2})")


def _duration(flag: str, raw: str) -> float:
    m = _DURATION.fullmatch(raw.strip())
    if m is None:
        raise CtlError(f"{flag} {raw!r}: expected a duration like 30m, 12h, 30d")
    return float(m.group(1)) * _UNITS[m.group(2)]


def parse_expiry(raw: str, now: float) -> float | None:
    """--expires: a duration from now (30d), a UTC date (2027-01-31: its start), Unix seconds, or never."""
    raw = raw.strip()
    if raw in ("never", "none"):
        return None
    if _DATE.fullmatch(raw) is not None:
        try:
            return float(calendar.timegm(time.strptime(raw, "%Y-%m-%d")))
        except ValueError:
            raise CtlError(f"--expires {raw!r}: not a date") from None
    if _DURATION.fullmatch(raw):
        return now + _duration("--expires", raw)
    try:
        return float(raw)
    except ValueError:
        raise CtlError(f"--expires {raw!r}: expected a duration (30d), a date (2027-01-31), Unix seconds or "
                       "never") from None


def _limit(flag: str, raw: str) -> int | None:
    if raw.lower() == "none":
        return None
    try:
        v = int(raw)
    except ValueError:
        v = -1
    if v < 0:
        raise CtlError(f"--{flag.replace('_', '-')} {raw!r}: expected a whole number ≥ 0, or none to remove it")
    return v


def _settings(ns: argparse.Namespace, *, key: bool) -> dict[str, Any]:
    """The body's fields from the flags given (and only those)."""
    body: dict[str, Any] = {}
    quota = {f: _limit(f, getattr(ns, f)) for f in QUOTA_FLAGS if getattr(ns, f) is not None}
    if quota:
        body["quota"] = quota
    if ns.models is not None:
        body["models"] = None if ns.models in ("", "all") else [m.strip() for m in ns.models.split(",") if m.strip()]
    if ns.band is not None:
        body["band"] = None if key and ns.band == "tenant" else ns.band
    if key:
        if ns.key_name is not None:
            body["name"] = ns.key_name
        if ns.expires is not None:
            body["expires_at"] = parse_expiry(ns.expires, time.time())
    else:
        if ns.weight is not None:
            body["weight"] = ns.weight
        if ns.description is not None:
            body["description"] = ns.description
    return body


def _quota(q: dict[str, Any] | None) -> str:
    return " ".join(f"{k}={v}" for k, v in (q or {}).items()) or "-"


def _when(t: float | None) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M", time.gmtime(t))


# -- tenants --------------------------------------------------------------------------------------------
def _tenant_text(t: dict[str, Any]) -> str:
    use, today = t.get("quota_use") or {}, t.get("usage_today") or {}
    lines = [f"tenant       {t['name']}" + ("  (static: [server] api_keys)" if t.get("static") else ""),
             f"band         {t['band']}, weight {t['weight']:g}",
             f"quota        {_quota(t.get('quota'))}",
             f"models       {', '.join(t['models']) if t.get('models') is not None else 'all'}",
             f"keys         {t.get('keys', 0)} active",
             f"today        {today.get('requests', 0)} requests, {today.get('prompt_tokens', 0)} prompt tokens "
             f"({today.get('cached_tokens', 0)} cached), {today.get('completion_tokens', 0)} completion tokens, "
             f"{today.get('errors', 0)} errors",
             f"queue        {t.get('queue', {}).get('waiting', 0)} waiting, share {t.get('queue', {}).get('share', 1):g}"]
    for name, u in sorted(use.items()):
        used = u.get("used", u.get("inflight"))
        if used is None and u.get("remaining") is not None and u.get("limit") is not None:
            used = u["limit"] - u["remaining"]
        lines.append(f"  {name:11s}{used if used is not None else '-'} / {u.get('limit', '-')}")
    if t.get("description"):
        lines.append(f"description  {t['description']}")
    lines.append(f"created      {_when(t.get('created_at'))}")
    return "\n".join(lines)


def _tenants_table(ts: list[dict[str, Any]]) -> str:
    rows = [[t["name"], t["band"], f"{t['weight']:g}", t.get("keys", 0), _quota(t.get("quota")),
             ",".join(t["models"]) if t.get("models") is not None else "all",
             (t.get("usage_today") or {}).get("requests", 0),
             (t.get("usage_today") or {}).get("prompt_tokens", 0) + (t.get("usage_today") or {}).get(
                 "completion_tokens", 0), (t.get("queue") or {}).get("waiting", 0)] for t in ts]
    return table(rows, ["TENANT", "BAND", "WEIGHT", "KEYS", "QUOTA", "MODELS", "REQUESTS TODAY", "TOKENS TODAY",
                        "WAITING"])


def cmd_tenants(api: Any, ns: argparse.Namespace) -> None:
    action, name = ns.action or "list", ns.name
    if action not in TENANT_ACTIONS:
        raise CtlError(f"tenants {action}: expected one of {', '.join(TENANT_ACTIONS)}")
    if action == "list":
        if name is not None:
            raise CtlError("tenants list takes no NAME (`tenants show NAME` shows one)")
        emit(ns, api.call("GET", "/tenants"), _tenants_table)
        return
    if name is None:
        raise CtlError(f"tenants {action}: which tenant? e.g. `llmgw ctl tenants {action} team-a`")
    path = f"/tenants/{quote(name, safe='')}"
    if action == "show":
        emit(ns, api.call("GET", path), _tenant_text)
    elif action == "create":
        emit(ns, api.call("POST", "/tenants", body={"name": name, **_settings(ns, key=False)}), _tenant_text)
    elif action == "update":
        body = _settings(ns, key=False)
        if not body:
            raise CtlError("tenants update: nothing to change (--band, --weight, --rpm, --models, ...)")
        emit(ns, api.call("PATCH", path, body=body), _tenant_text)
    else:
        api.call("DELETE", path)
        emit(ns, {"deleted": name}, lambda d: f"tenant {name} deleted with its keys (its usage records stay)")


# -- keys -------------------------------------------------------------------------------------------------
def _key_text(k: dict[str, Any]) -> str:
    lines = []
    if k.get("key"):
        lines += [f"key          {k['key']}",
                  "             (the secret is shown this once: it is not kept and cannot be shown again)"]
    lines += [f"id           {k['id']}  ({k.get('prefix', '')})", f"tenant       {k['tenant']}",
              f"name         {k.get('name') or '-'}", f"state        {k['state']}",
              f"created      {_when(k.get('created_at'))}", f"expires      {_when(k.get('expires_at'))}",
              f"models       {', '.join(k['models']) if k.get('models') is not None else 'the tenant’s'}",
              f"quota        {_quota(k.get('quota'))}", f"band         {k.get('band') or 'the tenant’s'}"]
    if k.get("revoked_at") is not None:
        lines.append(f"revoked      {_when(k['revoked_at'])}")
    if k.get("rotated_from"):
        lines.append(f"replaces     {k['rotated_from']}")
    return "\n".join(lines)


def _keys_table(ks: list[dict[str, Any]]) -> str:
    rows = [[k["id"], k["tenant"], k.get("name") or "-", k["state"], _when(k.get("created_at")),
             _when(k.get("expires_at")), ",".join(k["models"]) if k.get("models") is not None else "-",
             _quota(k.get("quota")), k.get("band") or "-"] for k in ks]
    return table(rows, ["ID", "TENANT", "NAME", "STATE", "CREATED", "EXPIRES", "MODELS", "QUOTA", "BAND"])


def cmd_keys(api: Any, ns: argparse.Namespace) -> None:
    action, target = ns.action or "list", ns.target
    if action not in KEY_ACTIONS:
        raise CtlError(f"keys {action}: expected one of {', '.join(KEY_ACTIONS)}")
    if action == "list":
        emit(ns, api.call("GET", "/keys", params={"tenant": ns.tenant or target}), _keys_table)
        return
    if target is None:
        raise CtlError(f"keys {action}: which {'tenant' if action == 'create' else 'key (its id)'}?")
    path = f"/keys/{quote(target, safe='')}"
    if action == "create":
        emit(ns, api.call("POST", f"/tenants/{quote(target, safe='')}/keys", body=_settings(ns, key=True)), _key_text)
    elif action == "show":
        emit(ns, api.call("GET", path), _key_text)
    elif action == "update":
        body = _settings(ns, key=True)
        if not body:
            raise CtlError("keys update: nothing to change (--name, --expires, --models, --rpm, --band, ...)")
        emit(ns, api.call("PATCH", path, body=body), _key_text)
    elif action == "revoke":
        emit(ns, api.call("POST", f"{path}/revoke"), _key_text)
    else:
        grace = _duration("--grace", ns.grace) if ns.grace else 0.0
        emit(ns, api.call("POST", f"{path}/rotate", params={"grace_s": grace}), _key_text)


# -- usage ------------------------------------------------------------------------------------------------
def _usage_text(rep: dict[str, Any]) -> str:
    by = rep["by"]
    group = {"key": ["TENANT", "KEY"], "day": ["DAY"], "hour": ["HOUR (UTC)"]}.get(by, [by.upper()])
    fields = {"key": ["tenant", "key"], "day": ["day"], "hour": ["hour"]}.get(by, [by])
    counters = ["requests", "prompt_tokens", "cached_tokens", "completion_tokens", "errors", "total_tokens"]
    rows = [[g.get(f) for f in fields] + [g.get(c, 0) for c in counters] for g in rep["rows"]]
    if rows:
        rows.append(["total"] + [""] * (len(fields) - 1) + [rep["total"].get(c, 0) for c in counters])
    head = (f"usage from {_when(rep['since'])} to {_when(rep['until'])} UTC (whole hours), by {by}"
            + "".join(f", {k} {v}" for k, v in sorted((rep.get("filters") or {}).items())))
    return head + "\n" + table(rows, group + ["REQUESTS", "PROMPT", "CACHED", "COMPLETION", "ERRORS", "TOTAL TOKENS"])


def cmd_usage(api: Any, ns: argparse.Namespace) -> None:
    params = {"tenant": ns.tenant, "key": ns.key, "model": ns.model, "since": ns.since, "until": ns.until,
              "by": ns.by}
    emit(ns, api.call("GET", "/usage", params=params), _usage_text)


# -- arguments --------------------------------------------------------------------------------------------
def _limits(sp: argparse.ArgumentParser, whose: str) -> None:
    for f, what in (("rpm", "requests per minute"), ("tpm", "tokens per minute (prompt + completion)"),
                    ("concurrency", "requests in flight at once"), ("tokens_per_day", "a token budget per UTC day"),
                    ("tokens_per_month", "a token budget per UTC month")):
        sp.add_argument(f"--{f.replace('_', '-')}", dest=f, metavar="N|none",
                        help=f"{whose} {what}; `none` removes the limit (update)")
    sp.add_argument("--models", metavar="M1,M2", help="the models it may use, comma-separated (`all`: every one)")


def register(add: Callable[..., argparse.ArgumentParser]) -> None:
    sp = add("tenants", cmd_tenants, "tenants: list, show NAME, create NAME, update NAME, delete NAME",
             "Tenants own API keys, quotas and a priority band (docs/tenants.md). Without an action: every tenant "
             "with its keys, quota and today's use. create and update take the flags below (update changes only "
             "those given; `--rpm none` removes a limit); delete removes its keys too (its usage stays).")
    sp.add_argument("action", nargs="?", metavar="|".join(TENANT_ACTIONS), help="what to do (default: list)")
    sp.add_argument("name", nargs="?", metavar="NAME", help="the tenant")
    sp.add_argument("--band", choices=("batch", "low", "normal", "high", "critical"),
                    help="its priority band under saturation (highest served first)")
    sp.add_argument("--weight", type=float, metavar="W", help="its share within its band (default 1)")
    _limits(sp, "the tenant's")
    sp.add_argument("--description", metavar="TEXT", help="what it is, for people")
    sp = add("keys", cmd_keys, "API keys: list, show ID, create TENANT, update ID, revoke ID, rotate ID",
             "API keys of tenants (docs/tenants.md). `keys create TENANT` prints the new secret once: it is not "
             "kept and cannot be shown again. `keys rotate ID` makes a new key with the same settings and revokes "
             "the old one (with --grace, the old one works that much longer). `keys revoke ID`: refused from now on "
             "by every router.")
    sp.add_argument("action", nargs="?", metavar="|".join(KEY_ACTIONS), help="what to do (default: list)")
    sp.add_argument("target", nargs="?", metavar="TENANT|ID", help="create: the tenant; the others: the key's id")
    sp.add_argument("--tenant", help="list: only this tenant's keys")
    sp.add_argument("--name", dest="key_name", metavar="TEXT", help="a label to recognise the key by")
    sp.add_argument("--expires", metavar="WHEN", help="30d (from now), 2027-01-31 (UTC), Unix seconds, or never")
    sp.add_argument("--band", choices=("batch", "low", "normal", "high", "critical", "tenant"),
                    help="the key's own band (`tenant`: the tenant's)")
    _limits(sp, "the key's own")
    sp.add_argument("--grace", metavar="DURATION", help="rotate: how long the old key keeps working (e.g. 1h)")
    sp = add("usage", cmd_usage, "what tenants used: requests and tokens per tenant, model, key, day or hour",
             "Requests, prompt tokens (and of those cached), completion tokens and errors from the store's hourly "
             "records (every router's), with this router's not yet flushed. Times: Unix seconds or a duration ago "
             "(30m, 24h, 7d).")
    sp.add_argument("--tenant", help="only this tenant's")
    sp.add_argument("--key", metavar="ID", help="only this key's")
    sp.add_argument("--model", help="only this model's")
    sp.add_argument("--since", metavar="WHEN", help="from (default: 7d ago)")
    sp.add_argument("--until", metavar="WHEN", help="to (default: now)")
    sp.add_argument("--by", choices=("tenant", "model", "key", "day", "hour"), default="tenant",
                    help="group by (default: tenant)")
