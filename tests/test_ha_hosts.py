"""Several routers on separate hosts (docs/ha.md "Tested"): two routers, PostgreSQL and an agent
each in a network namespace of their own (tests/netns.py), joined by veth pairs to a bridge — so
every address is a real one beyond loopback: the control streams run TLS (each router its own CA,
the agent pins the first from `join-info` and the other's from the welcome), the routers' feed,
their rows in the store and the engines' addresses are the hosts' own. A host is cut off by
setting its bridge port down. Root only (skipped with the reason otherwise)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from . import netns
from .ha_cluster import Cluster
from .pg_server import PgServer, PgUnavailable
from .test_fleet_integration import sim_model
from .test_sim_vllm import wait_for

HOSTS = ["router-a", "router-b", "node-1", "db"]
ROUTER_HOSTS = ["router-a", "router-b"]
LEASE = 1.5


@pytest.fixture(scope="module")
def net() -> Iterator[tuple[netns.Hosts, PgServer]]:
    why = netns.unavailable()
    if why:
        pytest.skip(f"routers on separate hosts: {why}")
    hosts = netns.Hosts(HOSTS)
    pg: PgServer | None = None
    try:
        pg = PgServer(listen=hosts.addr["db"], hba=(f"{hosts.subnet}.0/24",), enter=lambda: hosts.enter("db"))
        try:
            pg.start()
        except PgUnavailable as e:
            pytest.skip(f"no test PostgreSQL: {e}")
        yield hosts, pg
    finally:
        if pg is not None:
            pg.cleanup()
        hosts.close()


class HostCluster(Cluster):
    def __init__(self, tmp: Path, hosts: netns.Hosts, models: list[dict[str, Any]], url: str) -> None:
        self.net = hosts
        super().__init__(tmp, models, routers=2, store={"url": url}, lease_s=LEASE,
                         hosts=[hosts.addr[h] for h in ROUTER_HOSTS],
                         prefix=[hosts.prefix(h) for h in ROUTER_HOSTS])

    def start_router(self, i: int) -> Any:
        """Router-a leads first (started alone until it leads): the agent joins there, so the router
        cut off below is both the leader and the agent's configured router — the harder case."""
        d = super().start_router(i)
        if i == 0:
            wait_for(lambda: self.leader(among=[0]) == 0, timeout=30)
        return d

    def start_node(self) -> None:
        """The agent on node-1: it dials router-a, pinning router-a's CA as `join-info` gives it."""
        ji = self.get(0, "/api/v1/join-info")
        assert ji["tls"] and ji["ca_pem"] and ji["router"] == f"{self.hosts[0]}:{self.ports[0]}", ji
        self.start_agent("node-1", prefix=self.net.prefix("node-1"), advertise_host=self.net.addr["node-1"],
                         tls_ca_pem=ji["ca_pem"], tls_server_name=ji["server_name"])


_numbers = iter(range(1, 1_000_000))


@pytest.fixture
def hosts_cluster(net: tuple[netns.Hosts, PgServer], tmp_path: Path) -> Iterator[Any]:
    hosts, pg = net
    made: list[Cluster] = []
    name = f"hosts{next(_numbers)}"

    def make(models: list[dict[str, Any]]) -> HostCluster:
        c = HostCluster(tmp_path, hosts, models, pg.create_database(name))
        made.append(c)
        return c

    try:
        yield make
    finally:
        for h in HOSTS:  # a test that failed with a cable pulled leaves none pulled
            hosts.mend(h)
        for c in made:
            c.close()
        for h in HOSTS:  # what a failed start left behind (by PID, in these namespaces only)
            if h != "db":
                hosts.kill_all(h)
        try:
            pg.drop_database(name)
        except Exception:  # noqa: BLE001 — the module's cleanup removes the server anyway
            pass


def _engines(c: Cluster, i: int, model: str) -> dict[str, tuple[int | None, int]]:
    return {r["replica"]: (r["pid"], r["restarts"]) for r in c.get(i, "/api/v1/replicas") if r["model"] == model}


def _metric(c: Cluster, i: int, name: str) -> float:
    text = httpx.get(f"{c.router(i).url}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def _hears(c: Cluster, i: int) -> int:
    """How many agents router i hears (its own row in the routers table)."""
    return next(int(r["agents"] or 0) for r in c.get(i, "/api/v1/routers")["routers"] if r["this"])


def _serving(c: HostCluster, count: int) -> int:
    """A leader, the agent on node-1 streaming to both routers (to router-b with the address and CA
    router-a's welcome gave it), and `count` replicas routed by both."""
    lead = c.wait_leader(timeout=30)
    c.start_node()
    for i in (0, 1):
        wait_for(lambda i=i: _hears(c, i) == 1 and len(c.routed(i, "m")) == count, timeout=40)
    return lead


def test_routers_on_separate_hosts_both_serve(hosts_cluster: Any) -> None:
    """Both routers answer clients (the test, from the root namespace, through the bridge) with the
    agent's engines on node-1; one leads; every address in the store is a host's own; each router
    has its own CA and the agent streams to both; tier 1 is shared over the feed between hosts."""
    c = hosts_cluster([sim_model("m", 2)])
    lead = _serving(c, 2)
    node = c.net.addr["node-1"]
    for i in (0, 1):
        for n in range(3):
            r = c.chat(i, "m", f"hello {n}")
            assert r.status_code == 200, r.text
        assert c.router(i).url.startswith(f"http://{c.hosts[i]}:")
        assert all(e["url"].startswith(f"http://{node}:") for e in c.get(i, "/api/v1/endpoints") if e["model"] == "m")
    wait_for(lambda: len([r for r in c.get(lead, "/api/v1/routers")["routers"] if r["role"] != "gone"]) == 2)
    rows = {r["control"]: r for r in c.get(lead, "/api/v1/routers")["routers"] if r["role"] != "gone"}
    assert set(rows) == {f"{c.hosts[i]}:{c.ports[i]}" for i in (0, 1)}, rows
    assert sorted(r["role"] for r in rows.values()) == ["follower", "leader"]
    assert c.leader() == lead
    # each router made its own CA (its own host), and the agent holds a stream to both
    assert c.get(0, "/api/v1/join-info")["ca_sha256"] != c.get(1, "/api/v1/join-info")["ca_sha256"]
    # routing as one over the hosts' addresses: router-a's decision reaches router-b over the feed,
    # and the conversation's next turn, sent to router-b, lands where the first went
    wait_for(lambda: _metric(c, 0, "llmgw_peer_feed_peers") == 1 and _metric(c, 1, "llmgw_peer_feed_peers") == 1)
    for n in range(3):
        first = f"conversation {n}: " + " ".join(f"word{n}-{k}" for k in range(300))
        got = _metric(c, 1, "llmgw_peer_feed_received_total")
        r1 = c.chat(0, "m", first)
        assert r1.status_code == 200
        wait_for(lambda got=got: _metric(c, 1, "llmgw_peer_feed_received_total") > got, timeout=5)
        r2 = c.chat(1, "m", first + " and a next turn")
        assert r2.status_code == 200
        assert r2.headers["x-llmgw-endpoint"] == r1.headers["x-llmgw-endpoint"], n


def test_a_router_cut_off_from_agents_and_store_loses_the_lead_and_follows_again(hosts_cluster: Any) -> None:
    """The leader's cable pulled: it reaches neither the agent nor the store. The other router leads
    within the lease and keeps serving; the cut-off one stops leading (it cannot renew its lease);
    cable back, it follows the new leader and routes again; no engine was restarted."""
    c = hosts_cluster([sim_model("m", 2)])
    lead = _serving(c, 2)
    other = 1 - lead
    wait_for(lambda: c.status(other)["leader"] is not None)
    before = _engines(c, other, "m")
    epoch = c.status(lead)["epoch"]
    c.net.cut(ROUTER_HOSTS[lead])
    t0 = time.monotonic()
    try:
        assert c.wait_leader(among=[other], timeout=10) == other
        took = time.monotonic() - t0
        assert took < LEASE * 3, took
        wait_for(lambda: c.status(lead)["role"] != "leader", timeout=LEASE * 3)  # through its admin socket
        for n in range(10):
            r = c.chat(other, "m", f"while router {lead} is cut off {n}")
            assert r.status_code == 200, r.text
        assert c.status(other)["epoch"] > epoch
    finally:
        c.net.mend(ROUTER_HOSTS[lead])
    new = c.status(other)
    wait_for(lambda: (s := c.status(lead))["role"] == "follower" and s["leader"] == new["leader"], timeout=20)
    try:  # the agent's stream to it is back (with the credential it holds: both routers know it)
        wait_for(lambda: _hears(c, lead) == 1, timeout=20)
    except AssertionError:
        refused = [line for line in c.agents["node-1"].err if "refused this agent" in line]
        raise AssertionError(f"the agent did not stream to router {lead} again: {refused[-1:]}") from None
    wait_for(lambda: len(c.routed(lead, "m")) == 2, timeout=30)
    assert c.chat(lead, "m", "back").status_code == 200
    assert c.leader() == other
    assert _engines(c, other, "m") == before  # the same engines: nothing restarted or moved


def test_the_store_cut_off_routers_route_from_memory_and_resume(hosts_cluster: Any) -> None:
    """The db host's cable pulled for several leases: both routers keep routing from memory, no
    router leads, an admin change answers 503 with the reason; cable back: a router leads again
    and changes go through; no engine was restarted."""
    c = hosts_cluster([sim_model("m", 2)])
    _serving(c, 2)
    before = _engines(c, 0, "m")
    c.net.cut("db")
    try:
        wait_for(lambda: all(c.status(i)["role"] == "follower" for i in (0, 1)), timeout=LEASE * 3)
        t_end = time.monotonic() + 3 * LEASE  # the window observed, not a synchronisation
        n = 0
        while time.monotonic() < t_end:
            for i in (0, 1):
                r = c.chat(i, "m", f"while the store is away {n}")
                assert r.status_code == 200, r.text
                assert c.status(i)["role"] == "follower"
                n += 1
        for i in (0, 1):
            r = c.clients[i].post("/api/v1/models/m/scale", json={"replicas": 3})
            assert r.status_code == 503, r.text
            msg = r.json()["error"]["message"]
            assert "lead" in msg or "store" in msg, msg
            assert r.headers.get("retry-after")
    finally:
        c.net.mend("db")
    lead = c.wait_leader(timeout=20)
    answers: list[int] = []
    wait_for(lambda: answers.append(c.clients[1 - lead].post("/api/v1/models/m/scale", json={"replicas": 3})
                                    .status_code) or answers[-1] == 200, timeout=20)
    assert set(answers) <= {200, 503}, answers
    wait_for(lambda: len(c.routed(lead, "m")) == 3, timeout=30)
    assert {k: v for k, v in _engines(c, lead, "m").items() if k in before} == before


def test_a_router_on_every_interface_advertises_its_host_name(net: tuple[netns.Hosts, PgServer],
                                                               tmp_path: Path) -> None:
    """`[server] host` and `[control] listen` on a wildcard address (docs/ha.md's example): its row
    in the store names this host (its name, as the control address does), never 0.0.0.0, which
    another host cannot dial."""
    hosts, pg = net
    name = f"hosts{next(_numbers)}"
    url = pg.create_database(name)
    c: Cluster | None = None
    try:
        c = Cluster(tmp_path, [], routers=1, store={"url": url}, lease_s=LEASE, hosts=["0.0.0.0"],
                    prefix=[hosts.prefix("router-a")], ha={"feed_advertise": hosts.addr["router-a"]})
        c.wait_leader(timeout=30)
        row = next(r for r in c.get(0, "/api/v1/routers")["routers"] if r["this"])
        me = socket.gethostname()
        assert row["control"] == f"{me}:{c.ports[0]}", row
        assert row["url"] == f"http://{me}:{c.router(0).info['port']}", row
        assert row["feed"].startswith(f"{hosts.addr['router-a']}:"), row
    finally:
        if c is not None:
            c.close()
        hosts.kill_all("router-a")
        pg.drop_database(name)


def test_advertised_url_names_a_dialable_address() -> None:
    from llmgw.daemon.main import _advertised_url

    me = socket.gethostname()
    assert _advertised_url("127.0.0.1", 8000) == "http://127.0.0.1:8000"
    assert _advertised_url("::1", 8000) == "http://[::1]:8000"
    assert _advertised_url("10.0.0.5", 8000) == "http://10.0.0.5:8000"
    assert _advertised_url("fd00::5", 8000) == "http://[fd00::5]:8000"
    assert _advertised_url("0.0.0.0", 8000) == f"http://{me}:8000"
    assert _advertised_url("::", 8000) == (f"http://[{me}]:8000" if ":" in me else f"http://{me}:8000")
