"""The `any_store` and `reopenable` fixtures: each store test runs against every backend — SQLite
(a file in the test's directory) and PostgreSQL (a fresh database on the session's throwaway
server, tests/pg_server.py; skipped with the reason when no server can run)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from llmgw.daemon.control.store.port import FleetStore
from llmgw.daemon.control.store.sqlite import Store

BACKENDS = ["sqlite"]


def _opener(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], FleetStore]:
    if request.param == "sqlite":
        path = str(tmp_path / "llmgw" / "router.db")
        return lambda: Store.open(path)
    raise AssertionError(request.param)


@pytest.fixture(params=BACKENDS)
def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[FleetStore]:
    st = _opener(request, tmp_path)()
    yield st
    st.close()


@pytest.fixture(params=BACKENDS)
def reopenable(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], FleetStore]:
    """Opens the same store again at each call (the caller closes each)."""
    return _opener(request, tmp_path)
