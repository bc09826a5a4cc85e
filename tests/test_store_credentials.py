"""The store's node credentials (only their hashes), and the migration that adds them to a store
an older llmgw wrote."""

from __future__ import annotations

import sqlite3

from llmgw.daemon.control.store.sqlite import MIGRATIONS, SCHEMA_VERSION, CredentialRow, Store
from llmgw.daemon.control.store.rows import sql_statements


def test_issue_confirm_revoke_and_reissue() -> None:
    with Store.memory() as s:
        assert s.credentials() == {}
        s.put_credential("gpu-1", "h1", issued_at=10.0)
        assert s.credentials() == {"gpu-1": CredentialRow("gpu-1", "h1", 10.0, None, None)}
        assert not s.confirm_credential("gpu-1", "other-hash", at=11.0)  # not its credential
        assert s.confirm_credential("gpu-1", "h1", at=11.0)
        assert not s.confirm_credential("gpu-1", "h1", at=12.0)  # once
        assert s.revoke_credential("gpu-1", at=13.0)
        assert not s.revoke_credential("gpu-1", at=14.0)
        assert not s.revoke_credential("unknown", at=14.0)
        assert s.credentials()["gpu-1"] == CredentialRow("gpu-1", "h1", 10.0, 11.0, 13.0)
        assert not s.confirm_credential("gpu-1", "h1", at=15.0)  # a revoked one stays revoked
        s.put_credential("gpu-1", "h2", issued_at=20.0)  # a new join under the name: pending again
        assert s.credentials()["gpu-1"] == CredentialRow("gpu-1", "h2", 20.0, None, None)


def test_an_older_store_gains_the_table_and_keeps_its_data(tmp_path) -> None:
    path = str(tmp_path / "router.db")
    conn = sqlite3.connect(path, isolation_level=None)
    for stmt in sql_statements(MIGRATIONS[0]):
        conn.execute(stmt)
    conn.execute("INSERT INTO meta (key, value) VALUES ('schema_version', '1')")
    conn.execute("INSERT INTO nodes (name) VALUES ('gpu-1')")
    conn.close()
    with Store.open(path) as s:
        assert list(s.nodes()) == ["gpu-1"] and s.credentials() == {}
        s.put_credential("gpu-1", "h", issued_at=1.0)
        assert s._conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0] == str(
            SCHEMA_VERSION)
    with Store.open(path) as s:
        assert s.credentials()["gpu-1"].hash == "h"
