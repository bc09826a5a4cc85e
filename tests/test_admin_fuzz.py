"""Fuzz the admin API with schemathesis against the document it serves, over loopback TCP with the
token: no 5xx, every answer as documented (status, content type, headers, schema), invalid input
refused, undeclared methods 405 with Allow, and a missing token refused.

schemathesis drives requests synchronously, so the admin stack runs in its own trio run in a
thread. The event stream is left out: it never ends (test_admin_api reads it). Bounded: a dozen
examples an operation, a short stateful run over the document's links; ~15 s in all."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import trio

schemathesis = pytest.importorskip("schemathesis")
hypothesis = pytest.importorskip("hypothesis")
requests = pytest.importorskip("requests")  # schemathesis brings it

from .admin_support import TOKEN, admin_stack

CONFIG = {
    "auth": {"openapi": {"bearerAuth": {"bearer": TOKEN}}},
    "generation": {"max-examples": 12, "deterministic": True, "mode": "all"},
    # A schema-valid model may still be refused by the server's value checks (strategy and pool
    # names, URLs...), which the document describes but cannot express.
    "checks": {"positive_data_acceptance": {"enabled": False}},
}
SEEN: set[tuple[str, str, int]] = set()  # (operation, method sent, status): what the fuzzer reached


@pytest.fixture(scope="module")
def admin_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp: Path = tmp_path_factory.mktemp("fuzz")
    ready: queue.Queue[Any] = queue.Queue()
    held: dict[str, Any] = {}

    async def main() -> None:
        async with admin_stack(tmp) as s:
            held["token"], held["stop"] = trio.lowlevel.current_trio_token(), trio.Event()
            ready.put(s.tcp_url)
            await held["stop"].wait()

    def run() -> None:
        try:
            trio.run(main)
        except BaseException as e:  # noqa: BLE001 — hand it to the test
            ready.put(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    url = ready.get(timeout=30)
    if isinstance(url, BaseException):
        raise url
    yield url
    trio.from_thread.run_sync(held["stop"].set, trio_token=held["token"])
    thread.join(10)


@pytest.fixture(scope="module")
def admin_schema(admin_url: str) -> Any:
    """The document as the daemon serves it (behind the token)."""
    config = schemathesis.Config.from_dict(CONFIG)
    schema = schemathesis.openapi.from_url(f"{admin_url}/api/v1/openapi.json",
                                           headers={"authorization": f"Bearer {TOKEN}"}, config=config)
    schema.config.update(base_url=admin_url)
    return schema


schema = schemathesis.pytest.from_fixture("admin_schema").exclude(path="/api/v1/events")


@schema.parametrize()
def test_every_operation_answers_as_documented(case: Any) -> None:
    r = case.call_and_validate()
    SEEN.add((case.operation.label, r.request.method, r.status_code))


def test_create_then_use_what_was_created(admin_schema: Any, admin_url: str) -> None:
    """Stateful: follow the document's links (a created model → show, replace, scale, delete it)."""
    auth = {"authorization": f"Bearer {TOKEN}"}

    class Machine(admin_schema.as_state_machine()):  # type: ignore[misc]
        def after_call(self, response: Any, case: Any) -> None:
            SEEN.add((case.operation.label, case.method, response.status_code))

        def teardown(self) -> None:
            # Each scenario starts from the same models, or replaying one (to shrink it) diverges.
            for m in requests.get(f"{admin_url}/api/v1/models", headers=auth, timeout=10).json():
                if m["source"] == "api":
                    requests.delete(f"{admin_url}/api/v1/models/{quote(m['name'], safe='')}", headers=auth,
                                    timeout=10)
            for t in requests.get(f"{admin_url}/api/v1/tenants", headers=auth, timeout=10).json():
                requests.delete(f"{admin_url}/api/v1/tenants/{quote(t['name'], safe='')}", headers=auth, timeout=10)

    Machine.run(settings=hypothesis.settings(max_examples=20, stateful_step_count=6, deadline=None, derandomize=True,
                                             database=None))
    assert ("POST /api/v1/models", "POST", 201) in SEEN


def test_the_fuzzer_reached_the_handlers() -> None:
    """Guards the two tests above against passing vacuously (every request a 401, say)."""
    if not SEEN:
        pytest.skip("run with the fuzzing tests above")
    ok = {op for op, _m, status in SEEN if 200 <= status < 300}
    assert {"GET /api/v1/status", "GET /api/v1/nodes", "PUT /api/v1/nodes/{name}/labels", "GET /api/v1/cache",
            "GET /api/v1/decisions", "POST /api/v1/models", "DELETE /api/v1/models/{name}"} <= ok, sorted(ok)
    assert any(status == 405 for _op, _m, status in SEEN)  # undeclared methods were tried
    assert any(status == 401 for _op, _m, status in SEEN)  # and requests without the token
    assert any(status == 400 for _op, _m, status in SEEN)  # and invalid input
