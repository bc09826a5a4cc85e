"""The router's persistent store: models, nodes, replica assignments and an event history in one
SQLite file (WAL). Synchronous on purpose: writes are small and fast, and the router runs one
reconcile at a time, so a thread would buy nothing but locking. A worker thread may still call it
(the leader's lease loop): a transaction holds the store's lock, so threads never share one."""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType
from urllib.parse import quote
from typing import Any, Self

from llmgw.daemon.control.store.rows import (
    assignment_row,
    check_event,
    DESIRED_STATES,
    Fenced,
    AssignmentRow,
    CredentialRow,
    HistoryRow,
    HoldRow,
    NodeRow,
    StoreCorrupt,
    StoreError,
    check_desired,
    check_labels,
    check_name,
    check_obj,
    credential_upsert,
    describe,
    dumps_json,
    private_store_files,
    sql_statements,
)
from llmgw.config.names import CANDIDATE_SUFFIX
from llmgw.daemon.control.store.sqlite_cluster import ClusterMixin
from llmgw.daemon.control.store.usage_sqlite import USAGE_TABLES, UsageMixin

log = logging.getLogger("llmgw.control")

__all__ = ["DESIRED_STATES", "SCHEMA_VERSION", "AssignmentRow", "CredentialRow", "HistoryRow", "HoldRow", "NodeRow",
           "Store",
           "StoreCorrupt", "StoreError", "describe", "private_store_files"]


# MIGRATIONS[v] takes a store from schema v to v + 1; append, never edit a released entry.
MIGRATIONS: list[str] = [
    """
    CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
    CREATE TABLE models (
        name TEXT PRIMARY KEY, spec TEXT NOT NULL, created_at REAL NOT NULL, updated_at REAL NOT NULL);
    CREATE TABLE nodes (
        name TEXT PRIMARY KEY,
        agent_labels TEXT NOT NULL DEFAULT '{}', operator_labels TEXT NOT NULL DEFAULT '{}',
        facts TEXT NOT NULL DEFAULT '{}', first_seen REAL, last_seen REAL);
    -- No foreign keys: reconcile owns consistency, and a model or node may go while its
    -- assignments drain.
    CREATE TABLE assignments (
        replica TEXT PRIMARY KEY, model TEXT NOT NULL, node TEXT NOT NULL, spec TEXT NOT NULL,
        desired TEXT NOT NULL CHECK (desired IN ('run', 'drain', 'stop')),
        created_at REAL NOT NULL, updated_at REAL NOT NULL);
    CREATE INDEX assignments_node ON assignments (node);
    CREATE INDEX assignments_model ON assignments (model);
    CREATE TABLE history (
        id INTEGER PRIMARY KEY, ts REAL NOT NULL, event TEXT NOT NULL,
        replica TEXT, model TEXT, node TEXT, detail TEXT NOT NULL DEFAULT '');
    CREATE INDEX history_ts ON history (ts);
    CREATE INDEX history_replica ON history (replica, ts);
    CREATE INDEX history_model ON history (model, ts);
    CREATE INDEX history_node ON history (node, ts);
    """,
    # 1 -> 2: node credentials (llmgw.fleet.identity). Only a hash of each secret is kept.
    """
    CREATE TABLE node_credentials (
        node TEXT PRIMARY KEY, hash TEXT NOT NULL, issued_at REAL NOT NULL,
        confirmed_at REAL, revoked_at REAL);
    """,
    # 2 -> 3: facility holds (llmgw.fleet.domains): nothing new is placed in a held domain.
    """
    CREATE TABLE holds (
        domain TEXT PRIMARY KEY, reason TEXT NOT NULL DEFAULT '', drain INTEGER NOT NULL DEFAULT 0,
        created_at REAL NOT NULL);
    """,
    # 3 -> 4: the model lifecycle (llmgw.lifecycle): revisions, eval suites and results, jobs.
    """
    CREATE TABLE lifecycle (
        kind TEXT NOT NULL, key TEXT NOT NULL, value TEXT NOT NULL, updated_at REAL NOT NULL,
        PRIMARY KEY (kind, key));
    """,
    # 4 -> 5: several routers on one store (docs/ha.md): their rows, the leader's lease, the
    # generation followers poll, and the admin writes a follower hands to the leader.
    """
    CREATE TABLE routers (
        id TEXT PRIMARY KEY, info TEXT NOT NULL, started_at REAL NOT NULL, seen_at REAL NOT NULL);
    CREATE TABLE leader (
        only INTEGER PRIMARY KEY CHECK (only = 1), holder TEXT NOT NULL, epoch INTEGER NOT NULL,
        expires_at REAL NOT NULL, acquired_at REAL NOT NULL);
    CREATE TABLE admin_queue (
        id INTEGER PRIMARY KEY AUTOINCREMENT, epoch INTEGER NOT NULL, request TEXT NOT NULL,
        created_at REAL NOT NULL, answer TEXT, answered_at REAL);
    CREATE INDEX admin_queue_open ON admin_queue (epoch, id) WHERE answer IS NULL;
    INSERT INTO meta (key, value) VALUES ('generation', '0');
    """,
    # 5 -> 6: tenants' usage (store/usage_sqlite.py). Tenants and keys are documents (lifecycle table).
    USAGE_TABLES,
]
# Document kinds: the model lifecycle's, and the tenants' (daemon/control/tenants.py).
LIFECYCLE_KINDS = ("revisions", "suite", "result", "job", "tenant", "api_key", "autoscale")
SCHEMA_VERSION = len(MIGRATIONS)


class Store(UsageMixin, ClusterMixin):
    """Use `Store.open(path)` or `Store.memory()`. Each write method commits on its own unless it
    runs inside `transaction()`."""

    faults: tuple[type[BaseException], ...] = (sqlite3.Error,)

    def __init__(self, conn: sqlite3.Connection, path: str) -> None:
        self._conn = conn
        self.path = path
        self._depth = 0  # transaction() nesting; > 0 means savepoints
        self._lock = threading.RLock()  # held by the thread whose transaction is open
        self._fence: tuple[str, int] | None = None  # set_fence: the (router, epoch) fenced writes need
        self._tx_fenced = False  # the outermost transaction holds a fenced write (checked): bump at commit

    @classmethod
    def open(cls, path: str, *, threaded: bool = False) -> Store:
        """`threaded`: kept for callers that say so; every connection may be used from worker threads
        (the lease loop, the guard's probe), one transaction at a time under the store's lock."""
        if path != ":memory:":
            private_store_files(path)
        try:
            # isolation_level=None: we issue BEGIN/COMMIT ourselves instead of the module guessing.
            # check_same_thread=False: the lease loop and the guard's probe may call from a worker
            # thread; transaction() holds self._lock, so threads never share a transaction.
            conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as e:
            raise StoreError(f"store {path}: cannot open: {e}") from e
        store = cls(conn, path)
        try:
            conn.execute("PRAGMA busy_timeout=5000")  # first, so the WAL switch waits for other writers
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")  # never corrupt; a power cut may lose the latest commits
            conn.execute("PRAGMA foreign_keys=ON")
            store._migrate()
            if path != ":memory:":
                store._check()
        except sqlite3.DatabaseError as e:
            conn.close()
            if describe(e) == "corrupted":
                raise StoreCorrupt(path, str(e)) from None
            raise StoreError(f"store {path} cannot be used ({describe(e)}): {e}") from None
        except BaseException:
            conn.close()
            raise
        return store

    @classmethod
    def memory(cls) -> Store:
        return cls.open(":memory:")

    def close(self) -> None:
        self._conn.close()

    def describe(self, e: BaseException) -> str:
        return describe(e)

    def ping(self) -> None:
        """Whether the file can be read, on a connection of its own (the guard calls it from a
        worker thread while the trio thread may use the store's)."""
        if self.path == ":memory:":
            return
        conn = sqlite3.connect(f"file:{quote(self.path)}?mode=ro", uri=True, timeout=2.0)
        try:
            conn.execute("SELECT count(*) FROM meta").fetchone()
        finally:
            conn.close()

    def wrap_connection(self, wrap: Any) -> None:
        """Put `wrap(connection)` between the store and SQLite (a test hook: store/faults.py)."""
        self._conn = wrap(self._conn)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # -- schema

    def _version(self) -> int:
        tables = {r[0] for r in self._conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if "meta" not in tables:
            if tables:
                raise StoreError(f"store {self.path} is an SQLite database but not an llmgw store")
            return 0
        row = self._conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        try:
            version = int(row[0]) if row else 0
        except ValueError:
            raise StoreError(f"store {self.path} has a bad schema_version {row[0]!r}") from None
        if version > SCHEMA_VERSION:
            raise StoreError(f"store {self.path} was written by a newer llmgw "
                             f"(schema {version} > {SCHEMA_VERSION})")
        return version

    def _migrate(self) -> None:
        # Read first without the write lock, so opening an up-to-date store never waits on a writer.
        if self._version() == SCHEMA_VERSION:
            return
        with self.transaction():
            version = self._version()  # again under the lock: another process may have migrated
            for script in MIGRATIONS[version:]:
                for stmt in sql_statements(script):
                    self._conn.execute(stmt)
            self._conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('schema_version', ?)",
                               (str(SCHEMA_VERSION),))

    def _check(self) -> None:
        """A damaged page anywhere is found now, at open, not by the first read or write that meets
        it (a few ms for a store of 100,000 history events)."""
        problems = [r[0] for r in self._conn.execute("PRAGMA quick_check(3)")]
        if problems != ["ok"]:
            raise sqlite3.DatabaseError("database disk image is malformed: " + "; ".join(map(str, problems)))

    # -- transactions

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """One commit for every write inside. Nested use becomes a savepoint, so an inner block that
        fails and is caught by its caller leaves none of its writes behind."""
        with self._lock:
            yield from self._transaction()

    def _transaction(self) -> Iterator[None]:
        conn = self._conn
        if self._depth == 0:
            conn.execute("BEGIN IMMEDIATE")  # take the write lock now: no SQLITE_BUSY on upgrade
            commit, rollback = ("COMMIT",), ("ROLLBACK",)
        else:
            sp = f"sp{self._depth}"
            conn.execute(f"SAVEPOINT {sp}")
            commit, rollback = (f"RELEASE {sp}",), (f"ROLLBACK TO {sp}", f"RELEASE {sp}")
        self._depth += 1
        try:
            yield
            if self._depth == 1 and self._tx_fenced:
                conn.execute("UPDATE meta SET value = CAST(value AS INTEGER) + 1 WHERE key = 'generation'")
            for stmt in commit:
                conn.execute(stmt)
        except BaseException:
            if conn.in_transaction:  # SQLite may already have rolled back on its own (e.g. disk full)
                for stmt in rollback:
                    conn.execute(stmt)
            raise
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._tx_fenced = False

    def _fenced_write(self) -> None:
        """Called by every fenced write inside its transaction: the first of an outermost
        transaction checks the fence (under BEGIN IMMEDIATE's write lock, so no takeover can come
        between the check and the commit) and marks it for a generation bump."""
        assert self._depth > 0, "a fenced write outside a transaction"
        if self._tx_fenced:
            return
        if self._fence is not None:
            row = self._conn.execute("SELECT holder, epoch FROM leader WHERE only = 1").fetchone()
            if row is None or (row[0], row[1]) != self._fence:
                raise Fenced(*self._fence, *(row if row is not None else (None, None)))
        self._tx_fenced = True

    # -- models

    def put_model(self, name: str, spec: dict[str, Any], *, now: float | None = None) -> None:
        check_name(name)
        text = dumps_json(check_obj(spec, "spec"))
        ts = time.time() if now is None else now
        with self.transaction():
            self._fenced_write()
            self._conn.execute(
                "INSERT INTO models (name, spec, created_at, updated_at) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (name) DO UPDATE SET spec = excluded.spec, updated_at = excluded.updated_at",
                (name, text, ts, ts))

    def delete_model(self, name: str) -> bool:
        with self.transaction():
            self._fenced_write()
            return self._conn.execute("DELETE FROM models WHERE name = ?", (check_name(name),)).rowcount > 0

    def models(self) -> dict[str, dict[str, Any]]:
        return {n: json.loads(s) for n, s in self._conn.execute("SELECT name, spec FROM models ORDER BY name")}

    def model(self, name: str) -> dict[str, Any] | None:
        row = self._conn.execute("SELECT spec FROM models WHERE name = ?", (check_name(name),)).fetchone()
        return None if row is None else json.loads(row[0])

    # -- the model lifecycle: one JSON document per (kind, key)

    def put_doc(self, kind: str, key: str, value: dict[str, Any], *, now: float | None = None) -> None:
        if kind not in LIFECYCLE_KINDS:
            raise ValueError(f"unknown lifecycle kind {kind!r}")
        text = dumps_json(check_obj(value, kind))
        with self.transaction():
            self._fenced_write()
            self._conn.execute("INSERT OR REPLACE INTO lifecycle (kind, key, value, updated_at) VALUES (?, ?, ?, ?)",
                               (kind, check_name(key, "key"), text, time.time() if now is None else now))

    def delete_doc(self, kind: str, key: str) -> bool:
        with self.transaction():
            self._fenced_write()
            return self._conn.execute("DELETE FROM lifecycle WHERE kind = ? AND key = ?", (kind, key)).rowcount > 0

    def write_docs(self, puts: list[tuple[str, str, dict[str, Any]]], deletes: list[tuple[str, str]]) -> None:
        """Several documents put and deleted in one transaction: all or none."""
        with self.transaction():
            for kind, key, value in puts:
                self.put_doc(kind, key, value)
            for kind, key in deletes:
                self.delete_doc(kind, key)

    def docs(self, kind: str) -> dict[str, dict[str, Any]]:
        return {k: json.loads(v) for k, v in self._conn.execute(
            "SELECT key, value FROM lifecycle WHERE kind = ? ORDER BY updated_at, key", (kind,))}

    # -- nodes

    def upsert_node(self, name: str, *, agent_labels: dict[str, str], facts: dict[str, Any],
                    seen_at: float) -> None:
        """What an agent reports replaces the agent's labels and facts; operator labels stay."""
        check_name(name)
        labels, fact_text = dumps_json(check_labels(agent_labels)), dumps_json(check_obj(facts, "facts"))
        with self.transaction():
            self._conn.execute(
                "INSERT INTO nodes (name, agent_labels, facts, first_seen, last_seen) VALUES (?, ?, ?, ?, ?) "
                "ON CONFLICT (name) DO UPDATE SET agent_labels = excluded.agent_labels, facts = excluded.facts, "
                "first_seen = COALESCE(nodes.first_seen, excluded.first_seen), last_seen = excluded.last_seen",
                (name, labels, fact_text, seen_at, seen_at))

    def set_node_labels(self, name: str, labels: dict[str, str]) -> None:
        """Merge operator labels into the node's (a node can be labelled before its agent connects)."""
        check_name(name)
        check_labels(labels)
        with self.transaction():
            self._fenced_write()
            merged = {**self._operator_labels(name), **labels}
            self._conn.execute(
                "INSERT INTO nodes (name, operator_labels) VALUES (?, ?) "
                "ON CONFLICT (name) DO UPDATE SET operator_labels = excluded.operator_labels",
                (name, dumps_json(merged)))

    def remove_node_labels(self, name: str, keys: list[str]) -> None:
        check_name(name)
        if isinstance(keys, str):  # a bare string would remove its letters one by one
            raise TypeError("keys must be a list of label keys, not a string")
        with self.transaction():
            self._fenced_write()
            drop = set(keys)
            current = self._operator_labels(name)
            kept = {k: v for k, v in current.items() if k not in drop}
            if kept != current:
                self._conn.execute("UPDATE nodes SET operator_labels = ? WHERE name = ?", (dumps_json(kept), name))

    def _operator_labels(self, name: str) -> dict[str, str]:
        row = self._conn.execute("SELECT operator_labels FROM nodes WHERE name = ?", (name,)).fetchone()
        return {} if row is None else json.loads(row[0])

    def nodes(self) -> dict[str, NodeRow]:
        rows = self._conn.execute("SELECT name, agent_labels, operator_labels, facts, first_seen, last_seen "
                                  "FROM nodes ORDER BY name")
        return {n: NodeRow(n, json.loads(a), json.loads(o), json.loads(f), fs, ls) for n, a, o, f, fs, ls in rows}

    def delete_node(self, name: str) -> bool:
        with self.transaction():
            self._fenced_write()
            return self._conn.execute("DELETE FROM nodes WHERE name = ?", (check_name(name),)).rowcount > 0

    # -- assignments

    def put_assignment(self, row: AssignmentRow) -> None:
        """Insert or replace a replica's assignment; the first created_at is kept."""
        check_name(row.replica, "replica")
        check_name(row.model, "model")
        check_name(row.node, "node")
        check_desired(row.desired)
        spec = check_obj(row.spec, "spec")
        # A candidate's row is under its routing key (NAME#candidate) while its engine serves NAME.
        served = {"replica": row.replica, "model": row.model.removesuffix(CANDIDATE_SUFFIX)}
        for key, want in served.items():
            if key in spec and spec[key] != want:
                raise ValueError(f"assignment {row.replica}: spec {key} {spec[key]!r} != {want!r}")
        if row.url is not None:
            spec = {**spec, "url": check_name(row.url, "url")}
        with self.transaction():
            self._fenced_write()
            self._conn.execute(
                "INSERT INTO assignments (replica, model, node, spec, desired, created_at, updated_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (replica) DO UPDATE SET model = excluded.model, "
                "node = excluded.node, spec = excluded.spec, desired = excluded.desired, "
                "updated_at = excluded.updated_at",
                (row.replica, row.model, row.node, dumps_json(spec), row.desired, row.created_at, row.updated_at))

    def set_desired(self, replica: str, desired: str, *, now: float | None = None) -> None:
        """Raises KeyError for an unknown replica: a silent no-op would hide a reconcile bug."""
        check_name(replica, "replica")
        check_desired(desired)
        ts = time.time() if now is None else now
        with self.transaction():
            self._fenced_write()
            cur = self._conn.execute("UPDATE assignments SET desired = ?, updated_at = ? WHERE replica = ?",
                                     (desired, ts, replica))
            if cur.rowcount == 0:
                raise KeyError(replica)

    def delete_assignment(self, replica: str) -> bool:
        with self.transaction():
            self._fenced_write()
            cur = self._conn.execute("DELETE FROM assignments WHERE replica = ?", (check_name(replica, "replica"),))
            return cur.rowcount > 0

    def assignments(self) -> dict[str, AssignmentRow]:
        rows = self._conn.execute("SELECT replica, model, node, spec, desired, created_at, updated_at "
                                  "FROM assignments ORDER BY replica")
        return {row[0]: assignment_row(*row) for row in rows}

    # -- history

    def record(self, event: str, *, replica: str | None = None, model: str | None = None,
               node: str | None = None, detail: str = "", ts: float | None = None) -> None:
        check_event(event, replica, model, node, detail)
        with self.transaction():
            self._conn.execute("INSERT INTO history (ts, event, replica, model, node, detail) "
                               "VALUES (?, ?, ?, ?, ?, ?)",
                               (time.time() if ts is None else ts, event, replica, model, node, detail))

    def history(self, limit: int = 100, replica: str | None = None, model: str | None = None,
                node: str | None = None) -> list[HistoryRow]:
        """Newest first; the filters that are given must all match."""
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        where, args = [], []
        for col, value in (("replica", replica), ("model", model), ("node", node)):
            if value is not None:
                where.append(f"{col} = ?")
                args.append(value)
        sql = "SELECT id, ts, event, replica, model, node, detail FROM history"
        if where:
            sql += " WHERE " + " AND ".join(where)
        # id breaks ties so events recorded at the same instant keep their order.
        sql += " ORDER BY ts DESC, id DESC LIMIT ?"
        return [HistoryRow(*r) for r in self._conn.execute(sql, (*args, limit))]

    def prune_history(self, keep: int = 100_000) -> int:
        """Delete all but the newest `keep` events; returns how many went."""
        if keep < 0:
            raise ValueError(f"keep must be >= 0, got {keep}")
        with self.transaction():
            return self._conn.execute(
                "DELETE FROM history WHERE id IN "
                "(SELECT id FROM history ORDER BY ts DESC, id DESC LIMIT -1 OFFSET ?)", (keep,)).rowcount

    # -- node credentials (only their hashes)

    def credentials(self) -> dict[str, CredentialRow]:
        rows = self._conn.execute("SELECT node, hash, issued_at, confirmed_at, revoked_at FROM node_credentials "
                                  "ORDER BY node")
        return {r[0]: CredentialRow(*r) for r in rows}

    def put_credential(self, node: str, hash_: str, *, issued_at: float, replacing: Any = ...) -> bool:
        """A new credential for `node`, pending until confirmed. `replacing`: ... (the default)
        replaces any earlier one; None writes only if the node has no live (unrevoked) credential,
        a hash only if the live one is that — first writer wins when two routers issue to one node
        at once. True when written."""
        check_name(node, "node")
        check_name(hash_, "hash")
        sql, args = credential_upsert(replacing)
        with self.transaction():
            return self._conn.execute(sql.replace("%s", "?"), (node, hash_, issued_at, *args)).rowcount > 0

    def confirm_credential(self, node: str, hash_: str, *, at: float) -> bool:
        """Mark the credential confirmed if it is still the node's (and not revoked)."""
        with self.transaction():
            return self._conn.execute(
                "UPDATE node_credentials SET confirmed_at = ? WHERE node = ? AND hash = ? AND revoked_at IS NULL "
                "AND confirmed_at IS NULL", (at, check_name(node, "node"), hash_)).rowcount > 0

    def revoke_credential(self, node: str, *, at: float) -> bool:
        with self.transaction():
            self._fenced_write()
            return self._conn.execute("UPDATE node_credentials SET revoked_at = ? WHERE node = ? AND revoked_at IS NULL",
                                      (at, check_name(node, "node"))).rowcount > 0

    # -- facility holds

    def put_hold(self, domain: str, *, reason: str, drain: bool, now: float | None = None) -> None:
        """Hold a domain (or change its hold's reason and drain)."""
        check_name(domain, "domain")
        if not isinstance(reason, str) or not isinstance(drain, bool):
            raise TypeError("reason must be a string and drain a bool")
        with self.transaction():
            self._fenced_write()
            self._conn.execute(
                "INSERT INTO holds (domain, reason, drain, created_at) VALUES (?, ?, ?, ?) ON CONFLICT (domain) "
                "DO UPDATE SET reason = excluded.reason, drain = excluded.drain",
                (domain, reason, int(drain), time.time() if now is None else now))

    def delete_hold(self, domain: str) -> bool:
        with self.transaction():
            self._fenced_write()
            return self._conn.execute("DELETE FROM holds WHERE domain = ?", (check_name(domain, "domain"),)).rowcount > 0

    def holds(self) -> dict[str, HoldRow]:
        rows = self._conn.execute("SELECT domain, reason, drain, created_at FROM holds ORDER BY domain")
        return {d: HoldRow(d, r, bool(dr), c) for d, r, dr, c in rows}
