"""Tenants with several routers on one store (tests/ha_cluster.py: real router processes): a tenant
and key made through a follower (the change handed to the leader) are known to every router, a key
revoked at the leader is revoked at every follower within `[store] poll_s`, and each router's usage
lands in the one store, summed in the usage report of any of them."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llmgw.daemon.control.store.port import FleetStore
from llmgw.daemon.control.store.sqlite import Store
from llmgw.tenants.usage import UsageRecord

from .ha_cluster import Cluster
from .test_sim_vllm import wait_for


@pytest.fixture(params=["sqlite", "postgresql"])
def cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """Two routers on one SQLite file shared on this host, or on a PostgreSQL database (skipped with
    the reason when no test server can run)."""
    store = {"url": request.getfixturevalue("pg_url")} if request.param == "postgresql" else None
    c = Cluster(tmp_path, [], routers=2, store=store)
    try:
        yield c
    finally:
        c.close()


def _open(c: Cluster) -> FleetStore:
    url = c.store.get("url")
    if not url:
        return Store.open(str(c.tmp / "router.db"))
    from llmgw.daemon.control.store.postgres import PgStore  # psycopg: the postgres extra

    return PgStore.open(url)


def _write(c: Cluster, i: int, path: str, body: dict[str, Any] | None = None) -> Any:
    """An admin change through router i. While no router leads (a lease lapsing on a loaded machine)
    the answer is 503 with Retry-After and nothing is changed: the test waits for a leader and sends
    it again, as a client told to retry would."""
    deadline = time.monotonic() + 30
    while True:
        r = c.clients[i].post(path, json=body) if body is not None else c.clients[i].post(path)
        if r.status_code != 503 or time.monotonic() > deadline:
            return r
        c.wait_leader()


def _key(c: Cluster, i: int, kid: str) -> dict[str, Any] | None:
    r = c.clients[i].get(f"/api/v1/keys/{kid}")
    return r.json() if r.status_code == 200 else None


def test_a_key_revoked_at_the_leader_is_revoked_at_every_router(cluster: Cluster) -> None:
    c = cluster
    lead = c.wait_leader()
    follower = 1 - lead
    wait_for(lambda: c.status(follower).get("role") == "follower")
    r = _write(c, follower, "/api/v1/tenants", {"name": "team-a", "quota": {"rpm": 100}})
    assert r.status_code == 201, r.text  # made by the leader, answered through the follower
    r = _write(c, follower, "/api/v1/tenants/team-a/keys", {"name": "ci"})
    assert r.status_code == 201, r.text
    made = r.json()
    assert made["key"].startswith("sk-llmgw-")
    for i in (0, 1):
        wait_for(lambda i=i: (_key(c, i, made["id"]) or {}).get("state") == "active", timeout=10)
    assert made["key"] not in c.clients[follower].get("/api/v1/keys").text

    r = _write(c, lead, f"/api/v1/keys/{made['id']}/revoke")
    assert r.status_code == 200 and r.json()["state"] == "revoked"
    t0 = time.monotonic()
    wait_for(lambda: (_key(c, follower, made["id"]) or {}).get("state") == "revoked", timeout=10)
    assert time.monotonic() - t0 < 5  # poll_s is 0.1 here
    assert [t["keys"] for t in c.get(follower, "/api/v1/tenants")] == [0]


def test_usage_of_every_router_is_in_each_report(cluster: Cluster) -> None:
    c = cluster
    c.wait_leader()
    now = int(time.time()) // 60 * 60
    with _open(c) as st:  # two routers' flushes, as each writes its own
        st.add_usage("router-x", [UsageRecord(now, "t", "k1", "m", 2, 20, 0, 10, 0)])
        st.add_usage("router-y", [UsageRecord(now, "t", "k1", "m", 1, 5, 0, 5, 1)])
    for i in (0, 1):
        rep = c.get(i, "/api/v1/usage?since=1h")
        assert [(g["tenant"], g["requests"], g["errors"], g["total_tokens"]) for g in rep["rows"]] == [
            ("t", 3, 1, 40)]
