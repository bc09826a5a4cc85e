"""Several routers, one fleet (docs/ha.md), over real processes: routers sharing one store elect one
leader with a lease and a fencing epoch, followers follow the store and hand admin changes to the
leader, and a lost or paused leader is replaced within its lease."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from .ha_cluster import Cluster
from .test_fleet_integration import sim_model
from .test_router_integration import free_port
from .test_sim_vllm import wait_for


@pytest.fixture
def cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Any]:
    """`make(models, backend=...)`: "postgresql" (a fresh database on the session's throwaway server;
    skipped with the reason when none can run) or "sqlite" (one file shared on this host)."""
    made: list[Cluster] = []

    def make(models: list[dict[str, Any]], backend: str = "sqlite", **kw: Any) -> Cluster:
        if backend == "postgresql":
            kw["store"] = {"url": request.getfixturevalue("pg_url")}
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
    c = cluster([sim_model("m", 0)], routers=3, backend="postgresql")
    lead = c.wait_leader()
    rows = c.get(lead, "/api/v1/routers")
    wait_for(lambda: len([r for r in c.get(lead, "/api/v1/routers")["routers"] if r["role"] != "gone"]) == 3)
    rows = c.get(lead, "/api/v1/routers")
    assert rows["ha"] and rows["epoch"] >= 1
    assert sorted(r["role"] for r in rows["routers"]) == ["follower", "follower", "leader"]
    follower = next(i for i in range(3) if i != lead)
    wait_for(lambda: c.status(follower)["routers"] == 3)
    st = c.status(follower)
    assert st["role"] == "follower" and st["leader"] == rows["leader"]
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
    c = cluster([sim_model("m", 0)], routers=2, lease_s=1.5, backend="postgresql")
    lead = c.wait_leader()
    other = 1 - lead
    epoch = c.status(lead)["epoch"]
    c.signal(lead, signal.SIGSTOP)
    try:
        assert c.wait_leader(among=[other], timeout=10) == other
        r = c.clients[other].post("/api/v1/models/m/scale", json={"replicas": 0})
        assert r.status_code == 200, r.text
    finally:
        c.signal(lead, signal.SIGCONT)
    # It steps down as soon as it finds its own deadline passed, and learns the new epoch at its
    # next look at the lease (every lease_s / 3): wait for both, not for the first alone.
    wait_for(lambda: (s := c.status(lead))["role"] == "follower" and s["epoch"] > epoch, timeout=10)
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
    c = cluster([sim_model("m", 2)], routers=2, lease_s=1.5, backend="postgresql")
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


def _metric(c: Cluster, i: int, name: str) -> float:
    text = httpx.get(f"{c.router(i).url}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def test_a_conversation_whose_turns_land_on_different_routers_finds_its_replica(cluster: Any) -> None:
    """Engines without KV events: tier 1 is each router's own guess, shared over the routers' feed
    (docs/ha.md "Routing as one"); a next turn sent to the other router goes where the first went."""
    c = cluster([sim_model("m", 3)], routers=2)
    c.start_agent("n1")
    for i in (0, 1):
        wait_for(lambda i=i: len(c.routed(i, "m")) == 3, timeout=30)
    wait_for(lambda: _metric(c, 0, "llmgw_peer_feed_peers") == 1 and _metric(c, 1, "llmgw_peer_feed_peers") == 1)
    for n in range(6):
        first = f"conversation {n}: " + " ".join(f"word{n}-{k}" for k in range(300))
        got = _metric(c, 1, "llmgw_peer_feed_received_total")
        r1 = c.chat(0, "m", first)
        assert r1.status_code == 200
        wait_for(lambda got=got: _metric(c, 1, "llmgw_peer_feed_received_total") > got, timeout=5)
        r2 = c.chat(1, "m", first + " and a next turn")
        assert r2.status_code == 200
        assert r2.headers["x-llmgw-endpoint"] == r1.headers["x-llmgw-endpoint"], n


def test_a_router_no_agent_reaches_gives_up_the_lead(cluster: Any) -> None:
    """Router 0 leads first, but no agent can reach it (no control listener: as if cut off from the
    nodes); router 1 hears the agent. Router 0 gives the lead up within a lease or so and does not
    stand again; router 1 leads and places the model."""
    c = cluster([sim_model("m", 2)], routers=1, deaf=frozenset({0}))
    assert c.wait_leader() == 0
    c.ports.append(free_port())
    c.routers.append(None)
    c.clients.append(httpx.Client(transport=httpx.HTTPTransport(uds=str(c.socket(1))), base_url="http://llmgw",
                                  timeout=10))
    c.start_router(1)
    c.agents["n1"] = c.start_agent("n1", router=f"127.0.0.1:{c.ports[1]}")
    wait_for(lambda: c.leader() == 1, timeout=20)
    wait_for(lambda: len(c.routed(1, "m")) == 2, timeout=30)
    assert c.status(0)["role"] == "follower"
    assert "gives up the lead: it hears no agent while router" in "".join(c.router(0).err)


def test_store_unreachable_routers_route_from_memory_and_resume(cluster: Any, pg_server: Any) -> None:
    """PostgreSQL stops answering (every process of it SIGSTOPped: calls hang, as on a cut network)
    for several leases: both routers keep routing from memory, no router leads (none can renew a
    lease), an admin change answers 503 saying why; once it answers again a router leads, changes
    are made, and no engine was restarted."""
    c = cluster([sim_model("m", 2)], routers=2, lease_s=1.5, backend="postgresql")
    c.wait_leader()
    c.start_agent("n1")
    for i in (0, 1):
        wait_for(lambda i=i: len(c.routed(i, "m")) == 2, timeout=30)
    before = _engines(c, 0, "m")
    pg_server.pause()
    try:
        wait_for(lambda: c.leader() is None and all(c.status(i)["role"] == "follower" for i in (0, 1)), timeout=10)
        t_end = time.monotonic() + 6.0  # four leases without a store
        n = 0
        while time.monotonic() < t_end:
            for i in (0, 1):
                r = c.chat(i, "m", f"while the store is away {n}")
                assert r.status_code == 200, r.text
                n += 1
        r = c.clients[0].post("/api/v1/models/m/scale", json={"replicas": 3})
        assert r.status_code == 503, r.text
        msg = r.json()["error"]["message"]
        assert "lead" in msg or "store" in msg, msg
        assert r.headers.get("retry-after")
    finally:
        pg_server.resume()
    lead = c.wait_leader(timeout=20)
    # the store is back: a change goes through once the routers' connections are (a 503 until then
    # says so, with Retry-After, as a client would retry)
    answers: list[int] = []
    wait_for(lambda: answers.append(c.clients[1 - lead].post("/api/v1/models/m/scale", json={"replicas": 3})
                                    .status_code) or answers[-1] == 200, timeout=20)
    assert set(answers) <= {200, 503}, answers
    wait_for(lambda: len(c.routed(lead, "m")) == 3, timeout=30)
    assert {k: v for k, v in _engines(c, lead, "m").items() if k in before} == before


def test_an_agent_whose_first_router_is_down_joins_through_another(cluster: Any) -> None:
    """`[agent] routers`: more routers of the fleet to dial from the start — the first is down, the
    agent joins (with the join token) at the second, and its engines are placed and routed."""
    c = cluster([sim_model("m", 1)], routers=2)
    c.wait_leader()
    c.kill(0)
    wait_for(lambda: c.leader(among=[1]) == 1, timeout=20)
    c.start_agent("n1", routers=[f"127.0.0.1:{c.ports[1]}"])
    wait_for(lambda: len(c.routed(1, "m")) == 1, timeout=30)
    assert c.chat(1, "m").status_code == 200


def test_an_update_job_in_flight_resumes_under_the_new_leader(cluster: Any) -> None:
    """An update's candidate is starting (it loads for seconds) when the leader is SIGKILLed: the new
    leader resumes the job from the store, and the job succeeds with the candidate ready."""
    c = cluster([], routers=2, lease_s=1.5, backend="postgresql")
    lead = c.wait_leader()
    other = 1 - lead
    c.start_agent("n1")
    body = {"name": "m", "engine": "vllm", "deploy": {"count": 1, "simulate": True, "health_timeout_s": 30.0,
                                                      "args": ["--sim-decode-ms-per-token", "1"]}}
    assert c.clients[lead].post("/api/v1/models", json=body).status_code == 201
    wait_for(lambda: len(c.routed(other, "m")) == 1, timeout=30)
    up = c.clients[other].post("/api/v1/models/m/update", json={"deploy": {"args": [
        "--sim-decode-ms-per-token", "1", "--sim-load-seconds", "4"]}})
    assert up.status_code == 202, up.text
    jid = up.json()["id"]
    c.kill(lead)
    wait_for(lambda: c.leader(among=[other]) == other, timeout=20)
    wait_for(lambda: c.get(other, f"/api/v1/jobs/{jid}")["state"] != "running", timeout=60)
    done = c.get(other, f"/api/v1/jobs/{jid}")
    assert done["state"] == "succeeded", done
    rev = c.get(other, "/api/v1/models/m/revisions")
    assert rev["candidate"]["id"] == "r2" and rev["candidate"]["ready"] == 1


def test_a_node_revoked_at_the_leader_is_cut_off_at_every_router(cluster: Any) -> None:
    """A node joined (its credential issued by one router) is known to the other routers, which it
    streams to; revoked through a follower (the leader makes the change), its streams to every
    router are closed and its replicas leave routing everywhere."""
    c = cluster([sim_model("m", 1)], routers=2)
    lead = c.wait_leader()
    other = 1 - lead
    c.start_agent("n1")
    for i in (0, 1):
        wait_for(lambda i=i: len(c.routed(i, "m")) == 1, timeout=30)
    r = c.clients[other].post("/api/v1/nodes/n1/revoke")
    assert r.status_code == 200, r.text
    for i in (0, 1):
        wait_for(lambda i=i: c.routed(i, "m") == [], timeout=15)
    # the follower cut the node's stream itself (the leader made the change), and refuses it since
    wait_for(lambda: "revoked at another router" in "".join(c.router(other).err), timeout=10)
