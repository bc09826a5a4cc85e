"""Autoscaling with several routers on one store (tests/ha_cluster.py: real router processes, on a
shared SQLite file and on PostgreSQL): the leader decides from every router's load, so a request
that waits for a cold start at a follower wakes the model and is served there; the count in force
is the store's, and every router shows it."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from .ha_cluster import Cluster
from .test_fleet_integration import sim_model
from .test_sim_vllm import wait_for


@pytest.fixture(params=["sqlite", "postgresql"])
def cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    store = {"url": request.getfixturevalue("pg_url")} if request.param == "postgresql" else None
    m = sim_model(count=0, args=["--sim-load-seconds", "0.5"])
    m["autoscale"] = {"min": 0, "max": 2, "idle_to_zero_s": 600.0, "cold_start_wait_s": 60.0}
    c = Cluster(tmp_path, [m], routers=2, store=store)
    try:
        yield c
    finally:
        c.close()


def count_in_force(c: Cluster, i: int) -> int:
    text = httpx.get(f"{c.router(i).url}/metrics", timeout=5).text
    m = re.search(r'^llmgw_autoscale_desired_replicas\{model="m"\} (\S+)$', text, re.MULTILINE)
    return int(float(m.group(1))) if m else -1


def test_a_cold_start_asked_at_a_follower_is_served_there(cluster: Cluster) -> None:
    c = cluster
    leader = c.wait_leader()
    follower = 1 - leader
    c.start_agent("a")
    wait_for(lambda: "a" in {n["name"] for n in c.get(leader, "/api/v1/nodes")}, 30)
    assert count_in_force(c, leader) == 0 and not c.ready(leader, "m")
    r = c.chat(follower, "m")  # waits at the follower; its load reaches the leader through the store
    assert r.status_code == 200, r.text
    v = c.get(leader, "/api/v1/models/m/autoscale")
    assert count_in_force(c, leader) == 1, v
    wait_for(lambda: count_in_force(c, follower) == 1, 10)  # the follower reads the count in force
    v = c.get(leader, "/api/v1/models/m/autoscale")
    assert v["cold_starts"] == 1 and v["history"][0]["mode"] == "cold", v
