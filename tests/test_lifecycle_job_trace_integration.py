"""Jobs' traces over real processes: `llmgw ctl trace JOB_ID` prints an update's steps, and a job's
trace outlives the router's ring (it is kept with the job in the store, across a restart). The
console's admin client does the Lifecycle view's calls against the same daemon."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from typing import Any

import pytest

from llmgw.tui.client import AdminClient, AdminRefused
from llmgw.tui.lifecycle_fetch import fetch_lifecycle

from .test_fleet_integration import Fleet, fleet_factory  # noqa: F401 (fixture)
from .test_lifecycle_integration import FAST, api, api_model, wait_job


def ctl(f: Fleet, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "llmgw", "ctl", "--socket", str(f.tmp / "admin" / "admin.sock"),
                           *args], capture_output=True, text=True, timeout=30)


def test_ctl_trace_prints_an_updates_steps_and_the_trace_outlives_a_restart(fleet_factory: Any) -> None:  # noqa: F811
    f = fleet_factory([])
    f.start_agent("a")
    api_model(f, count=1)
    up = api(f, "POST", "/models/m/update", json={"deploy": {"args": [*FAST, "--sim-seed", "3"]}}).json()
    assert wait_job(f, up["id"])["state"] == "succeeded"
    out = ctl(f, "trace", up["id"])
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert text.startswith(f"job {up['id']}  update m  model m"), text
    assert "ok" in text.splitlines()[1] and "revision r2" in text.splitlines()[1], text
    assert "placing candidate replicas" in text and "succeeded" in text and "1/1 replicas" in text, text
    listed = json.loads(ctl(f, "-o", "json", "trace").stdout)
    assert any(t["id"] == up["id"] and t["kind"] == "job" for t in listed)

    assert api(f, "PUT", "/suites/never", json={"toml": 'name = "never"\n[[cases]]\nprompt = "x"\n'}).status_code == 200

    async def console_calls() -> tuple[dict[str, Any], str, dict[str, Any]]:
        c = AdminClient(socket=str(f.tmp / "admin" / "admin.sock"))
        try:
            data = await fetch_lifecycle(c, ["m"], {})
            with pytest.raises(AdminRefused) as refused:
                await c.promote("m", ["never"])
            return data, str(refused.value), await c.promote("m", [])
        finally:
            await c.aclose()

    data, refusal, pr = asyncio.run(console_calls())
    assert data["revisions"]["m"]["candidate"]["id"] == "r2" and data["jobs"][0]["id"] == up["id"]
    assert [s["name"] for s in data["suites"]] == ["never"]
    assert refusal.startswith("409: suite 'never' has not run on candidate r2"), refusal
    assert pr["kind"] == "promote" and pr["state"] == "succeeded", pr
    f.stop_router()
    f.start_router()  # a new ring: the finished jobs' traces come from the store
    t = json.loads(ctl(f, "-o", "json", "trace", pr["id"]).stdout)
    assert t["kind"] == "job" and t["outcome"] == "ok"
    assert [p["name"] for p in t["phases"]] == ["making the candidate live", "draining the old replicas", "succeeded"]
    assert abs(sum(p["duration_ms"] for p in t["phases"]) - t["total_ms"]) < 0.01  # contiguous (ms rounding)
    again = ctl(f, "trace", up["id"])
    assert again.returncode == 0 and "placing candidate replicas" in again.stdout, again.stderr
