"""The PostgreSQL store's own behaviour (the shared behaviour is tested on both backends in
test_store.py and test_store_lease.py): a paused or unreachable server costs a call at most
timeout_s and the store comes back after; migrations (a newer schema and a foreign database
refused, two routers starting at once); the DSN's password never shown; describe()."""

from __future__ import annotations

import pytest

psycopg = pytest.importorskip("psycopg", reason="the PostgreSQL store's tests need psycopg (the test extra)")

import threading
import time
from collections.abc import Iterator
from typing import Any

import trio

from llmgw.daemon.control.store.guard import StoreGuard
from llmgw.daemon.control.store.pg_schema import SCHEMA_VERSION
from llmgw.daemon.control.store.postgres import PgStore, StoreTimeout, describe_pg, display_dsn
from llmgw.daemon.control.store.rows import Fenced, StoreError
from tests.pg_server import PgServer, _free_port


@pytest.fixture
def paused(pg_server: PgServer) -> Iterator[PgServer]:
    """The session's server, resumed whatever the test does (pause it with .pause())."""
    try:
        yield pg_server
    finally:
        pg_server.resume()


def test_a_paused_server_costs_a_call_its_timeout_then_the_store_comes_back(pg_url: str, paused: PgServer) -> None:
    st = PgStore.open(pg_url, timeout_s=1.0)
    try:
        st.put_model("m", {"v": 1})
        paused.pause()
        t0 = time.monotonic()
        with pytest.raises(StoreTimeout) as err:
            st.put_model("m", {"v": 2})
        assert time.monotonic() - t0 < 3.0
        assert st.describe(err.value) == "timeout" and isinstance(err.value, st.faults)
        t0 = time.monotonic()
        with pytest.raises(st.faults):  # at once: no reconnect within RECONNECT_EVERY_S of a failure
            st.models()
        assert time.monotonic() - t0 < 0.5
        paused.resume()
        st.ping()  # the probe always tries
        assert st.models() == {"m": {"v": 1}}
    finally:
        st.close()


def test_a_transaction_on_a_paused_server_fails_once_and_leaves_nothing(pg_url: str, paused: PgServer) -> None:
    st = PgStore.open(pg_url, timeout_s=1.0)
    try:
        t0 = time.monotonic()
        with pytest.raises(st.faults):
            with st.transaction():
                st.put_model("a", {})
                paused.pause()
                st.put_model("b", {})
        assert time.monotonic() - t0 < 3.0
        paused.resume()
        st.ping()
        assert st.models() == {} and st._depth == 0
    finally:
        st.close()


def test_the_guard_degrades_on_a_hung_server_and_recovers_through_its_threaded_probe(pg_url: str,
                                                                                     paused: PgServer) -> None:
    st = PgStore.open(pg_url, timeout_s=1.0)
    state = {"m": {"v": 1}}

    def rewrite(s: Any) -> None:
        for name, spec in state.items():
            s.put_model(name, spec)

    guard = StoreGuard(st, rewrite=rewrite)
    try:
        paused.pause()
        assert guard.write("put_model", "m", {"v": 1}) is False
        assert guard.degraded and guard.reason == "timeout"

        async def main() -> None:
            async with trio.open_nursery() as n:
                n.start_soon(guard.run)
                await trio.sleep(0)
                guard.retry_soon()
                # While the server hangs, the trio thread stays free: this loop keeps ticking.
                ticks = 0
                with trio.fail_after(3):
                    while ticks < 20:
                        await trio.sleep(0.05)
                        ticks += 1
                assert guard.degraded
                paused.resume()
                guard.retry_soon()
                with trio.fail_after(30):
                    while guard.degraded:
                        await trio.sleep(0.05)
                n.cancel_scope.cancel()

        trio.run(main)
        assert st.models() == {"m": {"v": 1}} and guard.recoveries == 1
    finally:
        st.close()


def test_an_unreachable_server_is_one_line_naming_it() -> None:
    url = f"postgresql://llmgw:secret-pw@127.0.0.1:{_free_port()}/fleet"
    with pytest.raises(StoreError) as err:
        PgStore.open(url, timeout_s=1.0)
    text = str(err.value)
    assert "\n" not in text and "secret-pw" not in text
    assert text.startswith("store postgresql://llmgw@127.0.0.1:") and "(unreachable)" in text


def test_a_wrong_password_is_auth(pg_server: PgServer, pg_url: str) -> None:
    with pytest.raises(StoreError) as err:
        PgStore.open(pg_url.replace(pg_server.password, "wrong"), timeout_s=5.0)
    assert "(auth)" in str(err.value) and "wrong" not in str(err.value).split("(auth)")[0]


def test_the_password_may_come_apart_from_the_url(pg_server: PgServer, pg_url: str) -> None:
    bare = pg_url.replace(f":{pg_server.password}@", "@")
    with PgStore.open(bare, password=pg_server.password, timeout_s=5.0) as st:
        assert st.path == bare and st.models() == {}


def test_display_dsn_drops_the_password() -> None:
    assert display_dsn("postgresql://u:pw@db.example:5433/fleet?sslmode=require&password=x") == \
        "postgresql://u@db.example:5433/fleet?sslmode=require"
    assert display_dsn("postgresql://db/fleet") == "postgresql://db/fleet"
    shown = display_dsn("host=db dbname=fleet user=u password=pw")
    assert "pw" not in shown and "dbname=fleet" in shown


def test_a_newer_schema_is_refused(pg_url: str) -> None:
    PgStore.open(pg_url).close()
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("UPDATE meta SET value = %s WHERE key = 'schema_version'", (str(SCHEMA_VERSION + 1),))
    with pytest.raises(StoreError) as err:
        PgStore.open(pg_url)
    assert f"newer llmgw (schema {SCHEMA_VERSION + 1} > {SCHEMA_VERSION})" in str(err.value)
    assert "\n" not in str(err.value) and describe_pg(err.value) == "schema newer"


def test_a_database_that_is_not_an_llmgw_store_is_refused(pg_url: str) -> None:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE models (x int)")
    with pytest.raises(StoreError, match="not an llmgw store"):
        PgStore.open(pg_url)


def test_two_routers_starting_at_once_migrate_once(pg_url: str) -> None:
    opened: list[PgStore] = []
    errors: list[BaseException] = []

    def start() -> None:
        try:
            opened.append(PgStore.open(pg_url, timeout_s=10.0))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=start) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert errors == [] and len(opened) == 4
        with psycopg.connect(pg_url) as conn:
            assert conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0] == str(
                SCHEMA_VERSION)
    finally:
        for st in opened:
            st.close()


def test_describe_pg() -> None:
    assert describe_pg(StoreTimeout("x")) == "timeout"
    assert describe_pg(StoreTimeout("x", "unreachable")) == "unreachable"
    assert describe_pg(psycopg.errors.ReadOnlySqlTransaction("cannot execute UPDATE in a read-only transaction")) \
        == "read only"
    assert describe_pg(psycopg.errors.DiskFull("could not extend file")) == "disk full"
    assert describe_pg(psycopg.errors.InvalidPassword("password authentication failed for user x")) == "auth"
    assert describe_pg(psycopg.errors.QueryCanceled("canceling statement due to statement timeout")) == "timeout"
    assert describe_pg(psycopg.OperationalError("connection failed: Connection refused")) == "unreachable"


def test_a_leader_frozen_inside_a_transaction_loses_it_and_its_successor_takes_over(pg_url: str) -> None:
    """A leader stuck between two statements of a fenced transaction (a SIGSTOP, a long pause)
    holds the leader row FOR SHARE; the server ends its session after timeout_s (idle in
    transaction), the successor takes the lease, and the frozen transaction commits nothing."""
    a, b = PgStore.open(pg_url, timeout_s=1.0), PgStore.open(pg_url, timeout_s=1.0)
    try:
        la = a.try_lead("a", 0.5)
        a.set_fence("a", la.epoch)
        with pytest.raises(a.faults):
            with a.transaction():
                a.put_model("m", {"v": 1})
                deadline = time.monotonic() + 30
                while True:  # the row is locked (lock_timeout) until the server ends a's session
                    assert time.monotonic() < deadline
                    try:
                        lease = b.try_lead("b", 5.0)
                    except b.faults as e:
                        assert b.describe(e) == "locked", e
                        continue
                    if lease.mine:
                        break
                assert lease.epoch == la.epoch + 1
                a.put_model("m", {"v": 2})  # the frozen leader wakes up: its session is gone
        assert b.models() == {}
        a.ping()
        with pytest.raises(Fenced):
            a.put_model("m", {"v": 3})
    finally:
        a.close()
        b.close()


def test_a_store_that_goes_away_while_loading_is_not_called_corrupt(pg_url: str, paused: PgServer) -> None:
    from llmgw.daemon.control.store.state import read_state

    st = PgStore.open(pg_url, timeout_s=1.0)
    try:
        paused.pause()
        with pytest.raises(StoreError) as err:
            read_state(st)
        assert "cannot be read (timeout)" in str(err.value) and "corrupt" not in str(err.value)
    finally:
        st.close()


def test_the_store_metrics_time_postgresql_calls_and_count_fenced_writes(pg_url: str) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from llmgw.daemon.control.store.guard import StoreMetrics

    with PgStore.open(pg_url) as st:
        guard = StoreGuard(st)
        reg = CollectorRegistry()
        reg.register(StoreMetrics(guard))
        st.try_lead("a", 30.0)
        st.set_fence("b", 7)
        assert guard.write("put_model", "m", {}) is False
        text = generate_latest(reg).decode()
    assert "llmgw_store_fenced_writes_total 1.0" in text
    count = next(line for line in text.splitlines() if line.startswith("llmgw_store_call_seconds_count"))
    assert float(count.split()[-1]) >= 3  # the migration's, the lease's, the fenced write's
    assert 'llmgw_store_call_seconds_bucket{le="+Inf"}' in text
