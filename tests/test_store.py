import os
import sqlite3
import stat

import pytest

from llmgw.daemon.control.store.sqlite import SCHEMA_VERSION, AssignmentRow, NodeRow, Store, StoreError
from llmgw.fleet.types import EngineSpec
from tests.store_backends import BACKENDS


def spec(replica: str, model: str = "llama-8b", gen: int = 0) -> dict:
    return EngineSpec(replica=replica, model=model, engine="vllm", model_path="meta/llama-8b", simulate=True,
                      args=("--max-model-len", "8192"), env=(("A", "1"),), gpu_indices=(0, 1),
                      generation=gen).to_wire()


def row(replica: str, node: str = "n1", desired: str = "run", ts: float = 100.0, **kw) -> AssignmentRow:
    return AssignmentRow(replica=replica, model="llama-8b", node=node, spec=spec(replica, **kw), desired=desired,
                         created_at=ts, updated_at=ts)


@pytest.fixture(params=BACKENDS)
def store(request):
    """Every test here runs on SQLite (in memory) and on PostgreSQL (tests/store_backends.py)."""
    if request.param == "sqlite":
        with Store.memory() as s:
            yield s
        return
    from llmgw.daemon.control.store.postgres import PgStore

    with PgStore.open(request.getfixturevalue("pg_url"), timeout_s=10.0) as s:
        yield s


def in_transaction(s) -> bool:
    if isinstance(s, Store):
        return s._conn.in_transaction
    from psycopg.pq import TransactionStatus

    return s._conn.info.transaction_status != TransactionStatus.IDLE


def fill(s: Store) -> None:
    s.put_model("llama-8b", {"engine": "vllm", "replicas": 2}, now=1.0)
    s.upsert_node("n1", agent_labels={"gpu": "a100"}, facts={"cpus": 8, "gpus": [{"index": 0}]}, seen_at=2.0)
    s.set_node_labels("n1", {"zone": "eu"})
    s.put_assignment(row("llama-8b/a"))
    s.record("placed", replica="llama-8b/a", model="llama-8b", node="n1", detail="fits", ts=3.0)


# -- models

def test_model_round_trip_and_upsert_keeps_created_at(store):
    store.put_model("m", {"b": [1, 2], "a": {"x": None}}, now=10.0)
    assert store.model("m") == {"b": [1, 2], "a": {"x": None}}
    store.put_model("m", {"a": 2}, now=20.0)
    assert store.models() == {"m": {"a": 2}}
    created, updated = store._conn.execute("SELECT created_at, updated_at FROM models").fetchone()
    assert (created, updated) == (10.0, 20.0)
    assert store.model("nope") is None
    assert store.delete_model("m") is True
    assert store.delete_model("m") is False
    assert store.models() == {}


def test_spec_json_is_sorted(store):
    store.put_model("m", {"z": 1, "a": 2})
    assert store._conn.execute("SELECT spec FROM models").fetchone()[0] == '{"a":2,"z":1}'


# -- nodes

def test_node_round_trip_keeps_first_seen(store):
    store.upsert_node("n1", agent_labels={"gpu": "a100"}, facts={"cpus": 8}, seen_at=5.0)
    store.upsert_node("n1", agent_labels={"gpu": "h100"}, facts={"cpus": 16}, seen_at=9.0)
    assert store.nodes() == {"n1": NodeRow("n1", {"gpu": "h100"}, {}, {"cpus": 16}, 5.0, 9.0)}
    assert store.delete_node("n1") is True
    assert store.delete_node("n1") is False
    assert store.nodes() == {}


def test_operator_labels_independent_of_agent_labels(store):
    store.set_node_labels("n1", {"zone": "eu", "gpu": "override"})  # before the agent is ever seen
    n = store.nodes()["n1"]
    assert (n.agent_labels, n.operator_labels, n.first_seen, n.last_seen) == ({}, {"zone": "eu", "gpu": "override"},
                                                                            None, None)
    store.upsert_node("n1", agent_labels={"gpu": "a100", "arch": "x86"}, facts={}, seen_at=1.0)
    store.upsert_node("n1", agent_labels={"gpu": "a100"}, facts={}, seen_at=2.0)  # agent drops "arch"
    n = store.nodes()["n1"]
    assert n.agent_labels == {"gpu": "a100"}
    assert n.operator_labels == {"zone": "eu", "gpu": "override"}
    assert n.labels == {"gpu": "override", "zone": "eu"}
    assert (n.first_seen, n.last_seen) == (1.0, 2.0)
    store.set_node_labels("n1", {"rack": "r7"})  # merges
    store.remove_node_labels("n1", ["gpu", "absent"])
    n = store.nodes()["n1"]
    assert n.operator_labels == {"zone": "eu", "rack": "r7"}
    assert n.agent_labels == {"gpu": "a100"}
    store.remove_node_labels("ghost", ["x"])  # no node: nothing to remove, nothing created
    assert "ghost" not in store.nodes()


# -- assignments

def test_assignment_round_trip_and_upsert_keeps_created_at(store):
    store.put_assignment(row("r1", ts=100.0))
    got = store.assignments()["r1"]
    assert got == row("r1", ts=100.0)
    assert got.engine_spec() == EngineSpec.from_wire(spec("r1"))
    moved = row("r1", node="n2", desired="drain", ts=200.0, gen=3)
    store.put_assignment(moved)
    got = store.assignments()["r1"]
    assert (got.node, got.desired, got.spec["generation"], got.created_at, got.updated_at) == ("n2", "drain", 3,
                                                                                               100.0, 200.0)
    store.set_desired("r1", "stop", now=300.0)
    got = store.assignments()["r1"]
    assert (got.desired, got.created_at, got.updated_at) == ("stop", 100.0, 300.0)
    assert store.delete_assignment("r1") is True
    assert store.delete_assignment("r1") is False
    assert store.assignments() == {}


def test_assignment_strictness(store):
    with pytest.raises(ValueError, match="desired"):
        store.put_assignment(row("r1", desired="paused"))
    store.put_assignment(row("r1"))
    with pytest.raises(ValueError, match="desired"):
        store.set_desired("r1", "RUN")
    with pytest.raises(KeyError):
        store.set_desired("nope", "stop")
    with pytest.raises(ValueError, match="replica"):
        store.put_assignment(AssignmentRow("r2", "llama-8b", "n1", spec("other")))
    with pytest.raises(ValueError, match="node"):
        store.put_assignment(AssignmentRow("r2", "llama-8b", "", spec("r2")))
    with pytest.raises(ValueError, match="model"):
        store.put_assignment(AssignmentRow("r2", "other", "n1", spec("r2")))
    assert list(store.assignments()) == ["r1"]


def test_a_candidates_row_is_under_its_routing_key_and_serves_the_model(store):
    """A candidate's replica is routed as NAME#candidate (llmgw.lifecycle) while its engine serves NAME."""
    store.put_assignment(AssignmentRow("llama-8b/c", "llama-8b#candidate", "n1", spec("llama-8b/c")))
    assert store.assignments()["llama-8b/c"].model == "llama-8b#candidate"
    with pytest.raises(ValueError, match="model"):
        store.put_assignment(AssignmentRow("x/c", "other#candidate", "n1", spec("x/c")))


def test_names_are_non_empty_strings(store):
    with pytest.raises(ValueError):
        store.put_model("", {})
    with pytest.raises(TypeError):
        store.put_model(None, {})  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        store.put_model("m", [1])  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        store.upsert_node("", agent_labels={}, facts={}, seen_at=0.0)
    with pytest.raises(TypeError):
        store.set_node_labels("n", {"k": 1})  # type: ignore[dict-item]
    with pytest.raises(ValueError):
        store.set_node_labels("n", {"": "v"})
    with pytest.raises(TypeError):
        store.remove_node_labels("n", "gpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        store.record("")
    with pytest.raises(ValueError):
        store.record("e", node="")
    assert store.models() == {} and store.nodes() == {} and store.history() == []


def test_2000_assignments_in_one_transaction(store):
    commits = []
    if isinstance(store, Store):
        store._conn.set_trace_callback(lambda sql: commits.append(sql) if sql == "COMMIT" else None)
    else:
        x = store._x
        store._x = lambda sql, *a: (commits.append(sql) if sql == "COMMIT" else None, x(sql, *a))[1]
    with store.transaction():
        for i in range(2000):
            store.put_assignment(row(f"m/{i:04d}", node=f"n{i % 7}", ts=float(i)))
        for i in range(0, 2000, 2):
            store.put_assignment(row(f"m/{i:04d}", node="n-new", desired="drain", ts=5000.0))
    assert commits == ["COMMIT"]
    rows = store.assignments()
    assert len(rows) == 2000
    assert list(rows) == sorted(rows)
    for i in range(2000):
        r = rows[f"m/{i:04d}"]
        assert r.created_at == float(i)
        if i % 2 == 0:
            assert (r.node, r.desired, r.updated_at) == ("n-new", "drain", 5000.0)
        else:
            assert (r.node, r.desired, r.updated_at) == (f"n{i % 7}", "run", float(i))


# -- transactions

def test_rollback_on_exception_leaves_nothing(store):
    store.put_model("keep", {"v": 1})
    with pytest.raises(RuntimeError), store.transaction():
        store.put_model("keep", {"v": 2})
        store.put_model("new", {})
        store.upsert_node("n1", agent_labels={}, facts={}, seen_at=1.0)
        for i in range(50):
            store.put_assignment(row(f"r{i}"))
        store.record("placed")
        raise RuntimeError("reconcile failed half-way")
    assert store.models() == {"keep": {"v": 1}}
    assert store.nodes() == {} and store.assignments() == {} and store.history() == []
    assert not in_transaction(store)
    store.put_model("after", {})  # the store is usable afterwards
    assert set(store.models()) == {"keep", "after"}


def test_nested_transactions(store):
    with store.transaction():
        store.put_model("outer", {})
        with store.transaction():
            store.put_model("inner-kept", {})
        try:
            with store.transaction():
                store.put_model("inner-failed", {})
                raise RuntimeError
        except RuntimeError:
            pass  # caught by the caller: the outer transaction goes on without the inner writes
        assert set(store.models()) == {"outer", "inner-kept"}
    assert set(store.models()) == {"outer", "inner-kept"}
    with pytest.raises(RuntimeError), store.transaction():
        with store.transaction():
            store.put_model("gone", {})
        raise RuntimeError
    assert set(store.models()) == {"outer", "inner-kept"}
    assert store._depth == 0 and not in_transaction(store)


def test_failed_method_inside_transaction_keeps_earlier_writes(store):
    with store.transaction():
        store.put_model("m", {})
        with pytest.raises(KeyError):
            store.set_desired("absent", "stop")
    assert store.models() == {"m": {}}


# -- history

def test_history_order_filter_and_prune(store):
    store.record("a", replica="r1", model="m1", node="n1", ts=1.0)
    store.record("b", replica="r2", model="m1", node="n2", ts=3.0)
    store.record("c", replica="r1", model="m2", node="n2", ts=2.0, detail="why")
    store.record("d", model="m1", ts=3.0)  # same instant as "b": recorded later, so newer
    assert [h.event for h in store.history()] == ["d", "b", "c", "a"]
    assert [h.event for h in store.history(limit=2)] == ["d", "b"]
    assert [h.event for h in store.history(replica="r1")] == ["c", "a"]
    assert [h.event for h in store.history(model="m1")] == ["d", "b", "a"]
    assert [h.event for h in store.history(model="m1", node="n2")] == ["b"]
    c = store.history(model="m2")[0]
    assert (c.ts, c.event, c.replica, c.model, c.node, c.detail) == (2.0, "c", "r1", "m2", "n2", "why")
    assert store.history(node="nope") == []
    assert store.prune_history(keep=2) == 2
    assert [h.event for h in store.history()] == ["d", "b"]
    assert store.prune_history(keep=2) == 0
    assert store.prune_history(keep=0) == 2
    assert store.history() == []


def test_history_default_ts_is_now(store):
    store.record("e")
    assert store.history()[0].ts > 1_600_000_000


# -- files

def test_file_store_is_wal_and_persists(tmp_path):
    path = tmp_path / "state" / "sub" / "store.db"
    with Store.open(str(path)) as s:
        assert s._conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert s._conn.execute("PRAGMA foreign_keys").fetchone()[0] == 1
        assert s._conn.execute("PRAGMA busy_timeout").fetchone()[0] == 5000
        assert s._conn.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL
        fill(s)
        want = (s.models(), s.nodes(), s.assignments(), s.history())
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    with Store.open(str(path)) as s:
        assert (s.models(), s.nodes(), s.assignments(), s.history()) == want
        assert want[1]["n1"].operator_labels == {"zone": "eu"}
        assert s._conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0] == str(
            SCHEMA_VERSION)


def test_two_connections_see_each_others_commits(tmp_path):
    path = str(tmp_path / "store.db")
    with Store.open(path) as a, Store.open(path) as b:
        a.put_model("m", {"v": 1})
        assert b.model("m") == {"v": 1}


def test_newer_schema_is_refused(tmp_path):
    path = str(tmp_path / "store.db")
    Store.open(path).close()
    conn = sqlite3.connect(path)
    conn.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION + 1),))
    conn.commit()
    conn.close()
    with pytest.raises(StoreError, match=rf"newer llmgw \(schema {SCHEMA_VERSION + 1} > {SCHEMA_VERSION}\)") as e:
        Store.open(path)
    assert path in str(e.value)


def test_garbage_file_is_refused(tmp_path):
    path = tmp_path / "store.db"
    path.write_bytes(b"this is not a database\n" * 100)
    with pytest.raises(StoreError) as e:
        Store.open(str(path))
    assert str(path) in str(e.value)


def test_foreign_sqlite_file_is_refused(tmp_path):
    path = str(tmp_path / "other.db")
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE users (id INTEGER)")
    conn.commit()
    conn.close()
    with pytest.raises(StoreError, match="not an llmgw store") as e:
        Store.open(path)
    assert path in str(e.value)
