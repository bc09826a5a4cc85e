"""A router whose store is gone, damaged or out of date, over real processes: a damaged store
stops it at start with one line saying what to do; a deleted one stops none of the fleet's
engines (they are left running, unrouted, and their node held), and `llmgw daemon --adopt`
makes them its replicas again — rebuilding a model the lost store alone defined."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from .test_fleet_integration import Fleet, fleet_factory, group_alive, sim_model  # noqa: F401 — the fixture
from .test_router_integration import Daemon
from .test_sim_vllm import wait_for


def start_router(f: Fleet, *extra: str) -> None:
    f.router = Daemon(f.router_config(), role="router", log_level="info", extra=extra)


def delete_store(tmp: Path) -> None:
    for suffix in ("", "-wal", "-shm"):  # the lock file stays, as an operator's `rm router.db*` would not
        (tmp / f"router.db{suffix}").unlink(missing_ok=True)


def pids(f: Fleet, model: str) -> dict[str, int]:
    return {r["replica"]: r["pid"] for r in f.ready(model)}


def confirmed(f: Fleet, model: str, n: int) -> bool:
    ready = f.ready(model)
    return len(ready) == n and all(r["pid"] for r in ready)  # reported by the agent, not only probed


def test_a_deleted_store_stops_no_engine_and_adopt_takes_them_back(
        fleet_factory: Any, tmp_path: Path) -> None:  # noqa: F811
    f = fleet_factory([sim_model(count=2)])
    f.start_agent("a")
    api_model = {"name": "api-m", "engine": "vllm",
                 "deploy": {"count": 1, "simulate": True, "health_timeout_s": 20.0, "args": ["--sim-zero-cost"]}}
    assert f.admin.post("/api/v1/models", json=api_model).status_code == 201
    wait_for(lambda: len(f.ready("m")) == 2 and len(f.ready("api-m")) == 1, 30)
    before = {**pids(f, "m"), **pids(f, "api-m")}

    f.stop_router()
    delete_store(tmp_path)
    f.start_router()
    wait_for(lambda: "a router has run with it here" in f.log(f.router), 10)
    status = lambda: f.get("/api/v1/status")  # noqa: E731
    wait_for(lambda: status()["unknown_engines"].get("a") == sorted(before), 20)
    wait_for(lambda: "`llmgw daemon --adopt`" in f.log(f.router), 10)
    # Reconciles go on past the settle time: nothing is placed on the held node, nothing stopped.
    wait_for(lambda: "held" in (status()["unplaceable"].get("m") or ""), 15)
    assert f.replicas() == []
    assert all(group_alive(pid) for pid in before.values())
    assert f.chat("m").status_code == 503  # not routed: this store does not know them
    assert "ctl status" in status()["unplaceable"]["m"]

    f.stop_router()
    start_router(f, "--adopt")
    wait_for(lambda: confirmed(f, "m", 2) and confirmed(f, "api-m", 1), 20)
    assert {**pids(f, "m"), **pids(f, "api-m")} == before  # the same engines: none restarted
    assert f.chat("m").status_code == 200 and f.chat("api-m").status_code == 200
    assert status()["unknown_engines"] == {} and status()["adopt"] is True
    models = {m["name"]: m for m in f.get("/api/v1/models")}
    assert models["api-m"]["source"] == "adopted" and models["api-m"]["desired_replicas"] == 1
    assert models["api-m"]["definition"]["deploy"]["args"] == ["--sim-zero-cost"]
    events = [h["event"] for h in f.get("/api/v1/history?limit=500")]
    assert events.count("replica adopted") == 3

    # Adopted means stored: a plain restart keeps them, as any replica.
    f.stop_router()
    f.start_router()
    wait_for(lambda: confirmed(f, "m", 2) and confirmed(f, "api-m", 1), 20)
    assert {**pids(f, "m"), **pids(f, "api-m")} == before
    assert f.replicas("m")[0]["restarts"] == 0
    assert "Traceback" not in f.log(f.router)


def test_a_replica_the_router_removed_is_still_stopped_after_a_restart(fleet_factory: Any) -> None:  # noqa: F811
    """Only engines the store never knew are kept: one the router wrote off (its node was lost, the
    replica moved) is stopped when its agent returns — a restart in between included (the store's
    history remembers it)."""
    f = fleet_factory([sim_model(count=1)], lost_after=2.0)
    f.start_agent("a")
    f.start_agent("b")
    wait_for(lambda: len(f.ready("m")) == 1, 30)
    victim = f.ready("m")[0]
    node = victim["node"]
    os.killpg(f.agents[node].proc.pid, signal.SIGKILL)  # the agent only: its engine lives on
    f.agents[node].proc.wait(5)
    wait_for(lambda: f.nodes()[node]["state"] == "lost", 15)
    wait_for(lambda: victim["replica"] not in {r["replica"] for r in f.replicas("m")}, 10)
    f.stop_router()
    f.start_router()
    assert group_alive(victim["pid"])
    f.start_agent(node)
    wait_for(lambda: not group_alive(victim["pid"]), 20)
    assert f.get("/api/v1/status")["unknown_engines"] == {}


def _spoil(db: Path) -> None:
    data = bytearray(db.read_bytes())
    for i in range(3 * 4096, len(data)):  # the header and the schema stay: the damage is in the tables
        data[i] = (i * 7 + 13) % 256
    db.write_bytes(bytes(data))


def test_a_corrupted_store_stops_the_router_at_start_with_what_to_do(
        fleet_factory: Any, tmp_path: Path) -> None:  # noqa: F811
    f = fleet_factory([sim_model(count=1)])
    f.start_agent("a")
    wait_for(lambda: len(f.ready("m")) == 1, 30)
    f.stop_router()
    db = tmp_path / "router.db"
    assert db.stat().st_size > 4 * 4096
    _spoil(db)
    for text in ("damaged page", "not a database"):
        if text == "not a database":
            db.write_bytes(b"garbage, not SQLite " * 1000)
        for suffix in ("-wal", "-shm"):
            (tmp_path / f"router.db{suffix}").unlink(missing_ok=True)
        done = subprocess.run([sys.executable, "-m", "llmgw", "daemon", "--role", "router", "--config",
                               str(f.router_config()), "--port", "0"], capture_output=True, text=True, timeout=60)
        assert done.returncode == 1, done.stderr[-2000:]
        assert "Traceback" not in done.stderr, text
        last = done.stderr.strip().splitlines()[-1]
        assert last.startswith(f"llmgw daemon: control.store: store {db} is corrupted ("), last
        assert "move it aside" in last and "--adopt" in last and "backup" in last, last
