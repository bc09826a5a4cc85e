"""Scale events as lifecycle jobs (design: "Scale events as jobs"): the pure record
(llmgw.lifecycle.jobs.scale_job), Lifecycle.scale_event in the control plane (stored like other
jobs, at most MAX_SCALE_JOBS per model, older ones pruned from memory and store), and how
`GET /api/v1/jobs`, `llmgw ctl jobs` and the console list them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from llmgw.cli.ctl.lifecycle import _job_text
from llmgw.lifecycle.jobs import MAX_SCALE_JOBS, Job, job_from_dict, scale_job, scale_jobs_over

from .admin_support import admin_stack

pytestmark = pytest.mark.anyio


def test_a_scale_job_is_one_step_and_succeeded_at_once() -> None:
    j = scale_job("scale-1", "m", 2, 4, "concurrency 14.0 over target 4.0 × 2", "panic", 100.0)
    assert (j.kind, j.state, j.created_at, j.ended_at) == ("scale", "succeeded", 100.0, 100.0)
    assert [(s.name, s.state) for s in j.steps] == [("2 → 4: concurrency 14.0 over target 4.0 × 2 (panic)", "done")]
    assert j.detail == "" and j.params == {"from": 2, "to": 4, "reason": "concurrency 14.0 over target "
                                                        "4.0 × 2", "mode": "panic"}
    back = job_from_dict(j.to_dict())  # "scale" is a known kind: a stored one loads
    assert (back.kind, back.state, back.steps[0].name) == ("scale", "succeeded", j.steps[0].name)
    assert scale_job("scale-2", "m", 1, 0, "", "idle", 1.0).steps[0].name == "1 → 0: no reason given (idle)"


def test_scale_jobs_over_keeps_the_newest_per_model() -> None:
    jobs: dict[str, Job] = {}
    for i in range(5):
        for model in ("a", "b"):
            jobs[f"{model}{i}"] = scale_job(f"{model}{i}", model, i, i + 1, "r", "stable", float(i))
    jobs["u"] = Job("u", "update", "a", 0.0)
    assert scale_jobs_over(jobs, "a", keep=3) == ["a0", "a1"]
    assert scale_jobs_over(jobs, "b", keep=5) == [] and scale_jobs_over(jobs, "c", keep=0) == []


async def test_scale_events_are_listed_stored_and_pruned(tmp_path: Path) -> None:
    async with admin_stack(tmp_path) as s, s.unix_client() as c:
        lc, store = s.control.lifecycle, s.control.store
        first = lc.scale_event("m", 1, 3, "concurrency 11.0 over target 4.0", "stable")
        jobs = (await c.get("/api/v1/jobs")).json()
        assert [(j["id"], j["kind"], j["state"], j["steps"][-1]["name"]) for j in jobs] == [
            (first.id, "scale", "succeeded", "1 → 3: concurrency 11.0 over target 4.0 (stable)")]
        one = (await c.get(f"/api/v1/jobs/{first.id}")).json()
        assert one["steps"][0]["name"] == "1 → 3: concurrency 11.0 over target 4.0 (stable)"
        assert one["params"]["mode"] == "stable" and one["result"] is None
        trace = (await c.get(f"/api/v1/traces/{first.id}")).json()  # kept with the job
        assert trace["kind"] == "job" and trace["outcome"] == "ok"
        assert first.id in store.docs("job")

        made = [lc.scale_event("m", i, i + 1, "rising", "stable").id for i in range(MAX_SCALE_JOBS + 5)]
        other = lc.scale_event("other", 0, 1, "demand at zero", "cold")
        kept = [jid for jid, j in lc.jobs.items() if j.kind == "scale" and j.model == "m"]
        assert kept == made[-MAX_SCALE_JOBS:]  # the oldest went: the first and 5 more
        assert set(k for k, d in store.docs("job").items() if d["model"] == "m") == set(kept)
        assert other.id in lc.jobs and other.id in store.docs("job")
        listed = (await c.get("/api/v1/jobs", params={"model": "m", "limit": 1000})).json()
        assert len(listed) == MAX_SCALE_JOBS and listed[0]["id"] == made[-1]  # newest first

        lc.reload({"job": store.docs("job")})  # a follower or a new leader reads them back
        assert sorted(j.id for j in lc.jobs.values()) == sorted([*kept, other.id])


def _listed(job: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in job.items() if k != "trace"} | {"result": None}


def test_ctl_jobs_and_the_console_show_a_scale_job() -> None:
    from datetime import UTC

    from llmgw.tui.lifecycle_rows import job_lines, job_rows
    from llmgw.tui.state import ConsoleState

    j = _listed(scale_job("scale-ab12", "m", 3, 1, "load 2.0 under target 4.0 × 3 for 120s", "stable",
                          1_750_000_000.0).to_dict())
    text = _job_text(j)
    assert text.splitlines()[0] == "job scale-ab12: scale m — succeeded"
    assert "done    3 → 1: load 2.0" in text
    state = ConsoleState()
    state.put_lifecycle({"jobs": [j]})
    (row,) = job_rows(state, tz=UTC)
    assert row.cells[:5] == ("scale-ab12", "scale", "m", "—", "succeeded") and row.tone == "good"
    assert row.cells[-1].startswith("3 → 1: load 2.0")
    assert job_lines(state, "scale-ab12", UTC)[0].startswith("scale m: succeeded")


async def test_jobs_filter_by_kind_and_an_unknown_kind_is_named(tmp_path: Path) -> None:
    async with admin_stack(tmp_path) as s, s.unix_client() as c:
        lc = s.control.lifecycle
        scale = lc.scale_event("m", 1, 2, "rising", "stable")
        other = Job("update-1", "update", "m", 1.0, state="succeeded")
        lc.jobs = {other.id: other, **lc.jobs}
        assert [j["id"] for j in (await c.get("/api/v1/jobs", params={"kind": "scale"})).json()] == [scale.id]
        got = (await c.get("/api/v1/jobs", params={"kind": "update, eval"})).json()
        assert [j["id"] for j in got] == ["update-1"]
        assert len((await c.get("/api/v1/jobs")).json()) == 2
        r = await c.get("/api/v1/jobs", params={"kind": "scale,resize"})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "kind" and err["code"] == "invalid_query"
        assert "unknown job kind 'resize'" in err["message"] and "scale" in err["message"]


def test_the_lifecycle_view_lists_scale_events_apart_so_lifecycle_jobs_stay() -> None:
    import asyncio

    from llmgw.tui.client import AdminRefused
    from llmgw.tui.lifecycle_fetch import JOBS_LISTED, SCALE_JOBS_LISTED, fetch_lifecycle

    update = {**Job("update-1", "update", "m", 1.0, state="succeeded").to_dict(), "result": None}
    scales = [{**scale_job(f"scale-{i}", "m", i, i + 1, "r", "stable", 10.0 + i).to_dict(), "result": None}
              for i in range(100)]

    class Daemon:
        def __init__(self, knows_kind: bool) -> None:
            self.knows_kind, self.asked = knows_kind, []

        async def get(self, path: str, params: dict[str, Any] | None = None) -> Any:
            self.asked.append((path, dict(params or {})))
            if path == "/suites":
                return []
            if path.startswith("/models/"):
                raise AdminRefused(404, "no model")
            kind = (params or {}).get("kind")
            if kind is not None and not self.knows_kind:
                raise AdminRefused(400, "kind: unknown query parameter")
            jobs = [j for j in [*reversed(scales), update] if kind is None or j["kind"] in kind.split(",")]
            return jobs[:(params or {})["limit"]]

    new = asyncio.run(fetch_lifecycle(Daemon(True), [], {}))  # type: ignore[arg-type]
    assert [j["id"] for j in new["jobs"]] == [f"scale-{i}" for i in range(99, 99 - SCALE_JOBS_LISTED, -1)] + [
        "update-1"]  # newest first, and the update is still there
    assert new["revisions"] == {}  # a model with scale events only is no lifecycle model
    old = asyncio.run(fetch_lifecycle(Daemon(False), [], {}))  # type: ignore[arg-type]
    assert len(old["jobs"]) == JOBS_LISTED and "update-1" not in [j["id"] for j in old["jobs"]]  # as before
