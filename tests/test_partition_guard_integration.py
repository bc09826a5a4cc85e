"""The partition guard over real processes: node names that hold nothing (ghosts registered with
bare hellos that then disconnect) cannot stop a real node's death from being acted on, and a join
token registers only so many new node names a minute."""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import httpx

from .raw_agent import RawAgent
from .test_fleet_integration import TOKEN, fleet_factory, sim_model  # noqa: F401 — the fixture
from .test_sim_vllm import wait_for


def kill_node(f: Any, node: str) -> None:
    """SIGKILL a node's agent and every engine it launched (the machine died)."""
    d = f.agents[node]
    os.killpg(d.proc.pid, signal.SIGKILL)
    d.proc.wait(5)
    for rec in (f.tmp / f"agent-{node}" / "engines").glob("*.json"):
        pgid = json.loads(rec.read_text()).get("pgid")
        if pgid:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_ghost_nodes_do_not_stop_a_dead_nodes_replica_from_moving(fleet_factory: Any) -> None:  # noqa: F811
    f = fleet_factory([sim_model(count=1)], lost_after=2.0)
    f.start_agent("a")
    f.start_agent("b")
    wait_for(lambda: len(f.ready("m")) == 1, 30)
    wait_for(lambda: {n["state"] for n in f.nodes().values()} == {"ready"} and len(f.nodes()) == 2, 10)
    # anyone with the join token: a few bare hellos, then gone
    for i in range(4):
        ghost = RawAgent(f.control_port, node=f"ghost-{i}", token=TOKEN)
        assert ghost.answer["t"] == "welcome", ghost.answer
        ghost.close()
    wait_for(lambda: all(f.nodes()[f"ghost-{i}"]["state"] != "ready" for i in range(4)), 10)
    victim = f.ready("m")[0]
    dead, healthy = victim["node"], ({"a", "b"} - {victim["node"]}).pop()
    kill_node(f, dead)
    wait_for(lambda: f.nodes()[dead]["state"] == "lost", 20)
    wait_for(lambda: [r["node"] for r in f.ready("m")] == [healthy], 30)
    assert victim["replica"] not in {r["replica"] for r in f.replicas("m")}
    status = f.get("/api/v1/status")
    assert status["partition_suspected"] is False, status
    for _ in range(3):
        r = f.chat("m")
        assert r.status_code == 200, r.text


def test_a_join_token_registers_only_so_many_new_node_names_a_minute(fleet_factory: Any) -> None:  # noqa: F811
    f = fleet_factory([sim_model(count=0)], control={"new_nodes_per_minute": 3})
    answers = []
    for i in range(5):
        raw = RawAgent(f.control_port, node=f"n{i}", token=TOKEN)
        answers.append(raw.answer)
        raw.close()
    assert [a["t"] for a in answers] == ["welcome"] * 3 + ["refused"] * 2, answers
    assert answers[3]["retry"] is True and "new_nodes_per_minute" in answers[3]["reason"], answers[3]
    assert set(f.nodes()) == {"n0", "n1", "n2"}
    # a name the router knows is not a new one: it comes back whatever the budget
    again = RawAgent(f.control_port, node="n1", token=TOKEN)
    try:
        assert again.answer["t"] == "welcome", again.answer
    finally:
        again.close()
    assert f.router is not None
    text = httpx.get(f"{f.router.url}/metrics", timeout=5).text
    assert 'llmgw_agent_hellos_refused_total{reason="join_rate"} 2.0' in text, \
        [x for x in text.splitlines() if "refused" in x]
    wait_for(lambda: "new_nodes_per_minute" in f.log(f.router), 5)
