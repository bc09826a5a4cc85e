"""The store boundary (StoreGuard): a store that cannot write degrades the guard instead of raising
into its caller; writes are not attempted meanwhile, history is kept (bounded), operator writes get
StoreUnavailable, and the recovery writes the whole state back. Also: what store errors are called,
and a store that cannot be read is reported as corrupted with what to do."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest

from llmgw.daemon.control.store.sqlite import AssignmentRow, Store, StoreCorrupt, describe
from llmgw.daemon.control.store.faults import FaultInjectingConnection
from llmgw.daemon.control.store.guard import StoreGuard, StoreMetrics, StoreUnavailable
from llmgw.daemon.control.store.state import read_state
from llmgw.tui.rows import status_line
from llmgw.tui.state import ConsoleState


class Faulty:
    """A store on disk whose writes fail while `on` (the daemon's test hook, in-process)."""

    def __init__(self, tmp: Path, message: str = "") -> None:
        self.flag = tmp / "fault"
        self.message = message
        self.store = Store.open(str(tmp / "llmgw" / "router.db"))
        self.store.wrap_connection(lambda conn: FaultInjectingConnection(conn, str(self.flag)))

    def on(self) -> None:
        self.flag.write_text(self.message)

    def off(self) -> None:
        self.flag.unlink()


@pytest.fixture
def faulty(tmp_path: Path) -> Any:
    f = Faulty(tmp_path)
    yield f
    f.store.close()


def test_a_failed_write_degrades_and_nothing_is_attempted_meanwhile(faulty: Faulty) -> None:
    g = StoreGuard(faulty.store, wall=lambda: 100.0)
    assert g.write("put_model", "a", {"v": 1}) is True
    faulty.on()
    assert g.write("put_model", "b", {"v": 2}) is False  # no exception reaches the caller
    assert g.degraded and g.reason == "disk full" and "disk is full" in g.detail
    assert g.errors == {"put_model": 1}
    assert g.write("delete_model", "a") is False  # skipped, not attempted: no second error
    assert g.errors == {"put_model": 1}
    st = g.status()
    assert (st.state, st.reason, st.since_s) == ("degraded", "disk full", 0.0)
    with pytest.raises(StoreUnavailable, match="disk full"):
        g.must_write("put_model", "c", {})
    assert faulty.store.models() == {"a": {"v": 1}}  # reads still work, as on a full disk


def test_history_is_kept_bounded_and_written_back_in_order(faulty: Faulty) -> None:
    clock = iter(range(1, 100))
    g = StoreGuard(faulty.store, max_pending_history=3, wall=lambda: float(next(clock)))
    faulty.on()
    for i in range(5):
        g.record(f"e{i}", model="m")
    assert g.status().pending_history == 3 and g.history_dropped == 2
    assert g.try_recover() is False  # still full
    faulty.off()
    assert g.try_recover() is True and not g.degraded
    events = [h.event for h in reversed(faulty.store.history())]
    assert events == ["e2", "e3", "e4", "history dropped"]
    assert g.status().pending_history == 0 and g.history_dropped == 2  # the count stays: it is a counter


def test_recovery_rewrites_the_whole_state_from_memory(faulty: Faulty) -> None:
    memory: dict[str, Any] = {"models": {"a": {"v": 1}}}

    def rewrite(st: Store) -> None:
        for name in st.models().keys() - memory["models"].keys():
            st.delete_model(name)
        for name, spec in memory["models"].items():
            st.put_model(name, spec)

    g = StoreGuard(faulty.store, rewrite=rewrite)
    g.write("put_model", "a", {"v": 1})
    g.write("put_model", "old", {"v": 0})
    faulty.on()
    memory["models"] = {"a": {"v": 2}, "new": {"v": 3}}
    g.write("put_model", "a", {"v": 2})  # fails: degraded
    faulty.off()
    g.must_write("put_model", "later", {"v": 4})  # an operator's write recovers at once, then is made
    assert faulty.store.models() == {"a": {"v": 2}, "new": {"v": 3}, "later": {"v": 4}}
    assert g.recoveries == 1


def test_a_transaction_with_a_failed_write_rolls_back_and_its_block_still_runs(faulty: Faulty) -> None:
    g = StoreGuard(faulty.store)
    ran = []
    with g.transaction("reconcile"):
        g.write("put_model", "a", {})
        faulty.on()
        g.write("put_model", "b", {})
        ran.append("all of it")
    assert ran == ["all of it"] and g.degraded
    faulty.off()
    assert faulty.store.models() == {}  # the first write was rolled back with the rest
    with g.transaction("reconcile"):  # degraded: the block runs, nothing is written
        g.write("put_model", "c", {})
        ran.append("again")
    assert ran == ["all of it", "again"] and faulty.store.models() == {}


def test_a_failed_begin_still_runs_the_block(tmp_path: Path) -> None:
    class NoBegin:
        def __init__(self, conn: sqlite3.Connection) -> None:
            self.conn = conn

        def execute(self, sql: str, params: Any = ()) -> Any:
            if sql.startswith("BEGIN"):
                raise sqlite3.OperationalError("disk I/O error")
            return self.conn.execute(sql, params)

        in_transaction = property(lambda self: self.conn.in_transaction)

        def close(self) -> None:
            self.conn.close()

    with Store.open(str(tmp_path / "r.db")) as st:
        st.wrap_connection(NoBegin)
        g = StoreGuard(st)
        ran = []
        with g.transaction("reconcile"):
            ran.append(1)
        assert ran == [1] and g.degraded and g.reason == "I/O error"


def test_a_bad_value_is_not_a_store_fault(faulty: Faulty) -> None:
    g = StoreGuard(faulty.store)
    assert g.write("put_model", "", {}) is False  # ValueError: logged and dropped
    assert not g.degraded and g.bugs == 1
    with pytest.raises(ValueError):
        g.must_write("put_model", "", {})


def test_reads_for_answers_raise_store_unavailable(tmp_path: Path) -> None:
    with Store.open(str(tmp_path / "r.db")) as st:
        g = StoreGuard(st)

        def broken(_: Store) -> Any:
            raise sqlite3.DatabaseError("database disk image is malformed")

        with pytest.raises(StoreUnavailable, match="corrupted"):
            g.read("history", broken)
        assert g.errors == {"history": 1}


def test_metrics_and_what_operators_see(faulty: Faulty) -> None:
    g = StoreGuard(faulty.store)
    faulty.on()
    g.write("record", "x")
    fams = {f.name: f for f in StoreMetrics(g).collect()}
    assert [(s.labels, s.value) for s in fams["llmgw_store_errors"].samples if s.name.endswith("_total")] == \
        [({"op": "record"}, 1.0)]
    assert fams["llmgw_store_degraded"].samples[0].value == 1.0
    state = ConsoleState()
    state.apply({"type": "snapshot", "rev": 1, "store": {"state": "degraded", "reason": "disk full"}})
    assert "store: degraded (disk full)" in status_line(state, "unix:/x")
    state.apply({"type": "update", "rev": 2, "store": {"state": "ok"}})
    assert "store" not in status_line(state, "unix:/x")


def test_describe_real_sqlite_errors(tmp_path: Path) -> None:
    path = tmp_path / "r.db"
    with Store.open(str(path)) as st:
        st.put_model("m", {})
    ro = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    with pytest.raises(sqlite3.OperationalError) as err:
        ro.execute("DELETE FROM models")
    ro.close()
    assert describe(err.value) == "read-only"
    assert describe(sqlite3.OperationalError("database or disk is full")) == "disk full"
    assert describe(sqlite3.OperationalError("database is locked")) == "locked"


def _corrupt_pages(path: Path, first_page: int = 2) -> None:
    data = bytearray(path.read_bytes())
    page = 4096
    assert len(data) > page * (first_page + 1), "the store is too small to corrupt a page past the header"
    for i in range(page * first_page, len(data)):
        data[i] = (i * 7 + 13) % 256
    path.write_bytes(bytes(data))


def test_a_damaged_page_is_found_at_open(tmp_path: Path) -> None:
    path = tmp_path / "r.db"
    with Store.open(str(path)) as st:
        for i in range(300):
            st.record("event", detail="x" * 200, ts=float(i))
    _corrupt_pages(path)
    with pytest.raises(StoreCorrupt, match="is corrupted"):
        Store.open(str(path))
    path.write_bytes(b"this is not a database at all" * 200)
    with pytest.raises(StoreCorrupt, match="is corrupted"):
        Store.open(str(path))


def test_a_row_llmgw_cannot_decode_is_corruption(tmp_path: Path) -> None:
    with Store.open(str(tmp_path / "r.db")) as st:
        st.put_assignment(AssignmentRow("m/1", "m", "n", {"replica": "m/1", "model": "m"}))  # no engine etc.
        with pytest.raises(StoreCorrupt, match="assignment m/1"):
            read_state(st)
        st._conn.execute("DELETE FROM assignments")
        st._conn.execute("INSERT INTO models VALUES ('x', 'not json', 0, 0)")
        with pytest.raises(StoreCorrupt, match="models"):
            read_state(st)


def test_the_url_of_an_assignment_round_trips_without_a_schema_change(tmp_path: Path) -> None:
    with Store.open(str(tmp_path / "r.db")) as st:
        st.put_assignment(AssignmentRow("m/1", "m", "n", {"replica": "m/1"}, url="http://127.0.0.1:9"))
        st.put_assignment(AssignmentRow("m/2", "m", "n", {"replica": "m/2"}))
        rows = st.assignments()
        assert rows["m/1"].url == "http://127.0.0.1:9" and rows["m/1"].spec == {"replica": "m/1"}
        assert rows["m/2"].url is None
