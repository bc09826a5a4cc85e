"""The control plane's TenantsManager and usage loops (daemon/control/tenants.py, usage_sync.py) over
a real store and a fake router port: the book pushed on each change and a follower's rebuild only
when the documents changed, changes refused whole when the store cannot write, usage flushed and
put back when the store refuses it, budgets' spent figures with the last flush's time, and the
roll-up run by the leader only."""

from __future__ import annotations

import sqlite3
import time
from typing import Any

import pytest
import trio

from llmgw.config import parse_config
from llmgw.daemon.control.store.guard import StoreGuard, StoreUnavailable
from llmgw.daemon.control.store.sqlite import Store
from llmgw.daemon.control.tenants import TenantConflict, TenantsManager, UnknownTenant
from llmgw.daemon.control.usage_sync import period_starts, scope_key, scope_of
from llmgw.tenants.model import TenantError
from llmgw.tenants.usage import UsageRecord


class FakeRouter:
    """The tenant methods of RouterPort, recording what they are given."""

    def __init__(self) -> None:
        self.books: list[Any] = []
        self.usage: list[UsageRecord] = []
        self.shares: list[dict[Any, float]] = []
        self.spent: list[tuple[dict[Any, int], float | None]] = []
        self.demand: dict[tuple[str, str], float] = {}

    def set_tenants(self, book: Any) -> None:
        self.books.append(book)

    def usage_drain(self) -> list[UsageRecord]:
        out, self.usage = self.usage, []
        return out

    def usage_put_back(self, records: list[UsageRecord]) -> None:
        self.usage = [*records, *self.usage]

    def quota_demand(self) -> dict[tuple[str, str], float]:
        return dict(self.demand)

    def set_quota_shares(self, shares: Any) -> None:
        self.shares.append(dict(shares))

    def set_spent(self, spent: Any, *, as_of: float | None = None) -> None:
        self.spent.append((dict(spent), as_of))


class NoAutoscaling:
    """The plane's autoscaler as usage_sync sees it: no autoscaled model, nothing to share."""

    def demand(self) -> dict[str, float]:
        return {}

    def others_read(self, stored: Any, me: str, live: Any) -> None:
        pass


class FakePlane:
    def __init__(self, store: Store, *, api_keys: tuple[str, ...] = (), lead: bool = True) -> None:
        keys = ", ".join(f'"{k}"' for k in api_keys)
        self.cfg = parse_config(f"[server]\napi_keys = [{keys}]\n[tenants]\nusage_flush_s = 1\n")
        self.store = store
        self.guard = StoreGuard(store)
        self.router = FakeRouter()
        self.router_id = "r-me"
        self.leadership: Any = None
        self._lead = lead
        self.clock = [1_767_225_600.0 + 10 * 3600]  # 2026-01-01T10:00Z
        self.tenants = TenantsManager(self, wall=lambda: self.clock[0])
        self.autoscaling = NoAutoscaling()

    def leading(self) -> bool:
        return self._lead


class Broken:
    """A store whose writes fail as a full disk's do (reads work)."""

    def __init__(self, st: Store) -> None:
        self.st = st
        self.broken = False

    def execute(self, sql: str, params: Any = ()) -> Any:
        if self.broken and sql.lstrip().upper().startswith(("INSERT", "UPDATE", "DELETE", "REPLACE", "COMMIT")):
            raise sqlite3.OperationalError("database or disk is full")
        return self.st.execute(sql, params)

    @property
    def in_transaction(self) -> bool:
        return self.st.in_transaction

    def close(self) -> None:
        self.st.close()


@pytest.fixture
def plane() -> FakePlane:
    return FakePlane(Store.memory())


def test_every_change_is_stored_then_pushed_as_a_new_book(plane: FakePlane) -> None:
    m, r = plane.tenants, plane.router
    m.load()
    assert len(r.books) == 1 and r.books[0].open  # no key anywhere: requests need none
    m.create_tenant({"name": "a", "band": "high"})
    secret, k = m.create_key("a", {"name": "ci"})
    assert len(r.books) == 3 and [b.generation for b in r.books] == [1, 2, 3]
    assert not r.books[-1].open and r.books[-1].authenticate(f"Bearer {secret}", plane.clock[0]).tenant.band == "high"
    assert plane.store.docs("tenant")["a"]["band"] == "high" and k.id in plane.store.docs("api_key")
    with pytest.raises(TenantConflict):
        m.create_tenant({"name": "a"})
    with pytest.raises(TenantConflict):
        m.create_tenant({"name": "static"})  # the static keys' tenant
    with pytest.raises(TenantError) as e:
        m.create_tenant({"name": "b", "quota": {"rpm": "many"}})
    assert e.value.field == "quota.rpm"
    with pytest.raises(UnknownTenant):
        m.create_key("nobody", {})
    assert len(r.books) == 3  # refused changes push nothing
    assert m.delete_tenant("a") == [k.id]
    assert plane.store.docs("api_key") == {} and plane.store.docs("tenant") == {} and r.books[-1].open


def test_a_follower_rebuilds_only_when_the_documents_changed(plane: FakePlane) -> None:
    leader = FakePlane(plane.store)
    leader.tenants.load()
    leader.tenants.create_tenant({"name": "a"})
    secret, k = leader.tenants.create_key("a", {})
    docs = {kind: plane.store.docs(kind) for kind in ("tenant", "api_key")}
    plane.tenants.reload(docs)
    plane.tenants.reload(docs)
    assert len(plane.router.books) == 1  # the same documents again: no new book
    plane.tenants.reload(docs)
    leader.tenants.revoke_key(k.id)
    plane.tenants.reload({kind: plane.store.docs(kind) for kind in ("tenant", "api_key")})
    assert len(plane.router.books) == 2
    with pytest.raises(Exception, match="revoked"):
        plane.router.books[-1].authenticate(f"Bearer {secret}", time.time())


def test_a_store_that_cannot_write_refuses_the_change_whole() -> None:
    st = Store.memory()
    plane = FakePlane(st)
    plane.tenants.load()
    plane.tenants.create_tenant({"name": "a"})
    _, k1 = plane.tenants.create_key("a", {})
    broken = Broken(st._conn)
    st.wrap_connection(lambda _c: broken)
    broken.broken = True
    for change in (lambda: plane.tenants.create_tenant({"name": "b"}), lambda: plane.tenants.delete_tenant("a"),
                   lambda: plane.tenants.rotate_key(k1.id), lambda: plane.tenants.revoke_key(k1.id)):
        with pytest.raises(StoreUnavailable):
            change()
    assert set(plane.tenants.tenants) == {"a"} and set(plane.tenants.keys) == {k1.id}
    assert plane.tenants.keys[k1.id].revoked_at is None and len(plane.router.books) == 3
    broken.broken = False
    plane.guard.try_recover()
    assert set(st.docs("api_key")) == {k1.id}


def test_usage_is_flushed_and_put_back_when_the_store_refuses_it() -> None:
    st = Store.memory()
    plane = FakePlane(st)
    sync = plane.tenants.sync
    minute = int(plane.clock[0]) // 60 * 60
    plane.router.usage = [UsageRecord(minute, "a", "k", "m", 1, 10, 0, 5, 0)]
    broken = Broken(st._conn)
    st.wrap_connection(lambda _c: broken)
    broken.broken = True
    start = sync.flushed_as_of
    plane.clock[0] += 10
    assert not trio.run(sync.flush)
    assert plane.router.usage and sync.flushed_as_of == start  # kept for the next flush
    broken.broken = False
    plane.guard.try_recover()
    plane.router.usage.append(UsageRecord(minute, "a", "k", "m", 1, 1, 0, 1, 0))
    plane.clock[0] += 10
    assert trio.run(sync.flush) and plane.router.usage == []
    assert sync.flushed_as_of == plane.clock[0]
    (got,) = st.usage(0)
    assert (got.requests, got.prompt_tokens, got.completion_tokens) == (2, 11, 6)
    trio.run(sync.sync_spent)
    spent, as_of = plane.router.spent[-1]
    assert spent == {("tenant", "a", "day:2026-01-01"): 17, ("tenant", "a", "month:2026-01"): 17,
                     ("key", "k", "day:2026-01-01"): 17, ("key", "k", "month:2026-01"): 17}
    assert as_of == plane.clock[0]


def test_alone_on_its_store_a_router_has_every_limit_whole(plane: FakePlane) -> None:
    trio.run(plane.tenants.sync.sync_shares)
    assert plane.router.shares == [{}]


def test_the_rollup_runs_at_the_leader_once_an_hour() -> None:
    st = Store.memory()
    follower, leader = FakePlane(st, lead=False), FakePlane(st)
    minute = int(leader.clock[0]) // 60 * 60 - 7200
    st.add_usage("r-x", [UsageRecord(minute, "a", "k", "m", 1, 1, 0, 1, 0)])
    trio.run(follower.tenants.sync.rollup)
    assert follower.tenants.sync.rolled == 0
    trio.run(leader.tenants.sync.rollup)
    assert leader.tenants.sync.rolled == 1
    st.add_usage("r-x", [UsageRecord(minute + 7260, "a", "k", "m", 1, 1, 0, 1, 0)])  # 10:01, this hour's
    leader.clock[0] += 600
    trio.run(leader.tenants.sync.rollup)  # within the hour: not again
    assert leader.tenants.sync.rolled == 1
    leader.clock[0] += 3600
    trio.run(leader.tenants.sync.rollup)
    assert leader.tenants.sync.rolled == 2


def test_helpers() -> None:
    assert scope_of(scope_key(("tenant", "a"))) == ("tenant", "a") and scope_of("key:abc") == ("key", "abc")
    assert scope_of("nope") is None and scope_of("model:x") is None
    assert period_starts(1_767_225_600.0 + 40 * 86400 + 5) == (1_767_225_600.0 + 40 * 86400, 1_769_904_000.0)


class FakeLeadership:
    """Leadership's part the loops use: its own store connection, called "in a worker thread"."""

    def __init__(self, store: Store, live: list[str]) -> None:
        self.store = store
        self.live = live

    async def _call(self, fn: Any, *args: Any) -> Any:
        return fn(*args)

    def live_routers(self) -> dict[str, Any]:
        return {rid: object() for rid in self.live}


def test_several_routers_share_each_limit_by_demand() -> None:
    st = Store.memory()
    plane = FakePlane(st)
    plane.leadership = FakeLeadership(st, ["r-me", "r-other", "r-gone"])
    plane.tenants.load()
    plane.tenants.create_tenant({"name": "a", "quota": {"rpm": 100}})
    plane.tenants.create_tenant({"name": "b", "quota": {"tokens_per_day": 100}})  # a budget: not shared
    st.put_demand("r-other", {"tenant:a": 30.0, "bad scope": 1.0})
    plane.router.demand = {("tenant", "a"): 10.0}
    plane.leadership.live = ["r-me", "r-other"]
    trio.run(plane.tenants.sync.sync_shares)
    assert plane.router.shares[-1] == {("tenant", "a"): pytest.approx(0.25)}
    assert st.demands()["r-me"] == {"tenant:a": 10.0}
