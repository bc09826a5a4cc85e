"""A restarted router serves at once: the replicas in its store whose engines still answer are
routed before their agents reconnect (which takes seconds, with the agents' backoff). Over real
processes: a router, and an agent held stopped (SIGSTOP) while the router restarts."""

from __future__ import annotations

import os
import signal
from typing import Any

from .test_fleet_integration import fleet_factory, sim_model  # noqa: F401 — the fixture
from .test_sim_vllm import wait_for


def test_a_restarted_router_serves_before_the_agents_are_back(fleet_factory: Any) -> None:  # noqa: F811
    f = fleet_factory([sim_model(count=2, args=["--sim-zero-cost"])])
    agent = f.start_agent("a", reconnect_min_s=30.0, reconnect_max_s=30.0)  # back after 15-45 s
    wait_for(lambda: len(f.ready("m")) == 2, 30)
    gone, kept = sorted(f.ready("m"), key=lambda r: r["replica"])

    os.kill(agent.proc.pid, signal.SIGSTOP)  # the agent can neither reconnect nor restart an engine
    try:
        f.stop_router()
        os.killpg(gone["pid"], signal.SIGKILL)  # an engine that dies while the router is down
        f.start_router()  # returns at the ready line: the OpenAI listener is up

        r = f.chat("m")
        assert r.status_code == 200, r.text  # the very first request: no 503 while the agent is away
        assert f.nodes()["a"]["state"] == "not_ready"
        routable = {x["replica"]: x for x in f.replicas("m") if x["routable"]}
        assert list(routable) == [kept["replica"]]  # the dead engine's address is not routed
        assert routable[kept["replica"]]["url"] == kept["url"]
        assert "waiting for its agent" in routable[kept["replica"]]["detail"]
        for _ in range(5):
            assert f.chat("m").status_code == 200
    finally:
        os.kill(agent.proc.pid, signal.SIGCONT)
