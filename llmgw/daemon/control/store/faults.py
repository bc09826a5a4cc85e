"""A test hook: make a live router's store fail as a full disk does, from outside the process.

With ``LLMGW_STORE_FAULT_FILE=PATH`` in the daemon's environment, every statement that writes
(INSERT, UPDATE, DELETE, REPLACE, COMMIT) raises ``sqlite3.OperationalError`` while PATH exists —
with PATH's text as the message, ``database or disk is full`` when it is empty — and works again
once PATH is removed. Reads are untouched, as on a full disk. Without the variable nothing of this
runs. The integration tests use it where a small tmpfs cannot be mounted (it needs root)."""

from __future__ import annotations

import sqlite3
from typing import Any

__all__ = ["FAULT_ENV", "FaultInjectingConnection"]

FAULT_ENV = "LLMGW_STORE_FAULT_FILE"
_WRITES = ("INSERT", "UPDATE", "DELETE", "REPLACE", "COMMIT")


class FaultInjectingConnection:
    """Wraps the store's sqlite3.Connection (what Store uses of it: execute, in_transaction, close)."""

    def __init__(self, conn: sqlite3.Connection, flag: str) -> None:
        self._conn = conn
        self._flag = flag

    def execute(self, sql: str, params: Any = ()) -> sqlite3.Cursor:
        if sql.lstrip().upper().startswith(_WRITES):
            try:
                with open(self._flag) as f:
                    message = f.read().strip() or "database or disk is full"
            except FileNotFoundError:
                pass
            else:
                raise sqlite3.OperationalError(message)
        return self._conn.execute(sql, params)

    @property
    def in_transaction(self) -> bool:
        return self._conn.in_transaction

    def close(self) -> None:
        self._conn.close()
