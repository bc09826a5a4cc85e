"""The PostgreSQL store's fleet rows: models, lifecycle documents, nodes, assignments, history,
node credentials and holds — the same checks and the same JSON text as the SQLite store
(sqlite.py), so either backend answers alike. Fenced writes run in `_fenced()` (postgres.py): the
fence checked, in a transaction of their own or their caller's."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import psycopg

from llmgw.config.names import CANDIDATE_SUFFIX
from llmgw.daemon.control.store.rows import (
    assignment_row,
    check_event,
    AssignmentRow,
    CredentialRow,
    HistoryRow,
    HoldRow,
    NodeRow,
    check_desired,
    check_labels,
    check_name,
    check_obj,
    credential_upsert,
    dumps_json,
)

__all__ = ["LIFECYCLE_KINDS", "FleetRowsMixin"]

LIFECYCLE_KINDS = ("revisions", "suite", "result", "job", "tenant", "api_key", "autoscale")  # sqlite.py's


class FleetRowsMixin:
    _x: Callable[..., psycopg.Cursor[Any]]
    transaction: Callable[[], AbstractContextManager[None]]
    _fenced: Callable[[], AbstractContextManager[None]]

    # -- models

    def put_model(self, name: str, spec: dict[str, Any], *, now: float | None = None) -> None:
        check_name(name)
        text = dumps_json(check_obj(spec, "spec"))
        ts = time.time() if now is None else now
        with self._fenced():
            self._x("INSERT INTO models (name, spec, created_at, updated_at) VALUES (%s, %s, %s, %s) "
                    "ON CONFLICT (name) DO UPDATE SET spec = excluded.spec, updated_at = excluded.updated_at",
                    (name, text, ts, ts))

    def delete_model(self, name: str) -> bool:
        with self._fenced():
            return self._x("DELETE FROM models WHERE name = %s", (check_name(name),)).rowcount > 0

    def models(self) -> dict[str, dict[str, Any]]:
        return {n: json.loads(s) for n, s in self._x("SELECT name, spec FROM models ORDER BY name").fetchall()}

    def model(self, name: str) -> dict[str, Any] | None:
        row = self._x("SELECT spec FROM models WHERE name = %s", (check_name(name),)).fetchone()
        return None if row is None else json.loads(row[0])

    # -- the model lifecycle: one JSON document per (kind, key)

    def put_doc(self, kind: str, key: str, value: dict[str, Any], *, now: float | None = None) -> None:
        if kind not in LIFECYCLE_KINDS:
            raise ValueError(f"unknown lifecycle kind {kind!r}")
        text = dumps_json(check_obj(value, kind))
        with self._fenced():
            self._x("INSERT INTO lifecycle (kind, key, value, updated_at) VALUES (%s, %s, %s, %s) "
                    "ON CONFLICT (kind, key) DO UPDATE SET value = excluded.value, updated_at = excluded.updated_at",
                    (kind, check_name(key, "key"), text, time.time() if now is None else now))

    def delete_doc(self, kind: str, key: str) -> bool:
        with self._fenced():
            return self._x("DELETE FROM lifecycle WHERE kind = %s AND key = %s", (kind, key)).rowcount > 0

    def write_docs(self, puts: list[tuple[str, str, dict[str, Any]]], deletes: list[tuple[str, str]]) -> None:
        """Several documents put and deleted in one transaction: all or none."""
        with self.transaction():
            for kind, key, value in puts:
                self.put_doc(kind, key, value)
            for kind, key in deletes:
                self.delete_doc(kind, key)

    def docs(self, kind: str) -> dict[str, dict[str, Any]]:
        return {k: json.loads(v) for k, v in self._x(
            "SELECT key, value FROM lifecycle WHERE kind = %s ORDER BY updated_at, key", (kind,)).fetchall()}

    # -- nodes

    def upsert_node(self, name: str, *, agent_labels: dict[str, str], facts: dict[str, Any],
                    seen_at: float) -> None:
        """What an agent reports replaces the agent's labels and facts; operator labels stay."""
        check_name(name)
        labels, fact_text = dumps_json(check_labels(agent_labels)), dumps_json(check_obj(facts, "facts"))
        self._x("INSERT INTO nodes (name, agent_labels, facts, first_seen, last_seen) VALUES (%s, %s, %s, %s, %s) "
                "ON CONFLICT (name) DO UPDATE SET agent_labels = excluded.agent_labels, facts = excluded.facts, "
                "first_seen = COALESCE(nodes.first_seen, excluded.first_seen), last_seen = excluded.last_seen",
                (name, labels, fact_text, seen_at, seen_at))

    def set_node_labels(self, name: str, labels: dict[str, str]) -> None:
        check_name(name)
        check_labels(labels)
        with self._fenced():
            merged = {**self._operator_labels(name, lock=True), **labels}
            self._x("INSERT INTO nodes (name, operator_labels) VALUES (%s, %s) "
                    "ON CONFLICT (name) DO UPDATE SET operator_labels = excluded.operator_labels",
                    (name, dumps_json(merged)))

    def remove_node_labels(self, name: str, keys: list[str]) -> None:
        check_name(name)
        if isinstance(keys, str):  # a bare string would remove its letters one by one
            raise TypeError("keys must be a list of label keys, not a string")
        with self._fenced():
            drop = set(keys)
            current = self._operator_labels(name, lock=True)
            kept = {k: v for k, v in current.items() if k not in drop}
            if kept != current:
                self._x("UPDATE nodes SET operator_labels = %s WHERE name = %s", (dumps_json(kept), name))

    def _operator_labels(self, name: str, *, lock: bool = False) -> dict[str, str]:
        row = self._x("SELECT operator_labels FROM nodes WHERE name = %s" + (" FOR UPDATE" if lock else ""),
                      (name,)).fetchone()
        return {} if row is None else json.loads(row[0])

    def nodes(self) -> dict[str, NodeRow]:
        rows = self._x("SELECT name, agent_labels, operator_labels, facts, first_seen, last_seen "
                       "FROM nodes ORDER BY name").fetchall()
        return {n: NodeRow(n, json.loads(a), json.loads(o), json.loads(f), fs, ls) for n, a, o, f, fs, ls in rows}

    def delete_node(self, name: str) -> bool:
        with self._fenced():
            return self._x("DELETE FROM nodes WHERE name = %s", (check_name(name),)).rowcount > 0

    # -- assignments

    def put_assignment(self, row: AssignmentRow) -> None:
        """Insert or replace a replica's assignment; the first created_at is kept."""
        check_name(row.replica, "replica")
        check_name(row.model, "model")
        check_name(row.node, "node")
        check_desired(row.desired)
        spec = check_obj(row.spec, "spec")
        served = {"replica": row.replica, "model": row.model.removesuffix(CANDIDATE_SUFFIX)}
        for key, want in served.items():
            if key in spec and spec[key] != want:
                raise ValueError(f"assignment {row.replica}: spec {key} {spec[key]!r} != {want!r}")
        if row.url is not None:
            spec = {**spec, "url": check_name(row.url, "url")}
        with self._fenced():
            self._x("INSERT INTO assignments (replica, model, node, spec, desired, created_at, updated_at) "
                    "VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT (replica) DO UPDATE SET model = excluded.model, "
                    "node = excluded.node, spec = excluded.spec, desired = excluded.desired, "
                    "updated_at = excluded.updated_at",
                    (row.replica, row.model, row.node, dumps_json(spec), row.desired, row.created_at, row.updated_at))

    def set_desired(self, replica: str, desired: str, *, now: float | None = None) -> None:
        """Raises KeyError for an unknown replica: a silent no-op would hide a reconcile bug."""
        check_name(replica, "replica")
        check_desired(desired)
        ts = time.time() if now is None else now
        with self._fenced():
            cur = self._x("UPDATE assignments SET desired = %s, updated_at = %s WHERE replica = %s",
                          (desired, ts, replica))
            if cur.rowcount == 0:
                raise KeyError(replica)

    def delete_assignment(self, replica: str) -> bool:
        with self._fenced():
            return self._x("DELETE FROM assignments WHERE replica = %s",
                           (check_name(replica, "replica"),)).rowcount > 0

    def assignments(self) -> dict[str, AssignmentRow]:
        rows = self._x("SELECT replica, model, node, spec, desired, created_at, updated_at "
                       "FROM assignments ORDER BY replica").fetchall()
        return {row[0]: assignment_row(*row) for row in rows}

    # -- history

    def record(self, event: str, *, replica: str | None = None, model: str | None = None,
               node: str | None = None, detail: str = "", ts: float | None = None) -> None:
        check_event(event, replica, model, node, detail)
        self._x("INSERT INTO history (ts, event, replica, model, node, detail) VALUES (%s, %s, %s, %s, %s, %s)",
                (time.time() if ts is None else ts, event, replica, model, node, detail))

    def history(self, limit: int = 100, replica: str | None = None, model: str | None = None,
                node: str | None = None) -> list[HistoryRow]:
        """Newest first; the filters that are given must all match."""
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        where, args = [], []
        for col, value in (("replica", replica), ("model", model), ("node", node)):
            if value is not None:
                where.append(f"{col} = %s")
                args.append(value)
        sql = "SELECT id, ts, event, replica, model, node, detail FROM history"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY ts DESC, id DESC LIMIT %s"
        return [HistoryRow(*r) for r in self._x(sql, (*args, limit)).fetchall()]

    def prune_history(self, keep: int = 100_000) -> int:
        """Delete all but the newest `keep` events; returns how many went."""
        if keep < 0:
            raise ValueError(f"keep must be >= 0, got {keep}")
        return self._x("DELETE FROM history WHERE id IN "
                       "(SELECT id FROM history ORDER BY ts DESC, id DESC OFFSET %s)", (keep,)).rowcount

    # -- node credentials (only their hashes)

    def credentials(self) -> dict[str, CredentialRow]:
        rows = self._x("SELECT node, hash, issued_at, confirmed_at, revoked_at FROM node_credentials "
                       "ORDER BY node").fetchall()
        return {r[0]: CredentialRow(*r) for r in rows}

    def put_credential(self, node: str, hash_: str, *, issued_at: float, replacing: Any = ...) -> bool:
        """As the SQLite store's: `replacing` makes it first-writer-wins; True when written."""
        check_name(node, "node")
        check_name(hash_, "hash")
        sql, args = credential_upsert(replacing)
        return self._x(sql, (node, hash_, issued_at, *args)).rowcount > 0

    def confirm_credential(self, node: str, hash_: str, *, at: float) -> bool:
        return self._x("UPDATE node_credentials SET confirmed_at = %s WHERE node = %s AND hash = %s "
                       "AND revoked_at IS NULL AND confirmed_at IS NULL",
                       (at, check_name(node, "node"), hash_)).rowcount > 0

    def revoke_credential(self, node: str, *, at: float) -> bool:
        with self._fenced():
            return self._x("UPDATE node_credentials SET revoked_at = %s WHERE node = %s AND revoked_at IS NULL",
                           (at, check_name(node, "node"))).rowcount > 0

    # -- facility holds

    def put_hold(self, domain: str, *, reason: str, drain: bool, now: float | None = None) -> None:
        check_name(domain, "domain")
        if not isinstance(reason, str) or not isinstance(drain, bool):
            raise TypeError("reason must be a string and drain a bool")
        with self._fenced():
            self._x("INSERT INTO holds (domain, reason, drain, created_at) VALUES (%s, %s, %s, %s) "
                    "ON CONFLICT (domain) DO UPDATE SET reason = excluded.reason, drain = excluded.drain",
                    (domain, reason, drain, time.time() if now is None else now))

    def delete_hold(self, domain: str) -> bool:
        with self._fenced():
            return self._x("DELETE FROM holds WHERE domain = %s", (check_name(domain, "domain"),)).rowcount > 0

    def holds(self) -> dict[str, HoldRow]:
        rows = self._x("SELECT domain, reason, drain, created_at FROM holds ORDER BY domain").fetchall()
        return {d: HoldRow(d, r, bool(dr), c) for d, r, dr, c in rows}
