"""Facility-aware placement over real processes: a router daemon, agents labelled with racks and
PDUs, simulated engines. A hold with drain moves replicas without a failed request under load; a
power budget refuses the replica that would exceed it and explain-placement says so; a rack that
joins late gets its share by rebalancing."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from .test_fleet_integration import Fleet, sim_model, table
from .test_sim_vllm import wait_for

H100 = {"name": "NVIDIA H100 80GB HBM3", "memory_mb": 81559}  # 70 W idle, 700 W under load (llmgw.fleet.power)


class FacilityFleet(Fleet):
    def __init__(self, tmp: Path, models: list[dict[str, Any]], facility: dict[str, Any], **kw: Any) -> None:
        self.facility = facility
        super().__init__(tmp, models, **kw)

    def router_config(self) -> Path:
        path = super().router_config()
        budgets = self.facility.get("budgets", {})
        rest = {k: v for k, v in self.facility.items() if k != "budgets"}
        lines = table("facility", rest) + ["[facility.budgets]"] + [f'"{k}" = {v}' for k, v in budgets.items()]
        path.write_text(path.read_text() + "\n".join(lines) + "\n")
        return path

    def rack_of(self, node: str) -> str:
        return self.nodes()[node]["labels"].get("llmgw.io/rack", "")

    def racks(self, model: str) -> Counter[str]:
        return Counter(self.rack_of(r["node"]) for r in self.ready(model))


@pytest.fixture
def make_fleet(tmp_path: Path) -> Any:
    made: list[Fleet] = []

    def make(models: list[dict[str, Any]], facility: dict[str, Any] | None = None, **kw: Any) -> FacilityFleet:
        f = FacilityFleet(tmp_path, models, facility or {}, **kw)
        made.append(f)
        return f

    yield make
    for f in made:
        f.close()


class Load:
    """Chat requests one after another in a thread, bounded in count and time; counts failures."""

    def __init__(self, f: Fleet, model: str, most: int = 5000, limit_s: float = 90.0) -> None:
        self.f, self.model, self.most, self.limit_s = f, model, most, limit_s
        self.ok = 0
        self.failed: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        end = time.monotonic() + self.limit_s
        while not self.stop.is_set() and self.ok + len(self.failed) < self.most and time.monotonic() < end:
            try:
                r = self.f.chat(self.model)
                if r.status_code == 200:
                    self.ok += 1
                else:
                    self.failed.append(f"{r.status_code}: {r.text[:200]}")
            except httpx.HTTPError as e:
                self.failed.append(repr(e))

    def finish(self) -> None:
        self.stop.set()
        self.thread.join(30)


def ctl(f: Fleet, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "llmgw", "ctl", "--socket", str(f.tmp / "admin" / "admin.sock"),
                           *args], check=False, capture_output=True, text=True, timeout=30)


def test_a_hold_with_drain_moves_replicas_without_a_failed_request(make_fleet: Any) -> None:
    f = make_fleet([sim_model(count=2)])
    for node, rack in (("a", "r1"), ("b", "r1"), ("c", "r2"), ("d", "r2")):
        f.start_agent(node, labels={"llmgw.io/rack": rack, "llmgw.io/pdu": f"p-{node}"})
    wait_for(lambda: len(f.ready("m")) == 2, 30)
    assert f.racks("m") == {"r1": 1, "r2": 1}  # spread over the racks
    load = Load(f, "m")
    try:
        wait_for(lambda: load.ok >= 5, 20)
        out = ctl(f, "facility", "hold", "rack=r1", "--drain", "--reason", "PDU swap")
        assert out.returncode == 0, out.stderr
        assert "held (drain): PDU swap" in out.stdout
        lowest = [2]

        def moved() -> bool:
            lowest[0] = min(lowest[0], len(f.ready("m")))
            return f.racks("m") == {"r2": 2} and all(f.rack_of(r["node"]) == "r2" for r in f.replicas("m"))

        wait_for(moved, 40)
        assert lowest[0] >= 2  # surge, then drain: the ready count never dipped
        seen = load.ok
        wait_for(lambda: load.ok >= seen + 5, 20)  # still serving after the move
    finally:
        load.finish()
    assert not load.failed, load.failed[:5]
    facility = f.get("/api/v1/facility")
    assert [(h["domain"], h["drain"], h["reason"], h["replicas"]) for h in facility["holds"]] == \
        [("rack=r1", True, "PDU swap", 0)]
    assert f.nodes()["a"]["held"] == ["rack=r1"]
    # an unknown domain is refused, naming the known ones; the store is unchanged
    out = ctl(f, "facility", "hold", "rack=r9")
    assert out.returncode == 1 and "no node is in domain rack=r9; known: rack=r1, rack=r2" in out.stderr
    # the hold survives a router restart (kept in the store) and is released
    f.stop_router()
    f.start_router()
    wait_for(lambda: _ok(f, "/api/v1/facility"), 20)
    assert [h["domain"] for h in f.get("/api/v1/facility")["holds"]] == ["rack=r1"]
    assert ctl(f, "facility", "release", "rack=r1").returncode == 0
    assert f.get("/api/v1/facility")["holds"] == []


def _ok(f: Fleet, path: str) -> bool:
    try:
        return f.admin.get(path).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_budget_refuses_the_replica_that_would_exceed_it_and_explain_says_so(make_fleet: Any) -> None:
    # two nodes of two H100s on one PDU: 4 × 70 W idle; a 1-GPU replica adds 630 W; room for one
    f = make_fleet([sim_model(count=2, gpus=1)], facility={"budgets": {"pdu=p1": 1000}})
    for node in ("a", "b"):
        f.start_agent(node, labels={"llmgw.io/rack": f"r-{node}", "llmgw.io/pdu": "p1"}, gpus=[H100, H100])
    wait_for(lambda: len(f.ready("m")) == 1, 30)
    wait_for(lambda: "power budget" in f.get("/api/v1/status")["unplaceable"].get("m", ""), 20)
    e = f.get("/api/v1/placement/m")
    assert e["node"] is None and e["counts"] == {"power": 2}
    assert {c["detail"] for c in e["candidates"]} == {"pdu=p1 would draw 1540 W of its 1000 W budget"}
    placed = f.ready("m")[0]
    e = f.get(f"/api/v1/placement/{placed['replica']}")
    assert e["node"] == placed["node"] and e["why"].startswith(f"placed on {placed['node']}")
    out = ctl(f, "explain-placement", "m")
    assert out.returncode == 0 and "power" in out.stdout and "1000 W budget" in out.stdout
    pdu = next(d for d in f.get("/api/v1/facility")["domains"] if d["domain"] == "pdu=p1")
    assert pdu["cap_w"] == 1000 and pdu["draw_w"] == 910 and pdu["replicas"] == 1
    assert len(f.replicas("m")) == 1


def test_a_late_joining_rack_gets_its_share_by_rebalancing(make_fleet: Any) -> None:
    f = make_fleet([sim_model(count=2)], facility={"rebalance_interval_s": 0.5})
    for node in ("a", "b"):
        f.start_agent(node, labels={"llmgw.io/rack": "r1", "llmgw.io/pdu": f"p-{node}"})
    wait_for(lambda: len(f.ready("m")) == 2, 30)
    assert f.racks("m") == {"r1": 2}
    load = Load(f, "m")
    try:
        for node in ("c", "d"):
            f.start_agent(node, labels={"llmgw.io/rack": "r2", "llmgw.io/pdu": f"p-{node}"})
        lowest = [2]

        def balanced() -> bool:
            lowest[0] = min(lowest[0], len(f.ready("m")))
            return f.racks("m") == {"r1": 1, "r2": 1} and len(f.replicas("m")) == 2

        wait_for(balanced, 40)
    finally:
        load.finish()
    assert lowest[0] >= 2  # surge, then drain: never below the ready count
    assert not load.failed, load.failed[:5]
    events = [h["event"] for h in f.get("/api/v1/history?model=m&limit=200")]
    assert "replica moving" in events


def fake_nvidia_smi(tmp: Path) -> Path:
    """An nvidia-smi on PATH that knows one H100 and answers power.draw with $FAKE_POWER_DRAW."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / "nvidia-smi"
    script.write_text("""#!/bin/sh
case "$*" in
  *power.draw*) echo "$FAKE_POWER_DRAW" ;;
  *) echo "0, NVIDIA H100 80GB HBM3, 81559" ;;
esac
""")
    script.chmod(0o755)
    return bin_dir


def test_measured_power_counts_and_a_bad_figure_is_not_used(
        make_fleet: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", f"{fake_nvidia_smi(tmp_path)}:{os.environ['PATH']}")
    f = make_fleet([sim_model(count=0)])
    for node, answer in (("a", "412.3"), ("b", "-99999")):
        monkeypatch.setenv("FAKE_POWER_DRAW", answer)  # each agent inherits its own
        f.start_agent(node, labels={"llmgw.io/pdu": f"p-{node}"})
    wait_for(lambda: len(f.nodes()) == 2 and all(n["state"] == "ready" for n in f.nodes().values()), 30)
    facts = {name: n["facts"] for name, n in f.nodes().items()}
    assert facts["a"]["measured_watts"] == 412.3 and facts["a"]["gpus"][0]["name"] == "NVIDIA H100 80GB HBM3"
    assert facts["b"]["measured_watts"] is None  # a negative draw is not even reported
    draws = {d["domain"]: d["draw_w"] for d in f.get("/api/v1/facility")["domains"]}
    assert draws == {"pdu=p-a": 412.3, "pdu=p-b": 70.0}  # measured beats the table's idle; the table otherwise


def test_with_every_rack_held_status_says_replacements_cannot_be_placed(make_fleet: Any) -> None:
    f = make_fleet([sim_model(count=2)])
    for node, rack in (("a", "r1"), ("b", "r1"), ("c", "r2"), ("d", "r2")):
        f.start_agent(node, labels={"llmgw.io/rack": rack})
    wait_for(lambda: len(f.ready("m")) == 2, 30)
    assert ctl(f, "facility", "hold", "rack=r1", "--drain").returncode == 0
    wait_for(lambda: f.racks("m") == {"r2": 2} and len(f.replicas("m")) == 2, 40)
    assert ctl(f, "facility", "hold", "rack=r2", "--drain").returncode == 0
    wait_for(lambda: "m" in f.get("/api/v1/status")["unplaceable"], 20)
    why = f.get("/api/v1/status")["unplaceable"]["m"]
    assert why.startswith("2 replacements for replicas to move (domain rack=r2 is held with drain) cannot be "
                          "placed"), why
    assert "4 are in a held domain" in why and "m still serves 2/2 ready" in why
    out = ctl(f, "status")
    assert out.returncode == 0 and "2 replacements for replicas to move" in out.stdout, out.stdout
    assert "2 replicas cannot be placed" not in out.stdout
    assert len(f.ready("m")) == 2 and f.chat("m").status_code == 200


def test_explain_placement_keeps_the_verdicts_at_placement_beside_now(make_fleet: Any) -> None:
    f = make_fleet([])
    f.start_agent("a", labels={"llmgw.io/rack": "r1"})
    f.start_agent("c", labels={"llmgw.io/rack": "r2"})
    wait_for(lambda: len(f.nodes()) == 2 and all(n["state"] == "ready" for n in f.nodes().values()), 30)
    assert ctl(f, "facility", "hold", "rack=r1", "--reason", "PDU swap").returncode == 0
    body = {"name": "m", "engine": "vllm", "deploy": {"count": 1, "simulate": True, "health_timeout_s": 20.0}}
    assert f.admin.post("/api/v1/models", json=body).status_code == 201
    wait_for(lambda: len(f.ready("m")) == 1, 30)
    rid = f.ready("m")[0]["replica"]
    assert f.ready("m")[0]["node"] == "c"
    assert ctl(f, "facility", "release", "rack=r1").returncode == 0
    e = f.get(f"/api/v1/placement/{rid}")
    # now: a would fit (the hold is gone); then: a was refused, held
    assert {c["node"]: c["verdict"] for c in e["candidates"]} == {"c": "chosen", "a": "fits"}
    then = e["at_placement"]
    assert then is not None and then["node"] == "c" and then["counts"] == {"chosen": 1, "held": 1}
    assert [(c["node"], c["verdict"], c["detail"]) for c in then["candidates"]] == [
        ("c", "chosen", then["candidates"][0]["detail"]), ("a", "held", "in held domain rack=r1 (PDU swap)")]
    assert "refused then: 1 held" in then["why"]
    out = ctl(f, "explain-placement", rid)
    assert out.returncode == 0, out.stderr
    now_part, _, then_part = out.stdout.partition("at placement (")
    assert "held" not in now_part and "in held domain rack=r1 (PDU swap)" in then_part, out.stdout
    # a model's next replica has no placement-time record
    assert f.get("/api/v1/placement/m")["at_placement"] is None
