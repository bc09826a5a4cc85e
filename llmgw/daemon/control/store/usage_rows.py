"""Usage accounting in the store, what both backends share (docs/tenants.md, "Usage accounting"):
the tables' shape, the checks, and how rows become UsageRecords.

Three tables. ``usage_raw``: one row per (router, minute, tenant, key, model) with the five
counters; each router adds what it served (``add_usage``, an upsert that adds to an existing
row), so routers never write the same row. ``usage_hourly``: the same counters per (hour,
tenant, key, model), the routers summed. ``quota_demand``: each router's recent demand per quota
scope, for sharing per-minute limits between routers (llmgw.tenants.shares).

The roll-up keeps a watermark ``W`` (meta ``usage_rolled``, an hour's start): every raw row
with ``minute < W`` has been added into ``usage_hourly``. So the truth is ``usage_hourly`` for
hours before ``W`` plus ``usage_raw`` from ``W`` on, and that is what ``usage`` and ``spent``
read: raw rows before ``W`` are kept only for ``[tenants] raw_retention_h`` (``prune_usage``)
and never counted twice. ``rollup_usage(before)`` moves ``W`` up to ``before``'s hour, adding
the raw rows in between: run it twice and the second finds nothing (idempotent). A record that
arrives late, for a minute before ``W`` (a router's flush that failed and was retried), is added
into both tables at once by ``add_usage``.

All of it is unfenced (rows.UNFENCED_OPS): any router writes its own usage and demand; only the
leader rolls up and prunes, but a second one doing so at once would change nothing (PostgreSQL:
the watermark row is locked by both the roll-up and each add)."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable, Mapping
from typing import Any

from llmgw.daemon.control.store.rows import check_name

__all__ = ["COLUMNS", "COUNTERS", "HOUR", "add_counters", "check_demand", "check_records", "day_month", "filters", "hour_of", "record", "spent_of"]

COUNTERS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "errors")
COLUMNS = ", ".join(COUNTERS)  # the counters' columns, as both backends' SQL names them


def add_counters(table: str) -> str:
    """An upsert's SET clause adding the new row's counters to ``table``'s (SQLite and PostgreSQL
    speak the same ``ON CONFLICT … DO UPDATE``)."""
    return ", ".join(f"{c} = {table}.{c} + excluded.{c}" for c in COUNTERS)
HOUR = 3600


def hour_of(t: float) -> int:
    """The start of the hour holding Unix time ``t``."""
    return int(math.floor(t / HOUR)) * HOUR


def check_records(router_id: str, records: Iterable[Any]) -> list[tuple[Any, ...]]:
    """The rows to add: (router, minute, tenant, key, model, *COUNTERS), records of one key merged."""
    check_name(router_id, "router_id")
    merged: dict[tuple[int, str, str, str], list[int]] = {}
    for r in records:
        minute = int(r.minute)
        if minute % 60:
            raise ValueError(f"usage record minute {minute} is not a minute's start")
        key = (minute, check_name(r.tenant, "tenant"), check_name(r.key, "key"), check_name(r.model, "model"))
        counts = [int(getattr(r, c)) for c in COUNTERS]
        if any(n < 0 for n in counts):
            raise ValueError(f"usage record {key}: negative counters {counts}")
        have = merged.get(key)
        merged[key] = counts if have is None else [a + b for a, b in zip(have, counts)]
    return [(router_id, *k, *v) for k, v in sorted(merged.items())]


def check_demand(router_id: str, demand: Mapping[str, float]) -> str:
    check_name(router_id, "router_id")
    if not isinstance(demand, Mapping):
        raise TypeError(f"demand must be a mapping, got {type(demand).__name__}")
    out = {}
    for scope, v in demand.items():
        check_name(scope, "scope")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"demand of {scope!r} must be a finite number >= 0, got {v!r}")
        out[scope] = float(v)
    return json.dumps(out, sort_keys=True, separators=(",", ":"))


def record(hour: int, tenant: str, key: str, model: str, *counts: int) -> Any:
    from llmgw.tenants.usage import UsageRecord

    return UsageRecord(int(hour), tenant, key, model, *(int(c) for c in counts))


def spent_of(rows: Iterable[tuple[str, str, Any, Any]], since_day: float,
             since_month: float) -> dict[tuple[str, str, str], int]:
    """``spent``'s answer from (tenant, key, today, tokens) rows (``today``: the row's time is at or
    after ``since_day``; every row is of the month): tokens per (kind, name, period)."""
    day, month = day_month(since_day, since_month)
    out: dict[tuple[str, str, str], int] = {}
    for tenant, key, today, tokens in rows:
        for scope in (("tenant", tenant), ("key", key)):
            for period in ((day, month) if today else (month,)):
                k = (*scope, period)
                out[k] = out.get(k, 0) + int(tokens or 0)
    return out


def filters(since: float, until: float | None, tenant: str | None, key: str | None, model: str | None,
            col: str, mark: str) -> tuple[str, list[Any]]:
    """The WHERE clause (without the word) of a usage query on time column ``col`` (an hour's or a
    minute's start: its hour must be in [since's hour, until)), and its arguments."""
    where = [f"{col} >= {mark}"]
    args: list[Any] = [hour_of(since)]
    if until is not None:
        where.append(f"({col} / {HOUR} * {HOUR}) < {mark}")
        args.append(until)
    for c, v in (("tenant", tenant), ("key", key), ("model", model)):
        if v is not None:
            where.append(f"{c} = {mark}")
            args.append(v)
    return " AND ".join(where), args


def day_month(since_day: float, since_month: float) -> tuple[str, str]:
    """The period keys ("day:YYYY-MM-DD", "month:YYYY-MM") of the days starting at these times."""
    d, m = time.gmtime(since_day), time.gmtime(since_month)
    return f"day:{d.tm_year:04d}-{d.tm_mon:02d}-{d.tm_mday:02d}", f"month:{m.tm_year:04d}-{m.tm_mon:02d}"
