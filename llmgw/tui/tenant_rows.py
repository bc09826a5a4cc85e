"""The console's Tenants view as plain data (the rows.py pattern): per tenant its band and weight,
its keys, today's requests and tokens, its quota use (rpm, tpm, concurrency, day, month: used /
limit) and its requests waiting in the admission queues with its share of its band — from
``GET /api/v1/tenants`` (a list of TenantView; a ConsoleState's ``tenants``, fetched while the
view is shown). Pure: tested without a terminal. Tolerant: a field missing or of the wrong type
shows as ``—``."""

from __future__ import annotations

from typing import Any

from llmgw.admin_client.rationale import DASH
from llmgw.tui.rows import Column, Row, _filtered, _num, _str, fmt_count
from llmgw.tui.state import ConsoleState, as_dict, as_list

__all__ = ["BAND_ORDER", "NEAR_LIMIT", "QUOTA_KINDS", "TENANT_COLUMNS", "tenant_detail", "tenant_rows",
           "tenant_summary_lines"]

TENANT_COLUMNS = (Column("tenant"), Column("band", toned=True), Column("weight"), Column("keys"),
                  Column("req/day"), Column("tok/day"), Column("rpm"), Column("tpm"), Column("conc"),
                  Column("day"), Column("month"), Column("waiting"), Column("share"))
QUOTA_KINDS = ("rpm", "tpm", "concurrency", "day", "month")
BAND_ORDER = ("critical", "high", "normal", "low", "batch")  # shown first to last
NEAR_LIMIT = 0.9  # a quota used this much or more is shown in warning; all of it: bad


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def quota_used(use: Any, kind: str) -> tuple[float, float] | None:
    """(used, limit) of one quota in a TenantView's ``quota_use``; None when it has no limit."""
    q = as_dict(as_dict(use).get(kind))
    limit = q.get("limit")
    if not _is_num(limit):
        return None
    if kind == "concurrency":
        used = _num(q.get("inflight"))
    elif kind in ("day", "month"):
        used = _num(q.get("used"))
    else:  # a token bucket: what is not remaining is used
        remaining = q.get("remaining")
        used = float(limit) - float(remaining) if _is_num(remaining) else 0.0
    return max(used, 0.0), float(limit)


def _short(n: float) -> str:
    """fmt_count without a trailing ".0" (200k, 1.9M): a quota's two numbers share a cell."""
    return fmt_count(n).replace(".0", "")


def fmt_quota(use: Any, kind: str) -> str:
    u = quota_used(use, kind)
    return DASH if u is None else f"{_short(u[0])}/{_short(u[1])}"


def _tokens(usage: dict[str, Any]) -> float:
    return _num(usage.get("prompt_tokens")) + _num(usage.get("completion_tokens"))


def _band_key(t: dict[str, Any]) -> tuple[int, str]:
    band = t.get("band")
    return (BAND_ORDER.index(band) if band in BAND_ORDER else len(BAND_ORDER), str(t.get("name", "")))


def tenant_rows(state: ConsoleState, text: str = "") -> list[Row]:
    """One row per tenant, highest band first, then by name. Tones: a quota at or past its limit
    `bad`, near it (NEAR_LIMIT) `warn`; requests waiting `busy`; a tenant without active keys
    (that is not the static or an open gateway's tenant) `dim`."""
    rows: list[Row] = []
    for t in sorted(as_list(state.tenants), key=_band_key):
        name = _str(t.get("name"), "?")
        use = t.get("quota_use")
        usage = as_dict(t.get("usage_today"))
        queue = as_dict(t.get("queue"))
        waiting = int(_num(queue.get("waiting")))
        share = queue.get("share")
        fill = [u[0] / u[1] for k in QUOTA_KINDS if (u := quota_used(use, k)) is not None and u[1] > 0]
        worst = max(fill, default=0.0)
        keys = t.get("keys")
        tone = ""
        if worst >= 1.0:
            tone = "bad"
        elif worst >= NEAR_LIMIT:
            tone = "warn"
        elif waiting:
            tone = "busy"
        elif keys == 0 and not t.get("static"):
            tone = "dim"
        weight = t.get("weight")
        rows.append(Row(name, (
            name, _str(t.get("band")), f"{weight:g}" if _is_num(weight) else DASH,
            str(keys) if _is_num(keys) else DASH, fmt_count(usage.get("requests")),
            fmt_count(_tokens(usage)) if usage else DASH, *(fmt_quota(use, k) for k in QUOTA_KINDS),
            str(waiting) if waiting else "", f"{share:.2f}" if waiting and _is_num(share) else ""),
            tone, search=_str(t.get("description"), "")))
    return _filtered(rows, text)


def tenant_summary_lines(state: ConsoleState) -> list[str]:
    tenants = as_list(state.tenants)
    if not state.tenants_fetched:
        return ["no tenants yet (fetched from the daemon while this view is shown)"]
    if not tenants:
        return ["no tenants: every request is the anonymous tenant's (llmgw ctl tenants create NAME)"]
    usage = [as_dict(t.get("usage_today")) for t in tenants]
    waiting = sum(_num(as_dict(t.get("queue")).get("waiting")) for t in tenants)
    bands: dict[str, int] = {}
    for t in tenants:
        b = _str(t.get("band"), "?")
        bands[b] = bands.get(b, 0) + 1
    shown = " ".join(f"{b} {bands[b]}" for b in (*BAND_ORDER, *sorted(set(bands) - set(BAND_ORDER))) if b in bands)
    out = [f"{len(tenants)} tenants ({shown}) · today {fmt_count(sum(_num(u.get('requests')) for u in usage))} "
           f"requests, {fmt_count(sum(_tokens(u) for u in usage))} tokens, "
           f"{fmt_count(sum(_num(u.get('errors')) for u in usage))} errors · {int(waiting)} waiting"]
    full = [_str(t.get("name"), "?") for t in tenants
            if any((u := quota_used(t.get("quota_use"), k)) is not None and u[1] > 0 and u[0] >= u[1]
                   for k in QUOTA_KINDS)]
    if full:
        out.append("at a limit: " + ", ".join(full[:8]) + (" …" if len(full) > 8 else ""))
    return out


def tenant_detail(state: ConsoleState, name: str | None) -> list[str]:
    """The selected tenant: its description, allowed models, limits and today's counts."""
    t = next((x for x in as_list(state.tenants) if x.get("name") == name), None)
    if t is None:
        return []
    models = t.get("models")
    head = f"{name}  band {_str(t.get('band'))}, weight {t.get('weight', DASH)}" + \
        (" (static keys of [server] api_keys)" if t.get("static") else "")
    out = [head]
    if isinstance(t.get("description"), str) and t["description"]:
        out.append(t["description"])
    out.append("models: " + (", ".join(str(m) for m in models) if isinstance(models, list) else "all"))
    limits = as_dict(t.get("quota"))
    out.append("limits: " + (", ".join(f"{k} {fmt_count(v)}" for k, v in limits.items() if _is_num(v)) or "none"))
    u = as_dict(t.get("usage_today"))
    if u:
        out.append(f"today: {fmt_count(u.get('requests'))} requests, {fmt_count(u.get('prompt_tokens'))} prompt "
                   f"({fmt_count(u.get('cached_tokens'))} cached), {fmt_count(u.get('completion_tokens'))} "
                   f"completion tokens, {fmt_count(u.get('errors'))} errors")
    q = as_dict(t.get("queue"))
    if _num(q.get("waiting")):
        share = q.get("share")
        out.append(f"waiting: {int(_num(q.get('waiting')))} requests"
                   + (f", share of its band {share:.2f}" if _is_num(share) else ""))
    return out
