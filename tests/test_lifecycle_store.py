"""The store's lifecycle table (schema 4): documents by kind and key, and a store of schema 2
migrated with its rows kept."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from llmgw.daemon.control.store.sqlite import MIGRATIONS, SCHEMA_VERSION, Store


def test_documents_round_trip_by_kind(tmp_path: Path) -> None:
    with Store.open(str(tmp_path / "s.db")) as s:
        s.put_doc("job", "update-1", {"id": "update-1", "steps": [{"name": "x"}]}, now=1.0)
        s.put_doc("job", "eval-2", {"id": "eval-2"}, now=2.0)
        s.put_doc("suite", "smoke", {"toml": "name = 'smoke'"})
        assert list(s.docs("job")) == ["update-1", "eval-2"]  # oldest first
        assert s.docs("suite") == {"smoke": {"toml": "name = 'smoke'"}}
        assert s.delete_doc("job", "update-1") and not s.delete_doc("job", "update-1")
        with pytest.raises(ValueError, match="unknown lifecycle kind"):
            s.put_doc("secrets", "k", {})
        with pytest.raises(TypeError):
            s.put_doc("job", "k", [])  # type: ignore[arg-type]
    with Store.open(str(tmp_path / "s.db")) as s:  # kept across a reopen
        assert list(s.docs("job")) == ["eval-2"]


def test_a_schema_2_store_is_migrated(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    conn = sqlite3.connect(path)
    for script in MIGRATIONS[:2]:
        conn.executescript(script)
    conn.execute("INSERT INTO meta (key, value) VALUES ('schema_version', '2')")
    conn.execute("INSERT INTO models (name, spec, created_at, updated_at) VALUES ('m', '{}', 0, 0)")
    conn.commit()
    conn.close()
    assert SCHEMA_VERSION == 6  # 4 -> 5: the routers' tables (docs/ha.md); 5 -> 6: tenants' usage
    with Store.open(str(path)) as s:
        assert s.models() == {"m": {}}
        assert s.generation() == 0 and s.lease() is None and s.routers() == {}
        s.put_doc("revisions", "m", {"model": "m"})
        assert s.docs("revisions") == {"m": {"model": "m"}}
