"""The PostgreSQL store's usage accounting and quota demand (the rules: store/usage_rows.py). Every
write here is unfenced. Several routers add at once: each add takes the watermark row FOR SHARE
and the roll-up FOR UPDATE, so a roll-up never moves the watermark past an add it has not seen."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import psycopg

from llmgw.daemon.control.store.usage_rows import (
    COLUMNS,
    COUNTERS,
    add_counters,
    check_demand,
    check_records,
    filters,
    hour_of,
    record,
    spent_of,
)

__all__ = ["PgUsageMixin"]

_C = COLUMNS
_SUMS = ", ".join(f"sum({c})::bigint" for c in COUNTERS)
_CHUNK = 500  # rows per INSERT: 5,000 parameters, far below PostgreSQL's 65,535
_ROLLED = "SELECT value::bigint FROM meta WHERE key = 'usage_rolled'"


class PgUsageMixin:
    _x: Callable[..., psycopg.Cursor[Any]]
    transaction: Callable[[], AbstractContextManager[None]]

    def _rolled(self, lock: str = "") -> int:
        row = self._x(f"{_ROLLED} {lock}").fetchone()
        return int(row[0]) if row else 0

    def add_usage(self, router_id: str, records: Iterable[Any]) -> None:
        rows = check_records(router_id, records)
        if not rows:
            return
        with self.transaction():
            rolled = self._rolled("FOR SHARE")
            self._insert(f"INSERT INTO usage_raw (router, minute, tenant, key, model, {_C}) VALUES {{}} "
                         f"ON CONFLICT (router, minute, tenant, key, model) DO UPDATE SET {add_counters('usage_raw')}",
                         rows)
            late = [(hour_of(r[1]), *r[2:]) for r in rows if r[1] < rolled]
            if late:  # a minute already rolled up: into its hour too (usage_rows.py)
                self._insert(f"INSERT INTO usage_hourly (hour, tenant, key, model, {_C}) VALUES {{}} "
                             f"ON CONFLICT (hour, tenant, key, model) DO UPDATE SET {add_counters('usage_hourly')}",
                             late)

    def _insert(self, sql: str, rows: list[tuple[Any, ...]]) -> None:
        """Many rows, a few statements (each bounded by the store's timeout, as every call is)."""
        one = "(" + ", ".join(["%s"] * len(rows[0])) + ")"
        for i in range(0, len(rows), _CHUNK):
            part = rows[i:i + _CHUNK]
            self._x(sql.format(", ".join([one] * len(part))), [v for r in part for v in r])

    def usage(self, since: float, until: float | None = None, tenant: str | None = None, key: str | None = None,
              model: str | None = None) -> list[Any]:
        h_where, h_args = filters(since, until, tenant, key, model, "hour", "%s")
        r_where, r_args = filters(since, until, tenant, key, model, "minute", "%s")
        rows = self._x(
            f"SELECT hour, tenant, key, model, {_SUMS} FROM ("
            f"SELECT hour, tenant, key, model, {_C} FROM usage_hourly WHERE {h_where} UNION ALL "
            f"SELECT minute / 3600 * 3600 AS hour, tenant, key, model, {_C} FROM usage_raw "
            f"WHERE minute >= ({_ROLLED}) AND {r_where}"
            ") u GROUP BY hour, tenant, key, model ORDER BY hour, tenant, key, model",
            (*h_args, *r_args)).fetchall()
        return [record(*r) for r in rows]

    def rollup_usage(self, before: float) -> int:
        upto = hour_of(before)
        with self.transaction():
            rolled = self._rolled("FOR UPDATE")
            if upto <= rolled:
                return 0
            n = self._x("SELECT count(*) FROM usage_raw WHERE minute >= %s AND minute < %s", (rolled, upto)).fetchone()[0]
            self._x(f"INSERT INTO usage_hourly (hour, tenant, key, model, {_C}) "
                    f"SELECT minute / 3600 * 3600, tenant, key, model, {_SUMS} FROM usage_raw "
                    "WHERE minute >= %s AND minute < %s GROUP BY 1, 2, 3, 4 "
                    f"ON CONFLICT (hour, tenant, key, model) DO UPDATE SET {add_counters('usage_hourly')}",
                    (rolled, upto))
            self._x("UPDATE meta SET value = %s WHERE key = 'usage_rolled'", (str(upto),))
        return int(n)

    def prune_usage(self, raw_before: float, hourly_before: float) -> int:
        with self.transaction():
            keep_from = min(int(raw_before), self._rolled("FOR SHARE"))  # raw rows not rolled up stay
            n = self._x("DELETE FROM usage_raw WHERE minute < %s", (keep_from,)).rowcount
            n += self._x("DELETE FROM usage_hourly WHERE hour < %s", (int(hourly_before),)).rowcount
        return int(n)

    def spent(self, since_day: float, since_month: float) -> dict[tuple[str, str, str], int]:
        rows = self._x(
            "SELECT tenant, key, t >= %s, sum(tokens)::bigint FROM ("
            "SELECT tenant, key, hour AS t, prompt_tokens + completion_tokens AS tokens FROM usage_hourly "
            "WHERE hour >= %s UNION ALL "
            "SELECT tenant, key, minute, prompt_tokens + completion_tokens FROM usage_raw "
            f"WHERE minute >= ({_ROLLED}) AND minute >= %s) u GROUP BY 1, 2, 3",
            (since_day, hour_of(since_month), since_month)).fetchall()
        return spent_of(rows, since_day, since_month)

    def put_demand(self, router_id: str, demand: Mapping[str, float]) -> None:
        self._x("INSERT INTO quota_demand (router, demand, at) VALUES (%s, %s, extract(epoch from clock_timestamp())) "
                "ON CONFLICT (router) DO UPDATE SET demand = excluded.demand, at = excluded.at",
                (router_id, check_demand(router_id, demand)))

    def demands(self, max_age_s: float | None = None) -> dict[str, dict[str, float]]:
        """Each router's last demand; with `max_age_s`, only those written that recently (the
        store's clock)."""
        rows = self._x("SELECT router, demand, extract(epoch from clock_timestamp())::float8 - at FROM quota_demand "
                       "ORDER BY router").fetchall()
        return {r: json.loads(d) for r, d, age in rows if max_age_s is None or age <= max_age_s}
