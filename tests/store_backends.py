"""Store fixtures. `pg_server`: one throwaway PostgreSQL per test session (tests/pg_server.py),
skipping with the reason when none can run; `pg_url`: a fresh database on it for each test.
`any_store` and `reopenable`: each store test runs against every backend — SQLite (a file in the
test's directory) and PostgreSQL (a fresh database)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from llmgw.daemon.control.store.port import FleetStore
from llmgw.daemon.control.store.sqlite import Store
from tests.pg_server import PgServer, PgUnavailable

BACKENDS = ["sqlite", "postgres"]
_numbers = itertools.count(1)


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    server = PgServer()
    try:
        server.start()
    except PgUnavailable as e:
        server.cleanup()
        pytest.skip(f"no test PostgreSQL: {e}")
    yield server
    server.cleanup()


@pytest.fixture
def pg_url(pg_server: PgServer) -> Iterator[str]:
    """postgresql://postgres:PASSWORD@127.0.0.1:PORT/DB — a new, empty database."""
    name = f"t{next(_numbers)}"
    url = pg_server.create_database(name)
    yield url
    try:
        pg_server.drop_database(name)
    except Exception:  # noqa: BLE001 — a paused or stopped server: the session's cleanup removes it all
        pass


def _opener(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], FleetStore]:
    if request.param == "sqlite":
        path = str(tmp_path / "llmgw" / "router.db")
        return lambda: Store.open(path)
    from llmgw.daemon.control.store.postgres import PgStore

    url = request.getfixturevalue("pg_url")
    return lambda: PgStore.open(url, timeout_s=5.0)


@pytest.fixture(params=BACKENDS)
def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[FleetStore]:
    st = _opener(request, tmp_path)()
    yield st
    st.close()


@pytest.fixture(params=BACKENDS)
def reopenable(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], FleetStore]:
    """Opens the same store again at each call (the caller closes each)."""
    return _opener(request, tmp_path)
