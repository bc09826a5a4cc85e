"""The fleet's state in PostgreSQL: the store several routers share (`[store] url = "postgresql://…"`,
docs/ha.md). It implements FleetStore (store/port.py) with psycopg 3, the rows in postgres_fleet.py
and the routers' part (lease, fence, routers' rows, admin queue) here.

Synchronous, as the SQLite store is, but **every call is bounded** by `timeout_s`: the connection's
`wait` (psycopg drives each operation as a generator and waits on the socket between its steps) is
given the call's deadline, so a blackholed network or a paused server costs the caller at most
`timeout_s`; the connection is then closed (its state is unknown) and raises StoreTimeout. The
next call reconnects — at most once a second from calls, so a store that is away does not cost
every call its connect timeout; `ping()` (the guard's probe, from a worker thread) always tries.
The same figure goes to the server as statement_timeout, lock_timeout and
idle_in_transaction_session_timeout: a leader paused inside a transaction cannot hold the lease's
row lock past it. Why generator waiting on the trio thread and not a worker
thread per call: docs/ha.md ("The store"), measured by bench/bench_store_pg.py.

One connection, in autocommit mode; `transaction()` issues BEGIN/COMMIT itself (savepoints when
nested). A re-entrant lock makes the store safe to call from worker threads (the lease loop, the
guard's probe): a call waits for another thread's open transaction to end."""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Any, Self
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import psycopg
from psycopg import errors as pge
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from llmgw.daemon.control.store.pg_schema import migrate
from llmgw.daemon.control.store.postgres_fleet import FleetRowsMixin
from llmgw.daemon.control.store.usage_postgres import PgUsageMixin
from llmgw.daemon.control.store.rows import CallTimes, Fenced, LeaseRow, RouterRow, StoreError, check_name, check_obj, dumps_json

log = logging.getLogger("llmgw.control")

__all__ = ["PgStore", "StoreTimeout", "display_dsn", "describe_pg"]

RECONNECT_EVERY_S = 1.0
# A session idle inside a transaction this long is ended by the server: timeout_s (lease_s is
# longer), at least 1 s — a leader frozen mid-transaction then frees the leader row's lock
# before its lease runs out, so its successor is not held up.
IDLE_TX_MIN_MS = 1000


class StoreTimeout(Exception):
    """A PostgreSQL call did not finish within [store] timeout_s (or the server cannot be reached
    and was tried less than RECONNECT_EVERY_S ago); `kind` is "timeout" or "unreachable"."""

    def __init__(self, message: str, kind: str = "timeout") -> None:
        super().__init__(message)
        self.kind = kind


class _BoundedConnection(psycopg.Connection[Any]):
    """A psycopg connection whose every wait ends at `deadline` (time.monotonic): past it the
    connection is closed and StoreTimeout raised."""

    deadline: float | None = None

    def wait(self, gen: Any, interval: float = 0.1, timeout: float | None = None) -> Any:
        if self.deadline is None:
            return super().wait(gen, interval, timeout)
        left = self.deadline - time.monotonic()
        if left <= 0:
            self.pgconn.finish()
            raise StoreTimeout("no answer within the store's timeout")
        try:
            return super().wait(gen, interval, left if timeout is None else min(timeout, left))
        except pge._WaitTimeout:
            self.pgconn.finish()  # mid-statement: the connection's state is unknown
            raise StoreTimeout("no answer within the store's timeout") from None


# SQLSTATE classes and codes an operator acts on (psycopg.errors.sqlstate_errors).
_SQLSTATE = (("28", "auth"), ("3D000", "no such database"), ("25006", "read only"), ("53100", "disk full"),
             ("53300", "too many connections"), ("53", "out of resources"), ("57014", "timeout"),
             ("55P03", "locked"), ("40", "conflict"), ("57P", "server shutting down"), ("42501", "permission denied"),
             ("42P01", "schema mismatch"), ("42703", "schema mismatch"), ("42", "SQL error"), ("XX001", "corrupted"), ("XX002", "corrupted"), ("08", "unreachable"))
_MESSAGES = (("password authentication failed", "auth"), ("no password supplied", "auth"),
             ("timeout expired", "timeout"), ("connection refused", "unreachable"),
             ("could not translate host name", "unreachable"), ("no route to host", "unreachable"),
             ("server closed the connection", "connection lost"), ("connection is closed", "connection lost"),
             ("the connection is lost", "connection lost"), ("consuming input failed", "connection lost"),
             ("does not exist", "no such database"))


def describe_pg(e: BaseException) -> str:
    """A PostgreSQL failure in a few words: "unreachable", "timeout", "auth", "read only"..."""
    if isinstance(e, StoreTimeout):
        return e.kind
    if isinstance(e, StoreError) and "newer llmgw" in str(e):
        return "schema newer"
    code = getattr(e, "sqlstate", None) or ""
    for prefix, kind in _SQLSTATE:
        if code.startswith(prefix):
            return kind
    text = str(e).lower()
    for fragment, kind in _MESSAGES:
        if fragment in text:
            return kind
    if isinstance(e, psycopg.OperationalError):
        return "unreachable"
    return text.split(":")[0][:60] or type(e).__name__


def display_dsn(dsn: str) -> str:
    """The DSN as logs and the status show it: without its password."""
    if "://" in dsn:
        parts = urlsplit(dsn)
        host = parts.hostname or ""
        netloc = (f"{parts.username}@" if parts.username else "") + (f"[{host}]" if ":" in host else host)
        if parts.port:
            netloc += f":{parts.port}"
        query = urlencode([(k, v) for k, v in parse_qsl(parts.query) if k != "password"])
        return urlunsplit((parts.scheme, netloc, parts.path, query, ""))
    return make_conninfo(**{k: v for k, v in conninfo_to_dict(dsn).items() if k != "password"})


class PgStore(PgUsageMixin, FleetRowsMixin):
    """Use `PgStore.open(dsn, password=..., timeout_s=...)`. Each write commits on its own unless
    it runs inside `transaction()`."""

    faults: tuple[type[BaseException], ...] = (psycopg.Error, StoreTimeout)
    shared = True  # several routers share a PostgreSQL store by design (daemon/control/cluster.py)

    def __init__(self, dsn: str, *, password: str | None, timeout_s: float) -> None:
        self.path = display_dsn(dsn)
        self.timeout_s = timeout_s
        self._dsn = dsn
        self._password = password
        self._conn: _BoundedConnection | None = None
        self._lock = threading.RLock()
        self._depth = 0
        self._fence: tuple[str, int] | None = None
        self._tx_fenced = False
        self._failed_at = -float("inf")  # monotonic time of the last failed connect
        self._last_error = ""
        self.created = False  # open() made the schema (an empty database)
        self.call_times = CallTimes()  # every statement, for /metrics

    @classmethod
    def open(cls, dsn: str, *, password: str | None = None, timeout_s: float = 2.0) -> PgStore:
        """Connect and bring the schema up to date (StoreError: refused, with one line saying why)."""
        store = cls(dsn, password=password, timeout_s=timeout_s)
        try:
            with store._lock:
                conn = store._connection(force=True)
                conn.deadline = time.monotonic() + max(timeout_s, 30.0)  # a migration may take a while
                try:
                    store.created = migrate(conn, store.path) == 0
                finally:
                    conn.deadline = None
        except (psycopg.Error, StoreTimeout) as e:
            store.close()
            raise StoreError(f"store {store.path} cannot be used ({describe_pg(e)}): "
                             f"{' '.join(str(e).split())}") from None
        except BaseException:
            store.close()
            raise
        return store

    def open_again(self) -> PgStore:
        """A second connection to the same database (the schema is already up to date), for calls
        made from worker threads (daemon/control/leader.py); it connects at its first call."""
        return PgStore(self._dsn, password=self._password, timeout_s=self.timeout_s)

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def describe(self, e: BaseException) -> str:
        return describe_pg(e)

    # -- the connection and every statement

    def _connection(self, *, force: bool = False) -> _BoundedConnection:
        conn = self._conn
        if conn is not None and not conn.closed and not conn.broken:
            return conn
        if self._depth > 0:  # lost inside a transaction: it is gone, never silently restarted
            raise StoreTimeout("the connection was lost inside a transaction", "connection lost")
        self._conn = None
        if not force and time.monotonic() - self._failed_at < RECONNECT_EVERY_S:
            raise StoreTimeout(f"cannot reach the store ({self._last_error}); trying again shortly", "unreachable")
        # The server gives up on a statement or a lock wait a little before our deadline, so a
        # slow one ends with its own clean error and the connection stays usable.
        ms, lock_ms = max(int(self.timeout_s * 900), 1), max(int(self.timeout_s * 800), 1)
        kw: dict[str, Any] = {"connect_timeout": max(2, int(self.timeout_s + 0.999)),
                              "options": f"-c statement_timeout={ms} -c lock_timeout={lock_ms} "
                                         f"-c idle_in_transaction_session_timeout={max(ms, IDLE_TX_MIN_MS)}",
                              "application_name": "llmgw"}
        if self._password is not None:
            kw["password"] = self._password
        try:
            self._conn = _BoundedConnection.connect(self._dsn, autocommit=True, **kw)
        except psycopg.Error as e:
            self._failed_at, self._last_error = time.monotonic(), f"{describe_pg(e)}: {' '.join(str(e).split())}"
            raise
        return self._conn

    def _x(self, sql: str, args: Any = ()) -> psycopg.Cursor[Any]:
        """One statement, bounded by timeout_s."""
        with self._lock:
            conn = self._connection()
            t0 = time.monotonic()
            conn.deadline = t0 + self.timeout_s
            try:
                return conn.execute(sql, args)
            except (psycopg.OperationalError, StoreTimeout):
                if conn.closed or conn.broken:
                    self._failed_at, self._last_error = time.monotonic(), "connection lost"
                raise
            finally:
                conn.deadline = None
                self.call_times.record(time.monotonic() - t0)

    def ping(self) -> None:
        with self._lock:
            if self._depth == 0:
                self._failed_at = -float("inf")  # the probe always tries
            self._x("SELECT 1").fetchone()

    # -- transactions and the fence

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """One commit for every write inside; nested use becomes a savepoint."""
        with self._lock:
            if self._depth == 0:
                self._x("BEGIN")
                commit, rollback = ("COMMIT",), ("ROLLBACK",)
            else:
                sp = f"sp{self._depth}"
                self._x(f"SAVEPOINT {sp}")
                commit, rollback = (f"RELEASE SAVEPOINT {sp}",), (f"ROLLBACK TO SAVEPOINT {sp}", f"RELEASE SAVEPOINT {sp}")
            self._depth += 1
            try:
                yield
                if self._depth == 1 and self._tx_fenced:
                    self._x("UPDATE meta SET value = (value::bigint + 1)::text WHERE key = 'generation'")
                for stmt in commit:
                    self._x(stmt)
            except BaseException:
                conn = self._conn
                if conn is not None and not conn.closed and not conn.broken:
                    try:
                        for stmt in rollback:
                            self._x(stmt)
                    except (psycopg.Error, StoreTimeout):
                        self.close_broken()
                raise
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self._tx_fenced = False

    @contextmanager
    def _fenced(self) -> Iterator[None]:
        """A fenced write method's block: its own transaction at the outermost level; inside a
        caller's, no savepoint of its own (three round trips saved a write). A statement that fails
        on the server aborts the caller's whole transaction either way, and the rows' checks run
        before any statement, so there is nothing for a savepoint to keep apart."""
        with self._lock:
            if self._depth == 0:
                with self.transaction():
                    self._fenced_write()
                    yield
            else:
                self._fenced_write()
                yield

    def close_broken(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _fenced_write(self) -> None:
        """The first fenced write of an outermost transaction checks the fence, locking the
        leader row FOR SHARE: a takeover waits for this commit, and one committed before sees
        its new holder here."""
        assert self._depth > 0, "a fenced write outside a transaction"
        if self._tx_fenced:
            return
        if self._fence is not None:
            row = self._x("SELECT holder, epoch FROM leader WHERE \"only\" = 1 FOR SHARE").fetchone()
            if row is None or (row[0], row[1]) != self._fence:
                raise Fenced(*self._fence, *(row if row is not None else (None, None)))
        self._tx_fenced = True

    # -- the routers' part (docs/ha.md); every write here is unfenced

    def store_now(self) -> float:
        return float(self._x("SELECT extract(epoch from clock_timestamp())::float8").fetchone()[0])

    def try_lead(self, router_id: str, ttl_s: float) -> LeaseRow:
        check_name(router_id, "router_id")
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s!r}")
        # One statement: the row lock orders it against fenced transactions (FOR SHARE) and other routers.
        row = self._x(
            "WITH n AS (SELECT extract(epoch from clock_timestamp())::float8 AS t) "
            "INSERT INTO leader (\"only\", holder, epoch, expires_at, acquired_at) SELECT 1, %s, 1, t + %s, t FROM n "
            "ON CONFLICT (\"only\") DO UPDATE SET holder = excluded.holder, "
            "epoch = CASE WHEN leader.holder = excluded.holder THEN leader.epoch ELSE leader.epoch + 1 END, "
            "expires_at = excluded.expires_at, "
            "acquired_at = CASE WHEN leader.holder = excluded.holder THEN leader.acquired_at "
            "ELSE excluded.acquired_at END "
            "WHERE leader.holder = excluded.holder OR leader.expires_at <= excluded.acquired_at "
            "RETURNING holder, epoch", (router_id, float(ttl_s))).fetchone()
        if row is not None:
            return LeaseRow(row[0], int(row[1]), float(ttl_s), True)
        held = self.lease()
        assert held is not None
        return held

    def release_lead(self, router_id: str) -> None:
        self._x("UPDATE leader SET expires_at = extract(epoch from clock_timestamp()) "
                "WHERE \"only\" = 1 AND holder = %s AND expires_at > extract(epoch from clock_timestamp())", (router_id,))

    def lease(self) -> LeaseRow | None:
        row = self._x("SELECT holder, epoch, expires_at - extract(epoch from clock_timestamp())::float8 "
                      "FROM leader WHERE \"only\" = 1").fetchone()
        return None if row is None else LeaseRow(row[0], int(row[1]), float(row[2]), False)

    def set_fence(self, router_id: str | None, epoch: int | None) -> None:
        if (router_id is None) != (epoch is None):
            raise ValueError("set_fence: router_id and epoch are both given or both None")
        with self._lock:
            self._fence = None if router_id is None or epoch is None else (check_name(router_id, "router_id"),
                                                                            int(epoch))

    def generation(self) -> int:
        row = self._x("SELECT value FROM meta WHERE key = 'generation'").fetchone()
        return int(row[0]) if row else 0

    def register_router(self, router_id: str, info: dict[str, Any], *, started_at: float) -> None:
        self._x("INSERT INTO routers (id, info, started_at, seen_at) "
                "VALUES (%s, %s, %s, extract(epoch from clock_timestamp())) ON CONFLICT (id) DO UPDATE "
                "SET info = excluded.info, started_at = excluded.started_at, seen_at = excluded.seen_at",
                (check_name(router_id, "router_id"), dumps_json(check_obj(info, "info")), started_at))

    def router_seen(self, router_id: str) -> None:
        self._x("UPDATE routers SET seen_at = extract(epoch from clock_timestamp()) WHERE id = %s", (router_id,))

    def routers(self) -> dict[str, RouterRow]:
        rows = self._x("SELECT id, info, started_at, seen_at, extract(epoch from clock_timestamp())::float8 - seen_at "
                       "FROM routers ORDER BY id").fetchall()
        return {i: RouterRow(i, json.loads(info), st, seen, age) for i, info, st, seen, age in rows}

    def forget_router(self, router_id: str) -> bool:
        return self._x("DELETE FROM routers WHERE id = %s", (router_id,)).rowcount > 0

    def cluster_secret(self) -> bytes:
        with self.transaction():
            self._x("INSERT INTO meta (key, value) VALUES ('cluster_secret', %s) ON CONFLICT (key) DO NOTHING",
                    (secrets.token_hex(32),))
            row = self._x("SELECT value FROM meta WHERE key = 'cluster_secret'").fetchone()
        return bytes.fromhex(row[0])

    def queue_admin(self, epoch: int, request: dict[str, Any]) -> int:
        return int(self._x("INSERT INTO admin_queue (epoch, request, created_at) "
                           "VALUES (%s, %s, extract(epoch from clock_timestamp())) RETURNING id",
                           (int(epoch), dumps_json(check_obj(request, "request")))).fetchone()[0])

    def admin_requests(self, epoch: int, after_id: int) -> list[tuple[int, dict[str, Any]]]:
        rows = self._x("SELECT id, request FROM admin_queue WHERE epoch = %s AND id > %s AND answer IS NULL "
                       "ORDER BY id", (int(epoch), int(after_id))).fetchall()
        return [(int(i), json.loads(r)) for i, r in rows]

    def answer_admin(self, qid: int, answer: dict[str, Any]) -> None:
        self._x("UPDATE admin_queue SET answer = %s, answered_at = extract(epoch from clock_timestamp()) WHERE id = %s",
                (dumps_json(check_obj(answer, "answer")), int(qid)))

    def admin_answer(self, qid: int) -> dict[str, Any] | None:
        row = self._x("SELECT answer FROM admin_queue WHERE id = %s", (int(qid),)).fetchone()
        return None if row is None or row[0] is None else json.loads(row[0])

    def take_admin_answer(self, qid: int) -> dict[str, Any] | None:
        """The answer, if there is one yet, and the request's row deleted with it: an answer may hold
        a secret (a new API key's) that must not stay in the store."""
        row = self._x("DELETE FROM admin_queue WHERE id = %s AND answer IS NOT NULL RETURNING answer",
                      (int(qid),)).fetchone()
        return None if row is None else json.loads(row[0])

    def prune_admin(self, older_than_s: float) -> int:
        return self._x("DELETE FROM admin_queue WHERE created_at < extract(epoch from clock_timestamp()) - %s",
                       (float(older_than_s),)).rowcount

