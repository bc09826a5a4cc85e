"""Several routers, one fleet (docs/ha.md), over real processes: routers sharing one store elect one
leader with a lease and a fencing epoch, followers follow the store and hand admin changes to the
leader, and a lost or paused leader is replaced within its lease."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .ha_cluster import Cluster
from .test_fleet_integration import sim_model
from .test_sim_vllm import wait_for


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Any]:
    made: list[Cluster] = []

    def make(models: list[dict[str, Any]], **kw: Any) -> Cluster:
        c = Cluster(tmp_path, models, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def _model(c: Cluster, i: int, name: str) -> dict[str, Any] | None:
    r = c.clients[i].get(f"/api/v1/models/{name}")
    return r.json() if r.status_code == 200 else None


def test_one_leader_the_others_follow_and_forward_changes(cluster: Any) -> None:
    c = cluster([sim_model("m", 0)], routers=3)
    lead = c.wait_leader()
    rows = c.get(lead, "/api/v1/routers")
    wait_for(lambda: len([r for r in c.get(lead, "/api/v1/routers")["routers"] if r["role"] != "gone"]) == 3)
    rows = c.get(lead, "/api/v1/routers")
    assert rows["ha"] and rows["epoch"] >= 1
    assert sorted(r["role"] for r in rows["routers"]) == ["follower", "follower", "leader"]
    follower = next(i for i in range(3) if i != lead)
    st = c.status(follower)
    assert st["role"] == "follower" and st["leader"] == rows["leader"] and st["routers"] == 3
    # a change asked of a follower is made by the leader, and every router follows it
    r = c.clients[follower].post("/api/v1/models/m/scale", json={"replicas": 0})
    assert r.status_code == 200, r.text
    body = {"name": "api-made", "engine": "vllm", "deploy": {"count": 0, "simulate": True}}
    r = c.clients[follower].put("/api/v1/models/api-made", json=body)
    assert r.status_code in (200, 201), r.text
    for i in range(3):
        wait_for(lambda i=i: _model(c, i, "api-made") is not None, timeout=10)
    # a bad body is refused by the follower itself, with the field named
    r = c.clients[follower].post("/api/v1/models/m/scale", json={"replicas": -1})
    assert r.status_code == 400 and "replicas" in r.text
    leader_log = "".join(c.router(lead).err)
    assert "forwarded by router" in leader_log


def test_leader_killed_another_leads_within_the_lease(cluster: Any) -> None:
    c = cluster([sim_model("m", 0)], routers=2, lease_s=1.5)
    lead = c.wait_leader()
    epoch = c.status(lead)["epoch"]
    other = 1 - lead
    wait_for(lambda: c.status(other)["leader"] is not None)
    t0 = time.monotonic()
    c.kill(lead)
    assert c.wait_leader(among=[other], timeout=10) == other
    took = time.monotonic() - t0
    assert took < 1.5 * 3, took  # the lease, plus a renewal interval and the poll: never minutes
    assert c.status(other)["epoch"] > epoch
    # changes go on under the new leader
    r = c.clients[other].post("/api/v1/models/m/scale", json={"replicas": 0})
    assert r.status_code == 200, r.text


def test_a_paused_leader_wakes_and_steps_down(cluster: Any) -> None:
    """SIGSTOP the leader for longer than its lease: another router leads; SIGCONT: the old one
    finds it no longer leads (its lease ran out), steps down and follows; nothing of it is written."""
    c = cluster([sim_model("m", 0)], routers=2, lease_s=1.5)
    lead = c.wait_leader()
    other = 1 - lead
    epoch = c.status(lead)["epoch"]
    c.signal(lead, signal.SIGSTOP)
    try:
        assert c.wait_leader(among=[other], timeout=10) == other
        r = c.clients[other].post("/api/v1/models/m/scale", json={"replicas": 0})
        assert r.status_code == 200
    finally:
        c.signal(lead, signal.SIGCONT)
    wait_for(lambda: c.status(lead)["role"] == "follower", timeout=10)
    assert c.leader() == other
    st = c.status(lead)
    assert st["epoch"] > epoch and st["leader"] == c.status(other)["leader"]
    assert "no longer leads" in "".join(c.router(lead).err)


def test_no_leader_means_503_with_the_reason(cluster: Any) -> None:
    c = cluster([sim_model("m", 0)], routers=2, lease_s=1.5)
    lead = c.wait_leader()
    other = 1 - lead
    wait_for(lambda: c.status(other)["leader"] is not None)
    c.signal(lead, signal.SIGSTOP)  # the follower still sees the leader's row for a moment: it queues, times out
    try:
        # once the lease is gone the follower takes the lead itself; before that a change waits or 503s
        r = c.clients[other].post("/api/v1/models/m/scale", json={"replicas": 0})
        assert r.status_code in (200, 503), r.text
        if r.status_code == 503:
            assert "lead" in r.json()["error"]["message"] and r.headers.get("retry-after")
    finally:
        c.signal(lead, signal.SIGCONT)


def _engines(c: Cluster, i: int, model: str) -> dict[str, tuple[int | None, int]]:
    return {r["replica"]: (r["pid"], r["restarts"]) for r in c.get(i, "/api/v1/replicas") if r["model"] == model}


def test_every_router_routes_and_a_killed_leader_costs_no_request(cluster: Any) -> None:
    """Agents stream to every router, so each routes every ready replica; the leader SIGKILLed under
    load: the other router's clients see no failure, it leads within the lease, and it keeps the
    engines as they run (none restarted, none moved) — then acts (a scale) as the leader."""
    c = cluster([sim_model("m", 2)], routers=2, lease_s=1.5)
    lead = c.wait_leader()
    other = 1 - lead
    c.start_agent("n1")
    for i in (0, 1):
        wait_for(lambda i=i: len(c.routed(i, "m")) == 2, timeout=30)
        assert c.chat(i, "m").status_code == 200
    before = _engines(c, other, "m")
    assert len(before) == 2 and all(pid for pid, _ in before.values())
    c.kill(lead)
    statuses = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (c.leader(among=[other]) != other or len(statuses) < 20):
        statuses.append(c.chat(other, "m", f"turn {len(statuses)}").status_code)
    assert c.leader(among=[other]) == other
    assert set(statuses) == {200}, statuses
    assert _engines(c, other, "m") == before  # the same engines: nothing restarted or moved
    r = c.clients[other].post("/api/v1/models/m/scale", json={"replicas": 3})
    assert r.status_code == 200, r.text
    wait_for(lambda: len(c.routed(other, "m")) == 3, timeout=30)
    assert {k: v for k, v in _engines(c, other, "m").items() if k in before} == before
