"""Multi-node replicas over real processes: a router daemon, four agents in two racks, simulated
engines. A nodes = 2, keep_within = "rack" model comes up with its head and its worker in one rack,
serves through the head only, survives a router restart as the same group, and when the worker's
agent stops, leaves routing and is re-placed whole in the other rack."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from .test_fleet_integration import Fleet, group_alive, sim_model
from .test_sim_vllm import wait_for


@pytest.fixture
def fleet(tmp_path: Path) -> Any:
    f = Fleet(tmp_path, [sim_model(count=1, nodes=2, keep_within="rack")], lost_after=2.0)
    try:
        yield f
    finally:
        f.close()


def parts(f: Fleet) -> dict[str, dict[str, Any]]:
    return {r["replica"]: r for r in f.replicas("m")}


def group(f: Fleet) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(head, worker) when the one group's two parts are ready."""
    ps = parts(f)
    heads = [r for r in ps.values() if not r["replica"].endswith("-w1") and r["desired"] == "run"]
    if len(heads) != 1:
        return None
    w = ps.get(heads[0]["replica"] + "-w1")
    if w is None or heads[0]["state"] != "ready" or w["state"] != "ready":
        return None
    return heads[0], w


def test_a_two_node_replica_runs_in_one_rack_serves_and_is_replaced_whole(fleet: Fleet) -> None:
    f = fleet
    racks = {"a": "r1", "b": "r1", "c": "r2", "d": "r2"}
    for node, rack in racks.items():
        f.start_agent(node, labels={"llmgw.io/rack": rack})
    wait_for(lambda: group(f) is not None and f.get("/api/v1/models")[0]["ready"] == 1, 40)
    got = group(f)
    assert got is not None
    head, worker = got
    assert head["node"] != worker["node"] and racks[head["node"]] == racks[worker["node"]]
    assert f.get("/api/v1/models")[0]["replicas"] == 1  # the group counts once
    wait_for(lambda: f.chat("m").status_code == 200, 10)
    routed = {r["replica"] for r in f.replicas("m") if r["routable"]}
    assert routed == {head["replica"]}  # routing only ever goes to the head

    why = f.get(f"/api/v1/placement/{head['replica']}")["why"]
    assert f"the head of a 2-node replica on {head['node']}, {worker['node']}, all inside one rack" in why, why

    # Restarting the replica restarts its whole group (a worker's id restarts only that worker).
    r = f.admin.post(f"/api/v1/replicas/{head['replica']}/restart")
    assert r.status_code == 202, r.text
    old_pids = {head["pid"], worker["pid"]}

    def restarted() -> bool:
        g = group(f)
        return g is not None and not {g[0]["pid"], g[1]["pid"]} & old_pids and any(x["routable"] for x in g)

    wait_for(restarted, 30)
    head, worker = group(f)  # type: ignore[misc]
    wait_for(lambda: f.chat("m").status_code == 200, 10)

    # A router restart keeps the group: same parts, same processes.
    before = {rid: (r["node"], r["pid"]) for rid, r in parts(f).items()}
    f.stop_router()
    f.start_router()
    wait_for(lambda: group(f) is not None and {rid: (r["node"], r["pid"]) for rid, r in parts(f).items()} == before,
             20)
    wait_for(lambda: f.chat("m").status_code == 200, 10)

    # The worker's agent stops: the head leaves routing at once, and the group is re-placed whole.
    victim = worker["node"]
    f.agents[victim].stop()
    wait_for(lambda: not any(r["routable"] for r in f.replicas("m")), 5)
    wait_for(lambda: f.nodes()[victim]["state"] == "lost", 15)
    old_rack = racks[victim]

    def moved() -> bool:
        g = group(f)
        return g is not None and g[0]["replica"] != head["replica"] and {racks[g[0]["node"]], racks[g[1]["node"]]} \
            == ({"r1", "r2"} - {old_rack}) and set(parts(f)) == {g[0]["replica"], g[1]["replica"]}

    wait_for(moved, 40)
    wait_for(lambda: not group_alive(head["pid"]), 15)  # the old head, on a live node, was stopped too
    wait_for(lambda: f.chat("m").status_code == 200, 10)
    events = [(h["event"], h.get("replica")) for h in f.get("/api/v1/history?limit=500")]
    assert ("group ready", head["replica"]) in events


def test_the_simulated_worker_answers_health_only_and_stops_on_sigterm() -> None:
    import json
    import signal
    import socket
    import subprocess
    import sys

    import httpx

    proc = subprocess.Popen([sys.executable, "-m", "llmgw", "sim", "worker", "--port", "0"], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None
        ready = json.loads(proc.stdout.readline())
        assert ready["ready"] and ready["role"] == "worker"
        url = ready["url"]
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
        assert httpx.get(f"{url}/v1/models", timeout=5).status_code == 404
        with socket.create_connection(("127.0.0.1", ready["port"]), timeout=5) as s:  # an endless head: cut
            s.sendall(b"GET /health HTTP/1.1\r\n" + b"X: " + b"a" * 8275)  # 8300 bytes, all read: no RST
            assert s.recv(4096).startswith(b"HTTP/1.1 400")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


def _rpc_llama_server() -> Path | None:
    """The llama-server scripts/build-llama-server made (LLMGW_LLAMA_SERVER, as scripts/test sets it),
    when its RPC worker ggml-rpc-server is beside it; LLMGW_LLAMA_RPC_SERVER names another build."""
    name = os.environ.get("LLMGW_LLAMA_RPC_SERVER") or os.environ.get("LLMGW_LLAMA_SERVER")
    if not name:
        return None
    binary = Path(name)
    return binary if (binary.parent / "ggml-rpc-server").exists() else None


@pytest.mark.skipif(_rpc_llama_server() is None,
                    reason="no llama-server with its ggml-rpc-server beside it (LLMGW_LLAMA_SERVER: scripts/test "
                           "builds one with scripts/build-llama-server)")
def test_real_llama_cpp_head_and_rpc_worker_end_to_end(tmp_path: Path) -> None:
    """A real llama-server head and ggml-rpc-server worker, started by two agents: the head is told
    its worker and serves. The binaries are scripts/build-llama-server's (or LLMGW_LLAMA_RPC_SERVER's);
    LLMGW_TINY_GGUF: the model (default: tiny.gguf two levels up, as the build script lays it out)."""
    binary = _rpc_llama_server()
    assert binary is not None
    gguf = Path(os.environ.get("LLMGW_TINY_GGUF") or binary.parent.parent / "tiny.gguf")
    if not gguf.exists():
        pytest.skip(f"{gguf} not found")
    model = {"name": "tiny", "engine": "llamacpp",
             "deploy": {"count": 1, "nodes": 2, "keep_within": "rack", "binary": str(binary),
                        "model_path": str(gguf), "args": ["-c", "512", "-np", "1", "-t", "1"],
                        "health_timeout_s": 90.0}}
    f = Fleet(tmp_path, [model])
    try:
        for node in ("a", "b"):
            f.start_agent(node, labels={"llmgw.io/rack": "r1"})
        wait_for(lambda: f.get("/api/v1/models")[0]["ready"] == 1, 120)
        ps = {r["replica"]: r for r in f.replicas("tiny")}
        (worker,) = [r for r in ps.values() if r["replica"].endswith("-w1")]
        assert worker["state"] == "ready" and len(ps) == 2
        r = f.chat("tiny")
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] is not None
    finally:
        f.close()
