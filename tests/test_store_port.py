"""The store seam (llmgw/daemon/control/store/port.py): the SQLite store implements FleetStore, and
everything the control plane asks of a store — the operations it names to the StoreGuard, the calls
on a store it is handed — is in the Protocol, so a second backend that implements it is enough."""

from __future__ import annotations

import re
from pathlib import Path

from llmgw.daemon.control.store.port import FleetStore
from llmgw.daemon.control.store.sqlite import Store

CONTROL = Path(__file__).resolve().parent.parent / "llmgw" / "daemon" / "control"


def _protocol_methods() -> set[str]:
    return {n for n in vars(FleetStore) if not n.startswith("_") and callable(getattr(FleetStore, n))}


def test_the_sqlite_store_is_a_fleet_store() -> None:
    with Store.memory() as s:
        assert isinstance(s, FleetStore)
        for name in _protocol_methods():
            assert callable(getattr(s, name)), name


def test_the_postgresql_store_is_a_fleet_store() -> None:
    from llmgw.daemon.control.store.postgres import PgStore

    for name in _protocol_methods() | {"path", "faults"}:
        assert name in dir(PgStore) or name == "path", name
        if name not in ("path", "faults"):
            assert callable(getattr(PgStore, name)), name


def test_every_operation_the_plane_names_is_in_the_protocol() -> None:
    named: set[str] = set()
    called: set[str] = set()
    for f in CONTROL.rglob("*.py"):
        if f.parent.name == "store" and f.name in ("sqlite.py", "sqlite_cluster.py", "postgres.py",
                                                   "postgres_fleet.py", "pg_schema.py", "faults.py"):
            continue  # the backends themselves, and the SQLite test hook
        text = f.read_text()
        named |= set(re.findall(r"guard\.(?:must_write|write|read)\(\s*\"([a-z_]+)\"", text))
        called |= set(re.findall(r"\b(?:st|store)\.([a-z_]+)\(", text))
    assert named, "the guard's operations were not found: the pattern is out of date"
    missing = (named | called) - _protocol_methods()
    assert not missing, f"used of a store but not in FleetStore: {sorted(missing)}"
