"""Several routers on one store (docs/ha.md), at the store: the leader's lease and its epoch, the
fence that refuses a deposed leader's writes (and writes nothing), the generation the followers
poll, first-writer-wins credentials, the routers' rows, the admin queue and the cluster secret —
run against every backend (`any_store`: SQLite, and PostgreSQL when a test server can run)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import trio

from llmgw.daemon.control.store.guard import NotLeader, StoreGuard, StoreUnavailable
from llmgw.daemon.control.store.port import FleetStore
from llmgw.daemon.control.store.rows import AssignmentRow, Fenced


def wait_for(cond: Callable[[], Any], timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (v := cond()):
        assert time.monotonic() < deadline, "condition not met"
        time.sleep(0.005)
    return v


def expire(st: FleetStore) -> None:
    """Wait (on the store's clock) until the lease has run out."""
    wait_for(lambda: (lease := st.lease()) is not None and lease.expires_in_s <= 0)


def test_the_first_router_leads_at_epoch_1_and_renewal_keeps_the_epoch(any_store: FleetStore) -> None:
    st = any_store
    assert st.lease() is None
    first = st.try_lead("a", 5.0)
    assert (first.holder, first.epoch, first.mine) == ("a", 1, True)
    assert 4.0 < first.expires_in_s <= 5.0
    again = st.try_lead("a", 5.0)
    assert (again.holder, again.epoch, again.mine) == ("a", 1, True)
    other = st.try_lead("b", 5.0)  # held and not expired: b does not get it
    assert (other.holder, other.epoch, other.mine) == ("a", 1, False)
    seen = st.lease()
    assert seen is not None and (seen.holder, seen.epoch) == ("a", 1)


def test_a_takeover_after_expiry_bumps_the_epoch(any_store: FleetStore) -> None:
    st = any_store
    st.try_lead("a", 0.05)
    expire(st)
    took = st.try_lead("b", 5.0)
    assert (took.holder, took.epoch, took.mine) == ("b", 2, True)
    late = st.try_lead("a", 5.0)  # the old leader wakes up: it does not get it back
    assert (late.holder, late.epoch, late.mine) == ("b", 2, False)


def test_a_released_lease_is_taken_at_once(any_store: FleetStore) -> None:
    st = any_store
    st.try_lead("a", 30.0)
    st.release_lead("b")  # not the holder: nothing
    assert not st.try_lead("b", 5.0).mine
    st.release_lead("a")
    took = st.try_lead("b", 5.0)
    assert (took.holder, took.epoch, took.mine) == ("b", 2, True)


def test_a_fenced_write_after_a_takeover_raises_fenced_and_writes_nothing(any_store: FleetStore) -> None:
    st = any_store
    lease = st.try_lead("a", 0.05)
    st.set_fence("a", lease.epoch)
    st.put_model("m", {"v": 1})
    expire(st)
    st.try_lead("b", 5.0)
    gen = st.generation()
    with pytest.raises(Fenced) as err:
        st.put_model("m", {"v": 2})
    assert "b leads at epoch 2" in str(err.value)
    with pytest.raises(Fenced):
        with st.transaction():
            st.put_hold("rack=r1", reason="x", drain=False)
    with pytest.raises(Fenced):
        with st.transaction():
            st.record("unfenced, but rolled back with the fenced write after it")
            st.delete_model("m")
    assert st.model("m") == {"v": 1}
    assert st.holds() == {}
    assert st.history() == []
    assert st.generation() == gen
    assert not isinstance(err.value, st.faults)
    # Unfenced writes go on: a deposed leader still heartbeats and takes agents' hellos.
    st.upsert_node("n1", agent_labels={}, facts={}, seen_at=1.0)
    st.record("still recorded")
    assert "n1" in st.nodes()
    # The new leader's fence passes.
    st.set_fence("b", 2)
    st.put_model("m", {"v": 3})
    assert st.model("m") == {"v": 3}
    st.set_fence(None, None)  # no fence: a single router
    st.put_model("m", {"v": 4})


def test_generation_bumps_once_per_outermost_fenced_transaction(any_store: FleetStore) -> None:
    st = any_store
    g0 = st.generation()
    st.put_model("m", {"v": 1})
    assert st.generation() == g0 + 1
    with st.transaction():
        st.put_model("m", {"v": 2})
        st.put_hold("rack=r1", reason="", drain=False)
        with st.transaction():
            st.put_doc("suite", "s", {"toml": ""})
    assert st.generation() == g0 + 2
    for unfenced in (lambda: st.record("e"), lambda: st.upsert_node("n", agent_labels={}, facts={}, seen_at=1.0),
                     lambda: st.register_router("r", {}, started_at=1.0), lambda: st.queue_admin(1, {}),
                     lambda: st.try_lead("r", 5.0), lambda: st.cluster_secret(),
                     lambda: st.put_credential("n", "h", issued_at=1.0)):
        unfenced()
    assert st.generation() == g0 + 2
    with pytest.raises(RuntimeError):
        with st.transaction():
            st.put_model("m", {"v": 3})
            raise RuntimeError("rolled back")
    assert st.generation() == g0 + 2 and st.model("m") == {"v": 2}


def test_credentials_first_writer_wins(any_store: FleetStore) -> None:
    st = any_store
    assert st.put_credential("n1", "h-a", issued_at=1.0, replacing=None) is True
    assert st.put_credential("n1", "h-b", issued_at=2.0, replacing=None) is False  # the second router
    assert st.credentials()["n1"].hash == "h-a"
    assert st.put_credential("n1", "h-c", issued_at=3.0, replacing="h-x") is False  # not the live one
    assert st.put_credential("n1", "h-c", issued_at=3.0, replacing="h-a") is True  # a pending one replaced
    assert st.credentials()["n1"].hash == "h-c"
    assert st.revoke_credential("n1", at=4.0)
    assert st.put_credential("n1", "h-d", issued_at=5.0, replacing=None) is True  # revoked: a new join
    row = st.credentials()["n1"]
    assert (row.hash, row.revoked_at, row.confirmed_at) == ("h-d", None, None)
    assert st.put_credential("n1", "h-e", issued_at=6.0) is True  # the default replaces whatever is there
    assert st.credentials()["n1"].hash == "h-e"


def test_routers_rows(any_store: FleetStore) -> None:
    st = any_store
    st.register_router("r1", {"api": "http://127.0.0.1:1", "pid": 7}, started_at=10.0)
    st.register_router("r2", {"api": "http://127.0.0.1:2"}, started_at=11.0)
    rows = st.routers()
    assert sorted(rows) == ["r1", "r2"]
    assert rows["r1"].info == {"api": "http://127.0.0.1:1", "pid": 7} and rows["r1"].started_at == 10.0
    assert 0 <= rows["r1"].age_s < 5
    before = rows["r2"].seen_at
    wait_for(lambda: st.store_now() > before)
    st.router_seen("r2")
    assert st.routers()["r2"].seen_at > before
    assert st.forget_router("r1") is True and st.forget_router("r1") is False
    assert list(st.routers()) == ["r2"]


def test_admin_queue_round_trip(any_store: FleetStore) -> None:
    st = any_store
    q1 = st.queue_admin(3, {"method": "POST", "path": "/v1/models", "body": {"name": "m"}})
    q2 = st.queue_admin(3, {"method": "DELETE", "path": "/v1/models/x"})
    st.queue_admin(2, {"old": True})  # another epoch's: not for this leader
    assert q2 > q1
    assert st.admin_requests(3, 0) == [(q1, {"method": "POST", "path": "/v1/models", "body": {"name": "m"}}),
                                       (q2, {"method": "DELETE", "path": "/v1/models/x"})]
    assert st.admin_answer(q1) is None
    st.answer_admin(q1, {"status": 200, "body": {"ok": True}})
    assert st.admin_answer(q1) == {"status": 200, "body": {"ok": True}}
    assert [q for q, _ in st.admin_requests(3, 0)] == [q2]
    assert st.admin_requests(3, q2) == []
    assert st.prune_admin(3600.0) == 0
    now = st.store_now()
    wait_for(lambda: st.store_now() > now)
    assert st.prune_admin(0.0) == 3
    assert st.admin_answer(q1) is None
    assert st.queue_admin(3, {}) > q2  # ids are never reused after a prune


def test_the_cluster_secret_is_made_once(any_store: FleetStore) -> None:
    st = any_store
    secret = st.cluster_secret()
    assert isinstance(secret, bytes) and len(secret) == 32
    assert st.cluster_secret() == secret


def test_the_cluster_secret_and_lease_survive_a_reopen(reopenable: Callable[[], FleetStore]) -> None:
    a = reopenable()
    secret = a.cluster_secret()
    a.try_lead("r1", 30.0)
    a.close()
    b = reopenable()
    try:
        assert b.cluster_secret() == secret
        lease = b.lease()
        assert lease is not None and (lease.holder, lease.epoch) == ("r1", 1)
    finally:
        b.close()


def test_two_connections_see_one_lease_and_the_fence(reopenable: Callable[[], FleetStore]) -> None:
    """Two routers on one store: a takeover through one connection fences the other's writes."""
    a, b = reopenable(), reopenable()
    try:
        la = a.try_lead("a", 0.05)
        a.set_fence("a", la.epoch)
        assert not b.try_lead("b", 5.0).mine
        a.put_model("m", {"v": 1})
        expire(b)
        lb = b.try_lead("b", 5.0)
        assert lb.mine and lb.epoch == la.epoch + 1
        b.set_fence("b", lb.epoch)
        g = b.generation()
        with pytest.raises(Fenced):
            a.put_model("m", {"v": 2})
        b.put_model("m", {"v": 3})
        assert a.model("m") == {"v": 3} and a.generation() == g + 1
    finally:
        a.close()
        b.close()


# -- the guard: a fenced write is not a fault ----------------------------------------------------

def _deposed(st: FleetStore) -> None:
    st.try_lead("a", 0.05)
    st.set_fence("a", 1)
    expire(st)
    st.try_lead("b", 5.0)


def test_the_guard_tells_leadership_of_a_fenced_write_and_stays_healthy(any_store: FleetStore) -> None:
    st = any_store
    told: list[Fenced] = []
    guard = StoreGuard(st, on_fenced=told.append)
    _deposed(st)
    assert guard.write("put_model", "m", {"v": 1}) is False
    assert len(told) == 1 and not guard.degraded and guard.errors == {}
    with pytest.raises(NotLeader) as err:
        guard.must_write("put_hold", "rack=r1", reason="", drain=False)
    assert isinstance(err.value, StoreUnavailable) and "no longer the leader" in str(err.value)
    assert len(told) == 2 and not guard.degraded
    # A transaction: the first refusal is told once, the rest of the block is skipped, all rolled back.
    with guard.transaction("reconcile"):
        guard.write("put_model", "m", {"v": 2})
        guard.write("put_assignment", AssignmentRow("m-0", "m", "n1", {}))
        guard.write("put_hold", "rack=r2", reason="", drain=False)
    assert len(told) == 3 and guard.fenced == 3
    assert st.models() == {} and st.assignments() == {} and st.holds() == {}
    guard.record("unfenced history goes on")
    assert [h.event for h in st.history()] == ["unfenced history goes on"]
    assert guard.status().state == "ok"


def test_the_guards_retries_probe_the_store_from_a_worker_thread(any_store: FleetStore) -> None:
    st = any_store
    guard = StoreGuard(st)
    guard._fail("put_model", st.faults[0]("simulated"))
    assert guard.degraded
    import threading

    probes: list[int] = []
    real_ping = st.ping

    def ping() -> None:
        probes.append(threading.get_ident())
        real_ping()

    st.ping = ping  # type: ignore[method-assign]

    async def main() -> None:
        async with trio.open_nursery() as n:
            n.start_soon(guard.run)
            guard.retry_soon()
            with trio.fail_after(10):
                while guard.degraded:
                    await trio.sleep(0.01)
            n.cancel_scope.cancel()

    trio.run(main)
    assert probes and all(t != threading.get_ident() for t in probes)
    assert guard.recoveries == 1


def test_a_takeover_waits_for_the_leaders_open_fenced_transaction(reopenable: Callable[[], FleetStore]) -> None:
    """The fence check and the commit are one: a takeover that comes while the leader's fenced
    transaction is open waits for it, so the leader's write lands under its own epoch, and its
    next one is refused."""
    import threading

    a, b = reopenable(), reopenable()
    try:
        la = a.try_lead("a", 0.2)
        a.set_fence("a", la.epoch)
        taken: list[Any] = []
        with a.transaction():
            a.put_model("m", {"v": 1})  # the fence is checked (and, on PostgreSQL, the leader row locked)
            expire(b)
            t = threading.Thread(target=lambda: taken.append(b.try_lead("b", 5.0)))
            t.start()
            t.join(0.3)
            a.put_model("m", {"v": 2})
        t.join(10)
        assert taken and taken[0].mine and taken[0].epoch == la.epoch + 1
        assert b.model("m") == {"v": 2}
        with pytest.raises(Fenced):
            a.put_model("m", {"v": 3})
    finally:
        a.close()
        b.close()
