"""The router and its store over real processes: a full disk never takes the router down, and its
state is written back when the disk has room again.

Two ways to fill the disk: a real one — a 2 MiB tmpfs, filled with a file (mounting needs root:
skipped elsewhere) — and the daemon's test hook (LLMGW_STORE_FAULT_FILE), which makes the store's
writes raise the same sqlite3.OperationalError while a flag file exists."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmgw.daemon.control.store.faults import FAULT_ENV

from .test_fleet_integration import fleet_factory, sim_model  # noqa: F401 — the fixture
from .test_sim_vllm import wait_for


class TmpfsDisk:
    def __init__(self, mount: Path) -> None:
        self.dir = mount
        self.filler = mount / "filler"

    def fill(self) -> None:
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            while True:
                os.write(fd, b"\0" * 65536)
        except OSError:
            pass
        try:
            while True:
                os.write(fd, b"\0" * 512)
        except OSError:
            pass
        finally:
            os.close(fd)

    def clear(self) -> None:
        self.filler.unlink()


class InjectedDisk:
    def __init__(self, store_dir: Path, flag: Path) -> None:
        self.dir = store_dir
        self.flag = flag

    def fill(self) -> None:
        self.flag.write_text("database or disk is full")

    def clear(self) -> None:
        self.flag.unlink()


@pytest.fixture(params=["tmpfs", "injected"])
def full_disk(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    mount = tmp_path / "disk"
    mount.mkdir()
    if request.param == "injected":
        monkeypatch.setenv(FAULT_ENV, str(tmp_path / "fault"))  # read by the daemons the test starts
        yield InjectedDisk(mount, tmp_path / "fault")
        return
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(mount)],
                          capture_output=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()}); the injected fault covers it")
    try:
        yield TmpfsDisk(mount)
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True, check=False)


def ctl(socket: Path, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "llmgw", "ctl", "--socket", str(socket), *args],
                          capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_full_disk_never_takes_the_router_down(
        fleet_factory: Any, full_disk: Any, tmp_path: Path) -> None:  # noqa: F811
    db = full_disk.dir / "llmgw" / "router.db"
    f = fleet_factory([sim_model(count=1)], control={"store": str(db)})
    f.start_agent("a")
    wait_for(lambda: len(f.ready("m")) == 1, 30)
    assert f.chat("m").status_code == 200
    status = lambda: f.get("/api/v1/status")  # noqa: E731

    full_disk.fill()
    # An engine report the store cannot record: the engine dies, is reported, restarted, routed.
    [r] = f.ready("m")
    os.killpg(r["pid"], signal.SIGKILL)
    wait_for(lambda: status()["store"]["state"] == "degraded", 15)
    assert status()["store"]["reason"] == "disk full"
    wait_for(lambda: any(x["restarts"] >= 1 and x["state"] == "ready" for x in f.replicas("m")), 30)
    wait_for(lambda: f.chat("m").status_code == 200, 10)  # routing goes on from memory
    assert f.router is not None and f.router.proc.poll() is None

    # Operator changes that must persist are refused, saying why; nothing changes.
    new = {"name": "new", "engine": "vllm", "deploy": {"count": 1, "simulate": True}}
    refused = f.admin.post("/api/v1/models", json=new)
    assert refused.status_code == 503, refused.text
    assert "disk full" in refused.json()["error"]["message"] and refused.headers["retry-after"]
    assert f.admin.get("/api/v1/models/new").status_code == 404
    assert f.admin.put("/api/v1/nodes/a/labels", json={"labels": {"x": "y"}}).status_code == 503
    assert "x" not in f.nodes()["a"]["labels"]
    assert "store                degraded (disk full)" in ctl(f.tmp / "admin" / "admin.sock", "status")
    metrics = httpx.get(f"{f.router.url}/metrics", timeout=5).text
    assert "llmgw_store_degraded 1.0" in metrics and 'llmgw_store_errors_total{op="' in metrics

    # A new node that asks to join meanwhile is told to retry: the router does not issue an
    # identity (a node credential) it could not remember after a restart. A restart with the disk
    # still full comes up (it used to die at the first hello), serves, and takes node a back.
    f.start_agent("b")
    wait_for(lambda: "refused this agent for now" in f.log(f.agents["b"]), 15)
    assert f.nodes().get("b", {}).get("state") != "ready"
    f.stop_router()
    f.start_router()
    wait_for(lambda: f.chat("m").status_code == 200, 20)
    wait_for(lambda: f.nodes().get("a", {}).get("state") == "ready", 20)
    assert status()["store"]["state"] == "degraded"
    assert f.router.proc.poll() is None

    # Room again: the retry writes the state back (node b included), with the history it kept.
    full_disk.clear()
    wait_for(lambda: status()["store"]["state"] == "ok", 30)
    wait_for(lambda: f.nodes().get("b", {}).get("state") == "ready", 20)  # b's retry succeeds
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        nodes = {n for (n,) in conn.execute("SELECT name FROM nodes")}
        events = [e for (e,) in conn.execute("SELECT event FROM history")]
    assert nodes == {"a", "b"}
    assert "node ready" in events
    assert f.admin.post("/api/v1/models", json=new).status_code == 201
    assert "store                ok" in ctl(f.tmp / "admin" / "admin.sock", "status")
    assert "Traceback" not in f.log(f.router)
