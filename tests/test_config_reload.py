"""The config file while the daemon runs, over real processes (a router, an agent, simulated
engines): an operator's scale of a config-file model lasts across restarts until the file's count
changes; `llmgw ctl config check|reload` and SIGHUP apply hot changes at once, turn a changed
deploy profile into a candidate (eval → promote, or promoted by itself), refuse a bad file whole;
a restart after a reload and a promote does not undo or redo them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from .test_fleet_integration import Fleet, fleet_factory, sim_model  # noqa: F401 (fixture)
from .test_lifecycle_integration import FAILING, FAST, PASSING, api, wait_job
from .test_router_integration import Daemon
from .test_sim_vllm import wait_for


def write(f: Fleet, extra: str = "") -> Path:
    path = f.router_config()
    path.write_text(path.read_text() + extra)
    return path


def restart(f: Fleet, extra: str = "") -> None:
    f.stop_router()
    f.router = Daemon(write(f, extra), role="router", log_level="info")


def definition(f: Fleet, name: str = "m") -> dict[str, Any]:
    return f.get(f"/api/v1/models/{name}")


def ctl(f: Fleet, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "llmgw", "ctl", "--socket", str(f.tmp / "admin" / "admin.sock"),
                           *args], capture_output=True, text=True, timeout=30)


def test_scale_lasts_across_restarts_until_the_file_count_changes(fleet_factory: Any) -> None:  # noqa: F811
    f = fleet_factory([sim_model(count=1, args=FAST)])
    f.start_agent("a")
    wait_for(lambda: len(f.ready("m")) == 1, 30)
    assert ctl(f, "scale", "m", "2").returncode == 0
    wait_for(lambda: len(f.ready("m")) == 2, 30)
    kept = {r["replica"] for r in f.ready("m")}
    restart(f)
    assert definition(f)["deploy"]["count"] == 2  # the operator's scale outlives the restart
    wait_for(lambda: {r["replica"] for r in f.ready("m")} == kept, 30)
    # the file's own count changes: it wins, and the override is dropped (logged)
    f.models[0]["deploy"]["count"] = 3
    restart(f)
    assert definition(f)["deploy"]["count"] == 3
    wait_for(lambda: len(f.ready("m")) == 3, 30)
    assert "it wins over the operator's scale to 2" in f.log(f.router)  # type: ignore[arg-type]
    # and the next restart with the same file keeps 3 (no override left to come back)
    restart(f)
    assert definition(f)["deploy"]["count"] == 3


def test_reload_applies_a_strategy_at_once(fleet_factory: Any) -> None:  # noqa: F811
    f = fleet_factory([sim_model(count=1, args=FAST)])
    f.start_agent("a")
    wait_for(lambda: len(f.ready("m")) == 1, 30)
    before = f.ready("m")[0]["replica"]
    pid = f.router.info["pid"]  # type: ignore[union-attr]
    f.models[0]["strategy"] = "mine"
    write(f, '[[strategies]]\nname = "mine"\nweights = { queue = 1.0 }\n')
    r = ctl(f, "config", "check")
    assert r.returncode == 0, r.stderr
    assert "models.m" in r.stdout and "strategy" in r.stdout and "apply now" in r.stdout
    assert definition(f)["strategy"] == "chat"  # check changes nothing
    r = ctl(f, "-o", "json", "config", "reload")
    assert r.returncode == 0, r.stderr
    assert definition(f)["strategy"] == "mine"
    assert f.chat("m").status_code == 200
    decisions = f.get("/api/v1/decisions?model=m")
    assert decisions[-1]["strategy"] == "mine"
    assert f.ready("m")[0]["replica"] == before and f.router.info["pid"] == pid  # type: ignore[union-attr]
    assert ctl(f, "config", "check").stdout.startswith(f"config file {f.tmp / 'router.toml'}: no change")


def test_reload_makes_a_candidate_of_changed_deploy_args_then_promote_and_restart(
        fleet_factory: Any) -> None:  # noqa: F811
    f = fleet_factory([sim_model(count=1, args=FAST)])
    f.start_agent("a")
    wait_for(lambda: len(f.ready("m")) == 1, 30)
    live = f.ready("m")[0]["replica"]
    f.models[0]["deploy"]["args"] = [*FAST, "--sim-seed", "7"]
    write(f)
    check = api(f, "GET", "/config/check").json()
    rows = [c for c in check["changes"] if c["section"] == "models.m"]
    assert [(c["key"], c["action"]) for c in rows] == [("deploy.args", "candidate")], check
    r = api(f, "POST", "/config/reload")
    assert r.status_code == 200, r.text
    jobs = r.json()["jobs"]
    assert len(jobs) == 1
    done = wait_job(f, jobs[0])
    assert done["state"] == "succeeded", done
    revs = f.get("/api/v1/models/m/revisions")
    assert revs["candidate"]["definition"]["deploy"]["args"][-1] == "7"
    assert [x["replica"] for x in f.ready("m")] == [live]  # the live replica still serves, untouched
    assert definition(f)["deploy"]["args"] == FAST
    # a second reload of the same file makes no second candidate
    assert api(f, "POST", "/config/reload").json()["jobs"] == []
    assert api(f, "PUT", "/suites/ok", json={"toml": PASSING}).status_code == 200
    ev = api(f, "POST", "/models/m/eval", json={"suite": "ok"})
    assert ev.status_code == 202, ev.text
    assert wait_job(f, ev.json()["id"])["state"] == "succeeded"
    pr = api(f, "POST", "/models/m/promote", json={"require_suites": ["ok"]})
    assert pr.status_code == 200, pr.text
    assert definition(f)["deploy"]["args"][-1] == "7"
    wait_for(lambda: live not in {x["replica"] for x in f.replicas("m")}, 30)
    promoted = {x["replica"] for x in f.ready("m")}
    # a restart with the file that says the promoted definition changes nothing
    restart(f)
    assert api(f, "GET", "/config/check").json()["changes"] == []
    assert f.get("/api/v1/models/m/revisions")["candidate"] is None
    wait_for(lambda: {x["replica"] for x in f.ready("m")} == promoted, 30)
    assert "config start" not in f.log(f.router)  # type: ignore[arg-type]  # nothing to reconcile


def test_auto_promote_after_the_required_suite_passes(fleet_factory: Any) -> None:  # noqa: F811
    f = fleet_factory([sim_model(count=1, args=FAST)])
    lifecycle = '[models.lifecycle]\nauto_promote = true\nrequire_suites = ["ok"]\n'
    restart(f, lifecycle)
    f.start_agent("a")
    wait_for(lambda: len(f.ready("m")) == 1, 30)
    assert api(f, "PUT", "/suites/ok", json={"toml": PASSING}).status_code == 200
    f.models[0]["deploy"]["args"] = [*FAST, "--sim-seed", "9"]
    write(f, lifecycle)
    os.kill(f.router.info["pid"], signal.SIGHUP)  # type: ignore[union-attr]  # SIGHUP: the same as reload
    wait_for(lambda: any(j["kind"] == "update" for j in f.get("/api/v1/jobs")), 10)
    up = next(j for j in f.get("/api/v1/jobs") if j["kind"] == "update")
    done = wait_job(f, up["id"], timeout=60)
    assert done["state"] == "succeeded" and "promoted by itself" in done["detail"], done
    assert any(j["kind"] == "eval" and j["params"]["suite"] == "ok" for j in f.get("/api/v1/jobs"))
    assert definition(f)["deploy"]["args"][-1] == "9"
    assert f.get("/api/v1/models/m/revisions")["live"] == up["revision_id"]


def test_check_lists_restart_changes_and_a_bad_file_changes_nothing(fleet_factory: Any) -> None:  # noqa: F811
    f = fleet_factory([sim_model(count=1, args=FAST)])
    f.start_agent("a")
    wait_for(lambda: len(f.ready("m")) == 1, 30)
    f.control_extra["heartbeat_s"] = 0.3
    f.models[0]["deploy"]["count"] = 2
    write(f)
    changes = {(c["section"], c["key"]): c for c in api(f, "GET", "/config/check").json()["changes"]}
    assert changes[("control", "heartbeat_s")]["action"] == "restart"
    assert changes[("models.m", "deploy.count")]["action"] == "apply"
    path = f.tmp / "router.toml"
    good = path.read_text()
    path.write_text(good.replace('engine = "vllm"', 'engine = "vllm"\nstrategy = 5', 1))
    line = path.read_text().splitlines().index("strategy = 5") + 1
    r = api(f, "POST", "/config/reload")
    assert r.status_code == 400, r.text
    assert f"router.toml:{line}" in r.json()["error"]["message"] and "strategy" in r.json()["error"]["message"]
    c = ctl(f, "config", "reload")
    assert c.returncode == 1 and f"router.toml:{line}" in c.stderr and "nothing changed" in c.stderr
    assert definition(f)["deploy"]["count"] == 1 and definition(f)["strategy"] == "chat"
    # SIGHUP with the bad file: logged with the line, nothing changes, the daemon goes on
    os.kill(f.router.info["pid"], signal.SIGHUP)  # type: ignore[union-attr]
    wait_for(lambda: "SIGHUP: the config file was not reloaded" in f.log(f.router), 10)  # type: ignore[arg-type]
    assert f"router.toml:{line}" in f.log(f.router).split("SIGHUP: the config file")[1]  # type: ignore[arg-type]
    assert definition(f)["deploy"]["count"] == 1 and f.router.proc.poll() is None  # type: ignore[union-attr]
    path.write_text(good)
    assert api(f, "POST", "/config/reload").status_code == 200
    wait_for(lambda: len(f.ready("m")) == 2, 30)


def test_a_start_takes_changed_deploy_args_as_a_candidate_and_keeps_a_pending_one(
        fleet_factory: Any) -> None:  # noqa: F811
    f = fleet_factory([sim_model(count=1, args=FAST)])
    f.start_agent("a")
    wait_for(lambda: len(f.ready("m")) == 1, 30)
    live = f.ready("m")[0]["replica"]
    # edited and restarted, never reloaded: the start makes the candidate; the live replica stays
    f.models[0]["deploy"]["args"] = [*FAST, "--sim-seed", "3"]
    restart(f)
    revs = f.get("/api/v1/models/m/revisions")
    assert revs["candidate"] is not None and revs["candidate"]["definition"]["deploy"]["args"][-1] == "3"
    first = revs["candidate"]["id"]
    assert definition(f)["deploy"]["args"] == FAST
    up = next(j for j in f.get("/api/v1/jobs") if j["kind"] == "update")
    assert up["params"]["from_config"] == "start"
    assert wait_job(f, up["id"])["state"] == "succeeded"
    assert live in {x["replica"] for x in f.ready("m")}
    # restarted again with the same file: the pending candidate is kept, not made again
    restart(f)
    assert f.get("/api/v1/models/m/revisions")["candidate"]["id"] == first
    assert [j["kind"] for j in f.get("/api/v1/jobs")].count("update") == 1
    # the file changes again: the old candidate is discarded and a new one made
    f.models[0]["deploy"]["args"] = [*FAST, "--sim-seed", "4"]
    write(f)
    r = api(f, "POST", "/config/reload")
    assert r.status_code == 200 and len(r.json()["jobs"]) == 1, r.text
    cand = f.get("/api/v1/models/m/revisions")["candidate"]
    assert cand["id"] != first and cand["definition"]["deploy"]["args"][-1] == "4"
    assert wait_job(f, r.json()["jobs"][0])["state"] == "succeeded"
    assert definition(f)["deploy"]["args"] == FAST and live in {x["replica"] for x in f.ready("m")}


def test_auto_promote_withheld_when_a_required_suite_fails(fleet_factory: Any) -> None:  # noqa: F811
    f = fleet_factory([sim_model(count=1, args=FAST)])
    lifecycle = '[models.lifecycle]\nauto_promote = true\nrequire_suites = ["strict"]\n'
    restart(f, lifecycle)
    f.start_agent("a")
    wait_for(lambda: len(f.ready("m")) == 1, 30)
    assert api(f, "PUT", "/suites/strict", json={"toml": FAILING}).status_code == 200
    f.models[0]["deploy"]["args"] = [*FAST, "--sim-seed", "5"]
    write(f, lifecycle)
    r = api(f, "POST", "/config/reload")
    assert r.status_code == 200, r.text
    done = wait_job(f, r.json()["jobs"][0], timeout=60)
    assert done["state"] == "succeeded" and "not promoted" in done["detail"] and "strict" in done["detail"], done
    assert definition(f)["deploy"]["args"] == FAST  # live untouched
    assert f.get("/api/v1/models/m/revisions")["candidate"] is not None  # left for an operator
