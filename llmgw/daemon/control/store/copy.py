"""`llmgw store migrate`: an existing installation's SQLite store copied into PostgreSQL.

Every fleet table is copied row for row (pg_schema.TABLES: models, nodes, assignments, history,
node credentials, holds, documents — revisions, suites, results, jobs, tenants, API keys —, usage); the routers'
own tables (routers, leader, admin_queue) and the meta rows are not: they belong to the routers
that will run on the target. JSON columns are copied as the exact text SQLite holds (both stores
write the same text). One transaction: the target has all of it or none. A target that already
holds fleet rows is refused unless `force` (then they are replaced)."""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass
from typing import Any

from llmgw.daemon.control.store.pg_schema import TABLES
from llmgw.daemon.control.store.postgres import PgStore
from llmgw.daemon.control.store.rows import StoreError
from llmgw.daemon.control.store.sqlite import Store

__all__ = ["COLUMNS", "CopyError", "copy_store"]

COLUMNS: dict[str, tuple[str, ...]] = {
    "models": ("name", "spec", "created_at", "updated_at"),
    "nodes": ("name", "agent_labels", "operator_labels", "facts", "first_seen", "last_seen"),
    "assignments": ("replica", "model", "node", "spec", "desired", "created_at", "updated_at"),
    "history": ("id", "ts", "event", "replica", "model", "node", "detail"),
    "node_credentials": ("node", "hash", "issued_at", "confirmed_at", "revoked_at"),
    "holds": ("domain", "reason", "drain", "created_at"),
    "lifecycle": ("kind", "key", "value", "updated_at"),
    "usage_raw": ("router", "minute", "tenant", "key", "model", "requests", "prompt_tokens", "cached_tokens",
                  "completion_tokens", "errors"),
    "usage_hourly": ("hour", "tenant", "key", "model", "requests", "prompt_tokens", "cached_tokens",
                     "completion_tokens", "errors"),
}
assert tuple(COLUMNS) == TABLES


class CopyError(Exception):
    """The copy cannot be made (the message says why and what to do)."""


@dataclass(frozen=True)
class CopyResult:
    counts: dict[str, int]
    replaced: dict[str, int]  # rows the target held before (with force)


def _check_not_in_use(path: str) -> None:
    """A router holding the store's lock file is running on it: its later writes would be lost."""
    lock = path + ".lock"
    if not os.path.exists(lock):
        return
    with open(lock, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CopyError(f"{path} is in use by a running llmgw router: stop it first") from None


def open_source(path: str) -> Store:
    if not os.path.isfile(path):
        raise CopyError(f"--from: {path} is not a file (an llmgw router's SQLite store, e.g. "
                        "$XDG_STATE_HOME/llmgw/router.db)")
    _check_not_in_use(path)
    try:
        return Store.open(path)
    except StoreError as e:
        raise CopyError(f"--from: {e}") from None


def copy_store(src: Store, dst: PgStore, *, force: bool = False) -> CopyResult:
    """Copy src's fleet tables into dst in one transaction; CopyError if dst holds rows (no force)."""
    held = {t: int(dst._x(f"SELECT count(*) FROM {t}").fetchone()[0]) for t in TABLES}
    if any(held.values()) and not force:
        what = ", ".join(f"{t} {n}" for t, n in held.items() if n)
        raise CopyError(f"--to: {dst.path} already holds a fleet ({what}): pass --force to replace it")
    counts: dict[str, int] = {}
    with dst.transaction():
        conn = dst._connection()
        for table in reversed(TABLES):
            if held[table]:
                dst._x(f"DELETE FROM {table}")
        for table, cols in COLUMNS.items():
            rows: list[Any] = src._conn.execute(f"SELECT {', '.join(cols)} FROM {table}").fetchall()
            if table == "holds":
                rows = [(d, r, bool(dr), c) for d, r, dr, c in rows]
            if rows:
                marks = ", ".join(["%s"] * len(cols))
                with conn.cursor() as cur:
                    cur.executemany(f"INSERT INTO {table} ({', '.join(cols)}) VALUES ({marks})", rows)
            counts[table] = len(rows)
        # The usage roll-up's watermark with the rows it describes (store/usage_rows.py)
        rolled = src._conn.execute("SELECT value FROM meta WHERE key = 'usage_rolled'").fetchone()
        dst._x("UPDATE meta SET value = %s WHERE key = 'usage_rolled'", (rolled[0] if rolled else "0",))
        # The next history event after the copied ones (ids are given explicitly above).
        dst._x("SELECT setval(pg_get_serial_sequence('history', 'id'), GREATEST((SELECT max(id) FROM history), 1), "
               "(SELECT count(*) > 0 FROM history))")
        dst._x("UPDATE meta SET value = (value::bigint + 1)::text WHERE key = 'generation'")  # routers reload
    return CopyResult(counts, {t: n for t, n in held.items() if n})
