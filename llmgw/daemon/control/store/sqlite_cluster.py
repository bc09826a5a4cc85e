"""The SQLite store's part in several routers sharing it (`llmgw daemon --workers N` on one host):
the leader's lease, the fence, the generation, the routers' rows, the cluster secret and the
admin queue (docs/ha.md; the rules are FleetStore's, store/port.py). Every write here is unfenced.

SQLite's clock is the host's (`time.time()`): the routers sharing a file share a host."""

from __future__ import annotations

import json
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from llmgw.daemon.control.store.rows import LeaseRow, RouterRow, check_name, check_obj, dumps_json

__all__ = ["ClusterMixin"]


class ClusterMixin:
    _conn: sqlite3.Connection
    _fence: tuple[str, int] | None
    _lock: threading.RLock  # Store's: reads here may come from a worker thread (the lease loop)
    transaction: Callable[[], AbstractContextManager[None]]  # Store's

    def store_now(self) -> float:
        return time.time()

    # -- the leader's lease and the fence

    def try_lead(self, router_id: str, ttl_s: float) -> LeaseRow:
        check_name(router_id, "router_id")
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s!r}")
        with self.transaction():  # BEGIN IMMEDIATE: one router at a time
            now = self.store_now()
            row = self._conn.execute("SELECT holder, epoch, expires_at FROM leader WHERE only = 1").fetchone()
            if row is None:
                holder, epoch = router_id, 1
                self._conn.execute("INSERT INTO leader (only, holder, epoch, expires_at, acquired_at) "
                                   "VALUES (1, ?, 1, ?, ?)", (router_id, now + ttl_s, now))
                expires = now + ttl_s
            else:
                holder, epoch, expires = row
                if holder == router_id:
                    expires = now + ttl_s
                    self._conn.execute("UPDATE leader SET expires_at = ? WHERE only = 1", (expires,))
                elif expires <= now:
                    holder, epoch, expires = router_id, epoch + 1, now + ttl_s
                    self._conn.execute("UPDATE leader SET holder = ?, epoch = ?, expires_at = ?, acquired_at = ? "
                                       "WHERE only = 1", (holder, epoch, expires, now))
        return LeaseRow(holder, int(epoch), expires - now, holder == router_id)

    def release_lead(self, router_id: str) -> None:
        with self.transaction():
            self._conn.execute("UPDATE leader SET expires_at = ? WHERE only = 1 AND holder = ? AND expires_at > ?",
                               (self.store_now(), router_id, self.store_now()))

    def lease(self) -> LeaseRow | None:
        with self._lock:
            row = self._conn.execute("SELECT holder, epoch, expires_at FROM leader WHERE only = 1").fetchone()
        if row is None:
            return None
        return LeaseRow(row[0], int(row[1]), row[2] - self.store_now(), False)

    def set_fence(self, router_id: str | None, epoch: int | None) -> None:
        if (router_id is None) != (epoch is None):
            raise ValueError("set_fence: router_id and epoch are both given or both None")
        self._fence = None if router_id is None or epoch is None else (check_name(router_id, "router_id"), int(epoch))

    def generation(self) -> int:
        with self._lock:
            row = self._conn.execute("SELECT value FROM meta WHERE key = 'generation'").fetchone()
        return int(row[0]) if row else 0

    # -- the routers' rows

    def register_router(self, router_id: str, info: dict[str, Any], *, started_at: float) -> None:
        text = dumps_json(check_obj(info, "info"))
        with self.transaction():
            self._conn.execute(
                "INSERT INTO routers (id, info, started_at, seen_at) VALUES (?, ?, ?, ?) ON CONFLICT (id) DO UPDATE "
                "SET info = excluded.info, started_at = excluded.started_at, seen_at = excluded.seen_at",
                (check_name(router_id, "router_id"), text, started_at, self.store_now()))

    def router_seen(self, router_id: str) -> None:
        with self.transaction():
            self._conn.execute("UPDATE routers SET seen_at = ? WHERE id = ?", (self.store_now(), router_id))

    def routers(self) -> dict[str, RouterRow]:
        now = self.store_now()
        with self._lock:
            rows = self._conn.execute("SELECT id, info, started_at, seen_at FROM routers ORDER BY id").fetchall()
        return {i: RouterRow(i, json.loads(info), st, seen, now - seen) for i, info, st, seen in rows}

    def forget_router(self, router_id: str) -> bool:
        with self.transaction():
            return self._conn.execute("DELETE FROM routers WHERE id = ?", (router_id,)).rowcount > 0

    def cluster_secret(self) -> bytes:
        with self.transaction():
            self._conn.execute("INSERT OR IGNORE INTO meta (key, value) VALUES ('cluster_secret', ?)",
                               (secrets.token_hex(32),))
            row = self._conn.execute("SELECT value FROM meta WHERE key = 'cluster_secret'").fetchone()
        return bytes.fromhex(row[0])

    # -- the admin queue: a follower's admin writes, for the leader of `epoch`

    def queue_admin(self, epoch: int, request: dict[str, Any]) -> int:
        text = dumps_json(check_obj(request, "request"))
        with self.transaction():
            cur = self._conn.execute("INSERT INTO admin_queue (epoch, request, created_at) VALUES (?, ?, ?)",
                                     (int(epoch), text, self.store_now()))
            return int(cur.lastrowid or 0)

    def admin_requests(self, epoch: int, after_id: int) -> list[tuple[int, dict[str, Any]]]:
        with self._lock:
            rows = self._conn.execute("SELECT id, request FROM admin_queue WHERE epoch = ? AND id > ? "
                                      "AND answer IS NULL ORDER BY id", (int(epoch), int(after_id))).fetchall()
        return [(i, json.loads(r)) for i, r in rows]

    def answer_admin(self, qid: int, answer: dict[str, Any]) -> None:
        text = dumps_json(check_obj(answer, "answer"))
        with self.transaction():
            self._conn.execute("UPDATE admin_queue SET answer = ?, answered_at = ? WHERE id = ?",
                               (text, self.store_now(), int(qid)))

    def admin_answer(self, qid: int) -> dict[str, Any] | None:
        with self._lock:
            row = self._conn.execute("SELECT answer FROM admin_queue WHERE id = ?", (int(qid),)).fetchone()
        return None if row is None or row[0] is None else json.loads(row[0])

    def take_admin_answer(self, qid: int) -> dict[str, Any] | None:
        """The answer, if there is one yet, and the request's row deleted with it: an answer may hold
        a secret (a new API key's) that must not stay in the store."""
        with self.transaction():
            row = self._conn.execute("SELECT answer FROM admin_queue WHERE id = ?", (int(qid),)).fetchone()
            if row is None or row[0] is None:
                return None
            self._conn.execute("DELETE FROM admin_queue WHERE id = ?", (int(qid),))
        return json.loads(row[0])

    def prune_admin(self, older_than_s: float) -> int:
        with self.transaction():
            return self._conn.execute("DELETE FROM admin_queue WHERE created_at < ?",
                                      (self.store_now() - older_than_s,)).rowcount
