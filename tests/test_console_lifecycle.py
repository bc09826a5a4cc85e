"""The console's Lifecycle view: the lifecycle section as data (revisions with the canary side by
side, jobs with their steps, the latest eval result case by case, the dialogs' choices), the
fetch from the admin API, and the view driven by a fake daemon (a snapshot, and each action going
through its confirmation dialog to the right admin call; a refused promote shown)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC
from typing import Any

import pytest
from textual.pilot import Pilot
from textual.widgets import DataTable, Static

from llmgw.tui.app import ConsoleApp
from llmgw.tui.client import AdminRefused
from llmgw.tui.lifecycle_fetch import MAX_NEW_RESULTS, fetch_lifecycle
from llmgw.tui.lifecycle_rows import (
    eval_choices,
    eval_lines,
    job_lines,
    job_rows,
    lifecycle_models,
    promote_choices,
    revision_rows,
    rollback_text,
    suite_verdict,
)
from llmgw.tui.lifecycle_screens import ChoiceScreen
from llmgw.tui.state import ConsoleState
from llmgw.tui.trace_screen import TraceScreen
from tests.test_console_fakes import FakeClient, StopAfter, _validator, snapshot

T0 = 1_767_225_600.0  # 2026-01-01 00:00:00 UTC


def _job(jid: str, kind: str, model: str, rev: str, state: str, at: float, steps: list[tuple[str, str, float,
         float | None, str]], detail: str = "", **params: Any) -> dict[str, Any]:
    return {"id": jid, "kind": kind, "model": model, "created_at": at, "state": state,
            "ended_at": None if state == "running" else steps[-1][3], "detail": detail, "revision_id": rev,
            "params": params, "result": None,
            "steps": [{"name": n, "state": s, "started_at": a, "ended_at": e, "detail": d} for n, s, a, e, d in steps]}


JOBS = [  # newest first, as GET /api/v1/jobs answers
    _job("eval-0000bbbb", "eval", "qwen-7b", "r2", "succeeded", T0 + 100,
         [("running 3 cases on candidate r2", "done", T0 + 100, T0 + 104, "concurrency 4, 30 s a case"),
          ("stored the result", "done", T0 + 104, T0 + 104, "")],
         "suite strict failed: 2/3 cases (67%; 100% needed)", suite="strict", revision="candidate", result="k"),
    _job("eval-0000aaaa", "eval", "qwen-7b", "r2", "succeeded", T0 + 60,
         [("running 2 cases on candidate r2", "done", T0 + 60, T0 + 62, ""), ("stored the result", "done", T0 + 62,
                                                                                  T0 + 62, "")],
         "suite smoke passed: 2/2 cases (100%; 100% needed)", suite="smoke", revision="candidate"),
    _job("update-1a2b3c4d", "update", "qwen-7b", "r2", "succeeded", T0,
         [("placing candidate replicas", "done", T0, T0 + 41, "1/1 ready (qwen-7b#candidate/9f3e ready)")],
         "candidate r2 ready: 1/1 replicas", canary=0.05),
    _job("update-0ff1ce00", "update", "mistral-7b", "r2", "failed", T0 - 900,
         [("placing candidate replicas", "failed", T0 - 900, T0 - 880,
           "candidate replica mistral-7b#candidate/77 on gpu-a1: failed: exit 2\nlog tail:\nerror: bad flag")],
         "candidate replica mistral-7b#candidate/77 on gpu-a1: failed: exit 2\nlog tail:\nerror: bad flag"),
]
SMOKE_RESULT = {"suite": "smoke", "model": "qwen-7b", "revision": "candidate", "revision_id": "r2",
                "job": "eval-0000aaaa", "passed": True, "pass_rate": 1.0, "threshold": 1.0,
                "totals": {"cases": 2, "passed": 2, "failed": 0, "errors": 0, "ttft_ms_p50": 41.0,
                           "ttft_ms_p90": 52.0, "latency_ms_p50": 180.0, "latency_ms_p90": 220.0},
                "cases": [{"name": "greets", "passed": True, "failures": [], "excerpt": "Hello", "ttft_ms": 41.0,
                           "latency_ms": 180.0, "tokens": 4, "error": None}]}
STRICT_RESULT = {**SMOKE_RESULT, "suite": "strict", "job": "eval-0000bbbb", "passed": False, "pass_rate": 0.6667,
                 "totals": {**SMOKE_RESULT["totals"], "cases": 3, "passed": 2, "failed": 1},
                 "compare": {"live_revision_id": "r1", "live_pass_rate": 1.0, "pass_rate": 0.6667,
                             "ttft_ms_p50": 41.0, "live_ttft_ms_p50": 55.0, "newly_failing": ["json"]},
                 "cases": [{"name": "greets", "passed": True, "failures": [], "excerpt": "Hi", "ttft_ms": 40.0,
                            "latency_ms": 170.0, "tokens": 3, "error": None},
                           {"name": "json", "passed": False, "failures": ["json: not JSON (Expecting value)"],
                            "excerpt": "Sure! {", "ttft_ms": 44.0, "latency_ms": 210.0, "tokens": 4, "error": None}]}
RESULTS = {"eval-0000aaaa": SMOKE_RESULT, "eval-0000bbbb": STRICT_RESULT}
REVISIONS = {
    "qwen-7b": {"model": "qwen-7b", "live": "r1", "live_restored_from": None, "previous": None,
                "promoted_at": None,
                "candidate": {"id": "r2", "created_at": T0, "definition": {"name": "qwen-7b", "deploy": {"count": 1}},
                              "replicas": ["qwen-7b#candidate/9f3e"], "ready": 1, "unplaceable": None},
                "canary": {"share": 0.05,
                           "live": {"requests": 1900, "failed": 2, "error_rate": 0.0011, "ttft_ms_mean": 55.2},
                           "candidate": {"requests": 100, "failed": 0, "error_rate": 0.0, "ttft_ms_mean": 41.7}}},
    "mistral-7b": {"model": "mistral-7b", "live": "r1", "live_restored_from": None, "previous": "r0",
                   "promoted_at": T0 - 1000,
                   "candidate": None, "canary": None},
}
SUITES = [{"name": n, "description": "", "pass_threshold": 1.0, "concurrency": 4, "timeout_s": 30.0, "cases": c,
           "toml": ""} for n, c in (("smoke", 2), ("strict", 3))]
PROMOTE_REFUSAL = "suite 'strict' failed on candidate r2 (67% passed, 100% needed)"


@dataclass
class LifecycleFake(FakeClient):
    """The fake daemon with the lifecycle's routes: canned jobs, revisions, suites, results."""

    gets: list[str] = field(default_factory=list)

    async def get(self, path: str, params: dict[str, Any] | None = None) -> Any:
        self.gets.append(path)
        if path == "/jobs":  # ?kind= as the daemon filters it
            kinds = (params or {}).get("kind")
            return [j for j in JOBS if kinds is None or j["kind"] in kinds.split(",")]
        if path == "/suites":
            return SUITES
        if path.startswith("/jobs/"):
            jid = path.split("/")[-1]
            return {**next(j for j in JOBS if j["id"] == jid), "result": RESULTS.get(jid)}
        if path.startswith("/models/") and path.endswith("/revisions"):
            name = path.split("/")[2]
            if name not in REVISIONS:
                raise AdminRefused(404, f"No model {name!r}.")
            return REVISIONS[name]
        raise AdminRefused(404, "no such route")

    async def update_model(self, model: str) -> dict[str, Any]:
        self.calls.append(("UPDATE", model, None))
        return {**JOBS[2], "id": "update-new", "state": "running"}

    async def eval_model(self, model: str, suite: str, revision: str) -> dict[str, Any]:
        self.calls.append(("EVAL", model, (suite, revision)))
        return {**JOBS[0], "id": "eval-new", "state": "running"}

    async def promote(self, model: str, require_suites: list[str]) -> dict[str, Any]:
        self.calls.append(("PROMOTE", model, require_suites))
        if "strict" in require_suites:
            raise AdminRefused(409, PROMOTE_REFUSAL)
        return {**JOBS[2], "id": "promote-new", "kind": "promote", "state": "succeeded"}

    async def rollback(self, model: str) -> dict[str, Any]:
        self.calls.append(("ROLLBACK", model, None))
        return {**JOBS[2], "id": "rollback-new", "kind": "rollback", "state": "succeeded"}

    async def trace(self, request_id: str) -> dict[str, Any]:
        self.calls.append(("GET", "trace", request_id))
        return {"id": request_id, "kind": "job", "name": "update qwen-7b", "model": "qwen-7b", "stream": False,
                "started_at": T0, "total_ms": 41000.0, "outcome": "ok", "status": None, "revision": "r2",
                "bytes_out": 0, "bytes_in": 0, "retries": 0, "attempts": [],
                "phases": [{"name": "placing candidate replicas", "attempt": 0, "start_ms": 0.0,
                            "duration_ms": 41000.0, "note": "1/1 ready"},
                           {"name": "succeeded", "attempt": 0, "start_ms": 41000.0, "duration_ms": 0.0,
                            "note": "candidate r2 ready: 1/1 replicas"}]}


def state() -> ConsoleState:
    s = ConsoleState()
    s.apply(snapshot())
    s.put_lifecycle({"jobs": JOBS, "suites": SUITES, "revisions": REVISIONS, "results": RESULTS, "error": ""})
    return s


# -- the canned answers are what the daemon sends -----------------------------------------------------------
@pytest.mark.parametrize(("schema", "value"), [("JobView", j) for j in JOBS] + [
    ("RevisionsView", r) for r in REVISIONS.values()] + [("SuiteView", s) for s in SUITES])
def test_canned_lifecycle_answers_match_the_admin_document(schema: str, value: dict[str, Any]) -> None:
    errors = [f"{e.instance_path}: {e.message}" for e in _validator(schema).iter_errors(value)]
    assert not errors, errors[:5]


# -- rows ---------------------------------------------------------------------------------------------------
def test_revisions_show_live_and_candidate_with_the_canary_side_by_side() -> None:
    s = state()
    assert lifecycle_models(s) == ["mistral-7b", "qwen-7b"]  # config-file models cannot be updated
    rows = {r.key: r for r in revision_rows(s)}
    live, cand = rows["qwen-7b\0live"], rows["qwen-7b\0candidate"]
    assert live.cells == ("qwen-7b", "r1", "live", "serving", "1/1", "5%", "1900", "2 (0%)", "55 ms", "")
    assert cand.cells == ("qwen-7b", "r2", "candidate", "ready", "1/1", "5%", "100", "0 (0%)", "42 ms", "")
    assert (live.tone, cand.tone) == ("good", "good")
    m = rows["mistral-7b\0live"]
    assert m.cells[3:5] == ("no replica ready", "0/0") and m.cells[-1] == "rollback brings back r0"
    assert [r.key for r in revision_rows(s, "mistral")] == ["mistral-7b\0live"]


def test_a_candidate_without_room_or_canary_says_so() -> None:
    s = state()
    s.lifecycle["revisions"] = {"qwen-7b": {**REVISIONS["qwen-7b"], "canary": None, "candidate": {
        **REVISIONS["qwen-7b"]["candidate"], "ready": 0, "replicas": [], "unplaceable": "needs 1 GPU"}}}
    cand = {r.key: r for r in revision_rows(s)}["qwen-7b\0candidate"]
    assert cand.cells[3:6] == ("waiting for room", "0/1", "0% (no traffic)") and cand.cells[-1] == "needs 1 GPU"
    assert cand.tone == "warn"


def test_jobs_show_state_times_and_their_steps() -> None:
    s = state()
    rows = job_rows(s, tz=UTC)
    assert [r.cells[:6] for r in rows[2:]] == [
        ("update-1a2b3c4d", "update", "qwen-7b", "r2", "succeeded", "00:00:00"),
        ("update-0ff1ce00", "update", "mistral-7b", "r2", "failed", "23:45:00")]
    assert rows[2].cells[6:] == ("41s", "candidate r2 ready: 1/1 replicas")
    assert rows[3].tone == "bad" and "\n" not in rows[3].cells[7] and len(rows[3].cells[7]) <= 80  # first line, cut
    lines = job_lines(s, "update-0ff1ce00", UTC)
    assert lines[0].startswith("update mistral-7b r2: failed")
    assert lines[1].startswith("  ✗ 23:45:00    20s  placing candidate replicas: candidate replica")
    assert "      error: bad flag" in lines
    assert job_lines(s, None)[0].startswith("no job selected")


def test_the_latest_eval_result_case_by_case_and_the_suites_verdicts() -> None:
    s = state()
    lines = eval_lines(s, "qwen-7b")
    assert lines[0].startswith("latest eval: suite strict on candidate r2: FAILED 2/3 (67%; 100% needed)")
    assert lines[1].startswith("  vs live r1: pass rate 100% → 67%") and lines[1].endswith("newly failing: json")
    assert lines[2].startswith("  ✓ greets") and lines[3].startswith("  ✗ json") and "not JSON" in lines[3]
    assert eval_lines(s, "mistral-7b")[0].startswith("no eval result of mistral-7b")
    assert suite_verdict(s, "qwen-7b", "smoke", "r2") == "passed"
    assert suite_verdict(s, "qwen-7b", "strict", "r2") == "failed"
    assert suite_verdict(s, "qwen-7b", "smoke", "r1") == "not run"


def test_the_dialogs_choices() -> None:
    s = state()
    assert [(c.label, c.value) for c in eval_choices(s, "qwen-7b")] == [
        ("smoke on candidate r2 (last: passed)", ("smoke", "candidate")),
        ("smoke on live r1 (last: not run)", ("smoke", "live")),
        ("strict on candidate r2 (last: failed)", ("strict", "candidate")),
        ("strict on live r1 (last: not run)", ("strict", "live"))]
    assert [(c.label, c.value, c.tone) for c in promote_choices(s, "qwen-7b")] == [
        ("promote r2 without requiring a suite", (), ""),
        ("promote r2 requiring suite smoke (passed on r2)", ("smoke",), "good"),
        ("promote r2 requiring suite strict (failed on r2)", ("strict",), "bad")]
    assert promote_choices(s, "mistral-7b") == []  # no candidate
    assert rollback_text(s, "qwen-7b").startswith("Discard candidate r2 of qwen-7b?")  # type: ignore[union-attr]
    assert rollback_text(s, "mistral-7b").startswith("Bring back r0 of mistral-7b?")  # type: ignore[union-attr]
    s.lifecycle["revisions"]["mistral-7b"] = {**REVISIONS["mistral-7b"], "previous": None}
    assert rollback_text(s, "mistral-7b") is None


def test_malformed_lifecycle_data_shows_what_it_can() -> None:
    s = ConsoleState()
    s.apply(snapshot())
    s.put_lifecycle({"jobs": [1, {"id": 3, "steps": "x"}], "revisions": {"qwen-7b": [], "x": {"candidate": 5}},
                     "results": [], "suites": None})
    assert [r.cells[0] for r in job_rows(s)] == ["?"]
    assert [r.key for r in revision_rows(s)] == ["mistral-7b\0live", "qwen-7b\0live"]  # x is not a model it has
    assert eval_lines(s, "qwen-7b")[0].startswith("no eval result")
    assert eval_choices(s, "qwen-7b") == [] and promote_choices(s, "qwen-7b") == []


# -- the fetch ---------------------------------------------------------------------------------------------
def test_the_fetch_asks_for_what_it_shows_and_keeps_finished_results() -> None:
    client = LifecycleFake()
    data = asyncio.run(fetch_lifecycle(client, ["qwen-7b", "gone"], {}))
    assert set(data["revisions"]) == {"qwen-7b", "mistral-7b"}  # "gone" answered 404: skipped
    assert data["results"] == RESULTS and data["jobs"] == JOBS and data["error"] == ""
    client.gets.clear()
    again = asyncio.run(fetch_lifecycle(client, ["qwen-7b"], data))
    assert again["results"] == RESULTS
    assert not [g for g in client.gets if g.startswith("/jobs/")]  # a finished eval's result is not asked again
    assert MAX_NEW_RESULTS >= 2


# -- the view ------------------------------------------------------------------------------------------------
SIZE = (120, 40)


def console() -> tuple[ConsoleApp, LifecycleFake]:
    client = LifecycleFake()
    app = ConsoleApp(client, tz=UTC, backoff=StopAfter(3), redraw_s=0.02, redraw_budget=1.0)
    app.animation_level = "none"
    return app, client


def shown(app: ConsoleApp) -> bool:
    return app.shown_rev >= 5 and not app._dirty and bool(app.state.lifecycle.get("results")) and \
        app.screen.query_one("#jobs-table", DataTable).row_count == len(JOBS)


async def until(pilot: Pilot[Any], cond: Callable[[ConsoleApp], bool], what: str = "the view to settle") -> None:
    for _ in range(300):
        if cond(pilot.app):  # type: ignore[arg-type]
            await pilot.pause()
            return
        await pilot.pause(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def drive(script: Callable[[Pilot[Any], ConsoleApp, LifecycleFake], Awaitable[None]]) -> None:
    app, client = console()

    async def go() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda a: a.shown_rev >= 5)
            await pilot.press("6")
            await until(pilot, shown)
            await script(pilot, app, client)

    asyncio.run(go())


def test_snapshot_lifecycle(request: pytest.FixtureRequest) -> None:
    pytest.importorskip("pytest_textual_snapshot")
    compare = request.getfixturevalue("snap_compare")
    app, _ = console()

    async def settle(pilot: Pilot[Any]) -> None:
        await until(pilot, lambda a: a.shown_rev >= 5)
        await pilot.press("6")
        await until(pilot, shown)
        await pilot.press("down")  # qwen-7b's live revision: its latest eval shows

    assert compare(app, terminal_size=SIZE, run_before=settle)


def _status(app: ConsoleApp) -> str:
    return str(app.screen.query_one("#lifecycle-status", Static).render())


def test_a_promote_requiring_a_failed_suite_is_refused_and_says_why() -> None:
    async def script(pilot: Pilot[Any], app: ConsoleApp, client: LifecycleFake) -> None:
        await pilot.press("down", "p")  # qwen-7b
        await until(pilot, lambda a: isinstance(a.screen, ChoiceScreen), "the promote dialog")
        assert not [c for c in client.calls if c[0] == "PROMOTE"]  # nothing happens before a choice
        await pilot.press("down", "down", "enter")  # requiring strict
        await until(pilot, lambda a: "refused" in _status(a), "the refusal")
        assert client.calls[-1] == ("PROMOTE", "qwen-7b", ["strict"])
        assert PROMOTE_REFUSAL in _status(app)

    drive(script)


def test_escape_cancels_a_rollback_and_enter_confirms_it() -> None:
    async def script(pilot: Pilot[Any], app: ConsoleApp, client: LifecycleFake) -> None:
        await pilot.press("down", "r")
        await until(pilot, lambda a: isinstance(a.screen, ChoiceScreen), "the rollback dialog")
        await pilot.press("escape")
        await until(pilot, lambda a: not isinstance(a.screen, ChoiceScreen), "the dialog to close")
        assert not [c for c in client.calls if c[0] == "ROLLBACK"]
        await pilot.press("r")
        await until(pilot, lambda a: isinstance(a.screen, ChoiceScreen), "the rollback dialog")
        await pilot.press("enter")
        await until(pilot, lambda a: "rollback-new" in _status(a), "the rollback job")
        assert client.calls[-1] == ("ROLLBACK", "qwen-7b", None)

    drive(script)


def test_update_and_eval_go_through_their_dialogs() -> None:
    async def script(pilot: Pilot[Any], app: ConsoleApp, client: LifecycleFake) -> None:
        await pilot.press("down", "u")
        await until(pilot, lambda a: isinstance(a.screen, ChoiceScreen), "the update dialog")
        await pilot.press("enter")
        await until(pilot, lambda a: ("UPDATE", "qwen-7b", None) in client.calls, "the update call")
        await until(pilot, lambda a: not isinstance(a.screen, ChoiceScreen))
        await pilot.press("e")
        await until(pilot, lambda a: isinstance(a.screen, ChoiceScreen), "the suite chooser")
        await pilot.press("down", "down", "enter")  # strict on the candidate
        await until(pilot, lambda a: ("EVAL", "qwen-7b", ("strict", "candidate")) in client.calls, "the eval call")

    drive(script)


def test_t_opens_the_selected_jobs_trace() -> None:
    async def script(pilot: Pilot[Any], app: ConsoleApp, client: LifecycleFake) -> None:
        app.screen.query_one("#jobs-table", DataTable).focus()
        await pilot.press("down", "down", "t")  # the update job
        await until(pilot, lambda a: isinstance(a.screen, TraceScreen), "the trace")
        assert client.calls[-1] == ("GET", "trace", "update-1a2b3c4d")
        text = "\n".join(app.screen.lines)  # type: ignore[attr-defined]
        assert "job update-1a2b3c4d" in text and "placing candidate replicas" in text

    drive(script)


def test_a_running_jobs_row_shows_its_step_and_progress() -> None:
    s = state()
    s.lifecycle["jobs"] = [_job("update-9", "update", "qwen-7b", "r3", "running", T0,
                                [("placing candidate replicas", "running", T0, None, "0/1 ready (starting)")])]
    row = job_rows(s, tz=UTC, now=T0 + 75)[0]
    assert row.cells[4:] == ("running", "00:00:00", "1m15s", "placing candidate replicas: 0/1 ready (starting)")
    assert row.tone == "busy"
