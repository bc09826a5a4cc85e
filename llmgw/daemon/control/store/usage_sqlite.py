"""The SQLite store's usage accounting and quota demand (the rules: store/usage_rows.py). Every
write here is unfenced; BEGIN IMMEDIATE orders the roll-up against every add."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from typing import Any

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

__all__ = ["USAGE_TABLES", "UsageMixin"]

# The store's migration 5 -> 6 (sqlite.py's MIGRATIONS): each router's usage per minute, the
# routers' per hour, each router's demand per quota scope, and the roll-up's watermark.
USAGE_TABLES = """
    CREATE TABLE usage_raw (
        router TEXT NOT NULL, minute INTEGER NOT NULL, tenant TEXT NOT NULL, key TEXT NOT NULL, model TEXT NOT NULL,
        requests INTEGER NOT NULL, prompt_tokens INTEGER NOT NULL, cached_tokens INTEGER NOT NULL,
        completion_tokens INTEGER NOT NULL, errors INTEGER NOT NULL,
        PRIMARY KEY (router, minute, tenant, key, model));
    CREATE INDEX usage_raw_minute ON usage_raw (minute);
    CREATE TABLE usage_hourly (
        hour INTEGER NOT NULL, tenant TEXT NOT NULL, key TEXT NOT NULL, model TEXT NOT NULL,
        requests INTEGER NOT NULL, prompt_tokens INTEGER NOT NULL, cached_tokens INTEGER NOT NULL,
        completion_tokens INTEGER NOT NULL, errors INTEGER NOT NULL,
        PRIMARY KEY (hour, tenant, key, model));
    CREATE TABLE quota_demand (router TEXT PRIMARY KEY, demand TEXT NOT NULL, at REAL NOT NULL);
    INSERT INTO meta (key, value) VALUES ('usage_rolled', '0');
    """

_C = COLUMNS
_SUMS = ", ".join(f"sum({c})" for c in COUNTERS)


class UsageMixin:
    _conn: sqlite3.Connection
    _lock: threading.RLock
    transaction: Callable[[], AbstractContextManager[None]]

    def _rolled(self) -> int:
        row = self._conn.execute("SELECT value FROM meta WHERE key = 'usage_rolled'").fetchone()
        return int(row[0]) if row else 0

    def add_usage(self, router_id: str, records: Iterable[Any]) -> None:
        rows = check_records(router_id, records)
        if not rows:
            return
        with self.transaction():
            for row in rows:  # execute, not executemany: what every connection wrapper has (store/faults.py)
                self._conn.execute(
                    f"INSERT INTO usage_raw (router, minute, tenant, key, model, {_C}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
                    f"ON CONFLICT (router, minute, tenant, key, model) DO UPDATE SET {add_counters('usage_raw')}", row)
            rolled = self._rolled()
            for r in rows:
                if r[1] < rolled:  # a minute already rolled up: into its hour too (usage_rows.py)
                    self._conn.execute(
                        f"INSERT INTO usage_hourly (hour, tenant, key, model, {_C}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) "
                        f"ON CONFLICT (hour, tenant, key, model) DO UPDATE SET {add_counters('usage_hourly')}",
                        (hour_of(r[1]), *r[2:]))

    def usage(self, since: float, until: float | None = None, tenant: str | None = None, key: str | None = None,
              model: str | None = None) -> list[Any]:
        h_where, h_args = filters(since, until, tenant, key, model, "hour", "?")
        r_where, r_args = filters(since, until, tenant, key, model, "minute", "?")
        with self._lock:
            rolled = self._rolled()
            rows = self._conn.execute(
                f"SELECT hour, tenant, key, model, {_SUMS} FROM ("
                f"SELECT hour, tenant, key, model, {_C} FROM usage_hourly WHERE {h_where} UNION ALL "
                f"SELECT minute / 3600 * 3600, tenant, key, model, {_C} FROM usage_raw WHERE minute >= ? AND {r_where}"
                ") GROUP BY hour, tenant, key, model ORDER BY hour, tenant, key, model",
                (*h_args, rolled, *r_args)).fetchall()
        return [record(*r) for r in rows]

    def rollup_usage(self, before: float) -> int:
        upto = hour_of(before)
        with self.transaction():
            rolled = self._rolled()
            if upto <= rolled:
                return 0
            n = self._conn.execute("SELECT count(*) FROM usage_raw WHERE minute >= ? AND minute < ?",
                                   (rolled, upto)).fetchone()[0]
            self._conn.execute(
                f"INSERT INTO usage_hourly (hour, tenant, key, model, {_C}) "
                f"SELECT minute / 3600 * 3600, tenant, key, model, {_SUMS} FROM usage_raw "
                "WHERE minute >= ? AND minute < ? GROUP BY 1, 2, 3, 4 "
                f"ON CONFLICT (hour, tenant, key, model) DO UPDATE SET {add_counters('usage_hourly')}", (rolled, upto))
            self._conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('usage_rolled', ?)", (str(upto),))
        return int(n)

    def prune_usage(self, raw_before: float, hourly_before: float) -> int:
        with self.transaction():
            keep_from = min(int(raw_before), self._rolled())  # raw rows not rolled up yet are never pruned
            n = self._conn.execute("DELETE FROM usage_raw WHERE minute < ?", (keep_from,)).rowcount
            n += self._conn.execute("DELETE FROM usage_hourly WHERE hour < ?", (int(hourly_before),)).rowcount
        return int(n)

    def spent(self, since_day: float, since_month: float) -> dict[tuple[str, str, str], int]:
        with self._lock:
            rolled = self._rolled()
            rows = self._conn.execute(
                "SELECT tenant, key, t >= ?, sum(tokens) FROM ("
                "SELECT tenant, key, hour AS t, prompt_tokens + completion_tokens AS tokens FROM usage_hourly "
                "WHERE hour >= ? UNION ALL "
                "SELECT tenant, key, minute, prompt_tokens + completion_tokens FROM usage_raw "
                "WHERE minute >= ? AND minute >= ?) GROUP BY 1, 2, 3",
                (since_day, hour_of(since_month), rolled, since_month)).fetchall()
        return spent_of(rows, since_day, since_month)

    def put_demand(self, router_id: str, demand: Mapping[str, float]) -> None:
        text = check_demand(router_id, demand)
        with self.transaction():
            self._conn.execute("INSERT INTO quota_demand (router, demand, at) VALUES (?, ?, ?) ON CONFLICT (router) "
                               "DO UPDATE SET demand = excluded.demand, at = excluded.at", (router_id, text, time.time()))

    def demands(self, max_age_s: float | None = None) -> dict[str, dict[str, float]]:
        """Each router's last demand; with `max_age_s`, only those written that recently (the
        store's clock)."""
        with self._lock:
            rows = self._conn.execute("SELECT router, demand, at FROM quota_demand ORDER BY router").fetchall()
        now = time.time()
        return {r: json.loads(d) for r, d, at in rows if max_age_s is None or now - at <= max_age_s}
