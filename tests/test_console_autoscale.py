"""The console's Models view and autoscaling (llmgw.tui.autoscale_rows): the autoscale column
(count/ready/starting, bounds, mode or pin) from GET /api/v1/autoscale, the selected model's
decision and history in the detail pane, and a daemon without the route (404) showing nothing
extra. The snapshot is tests/test_console.py's test_snapshot_models."""

from __future__ import annotations

import asyncio
from datetime import UTC
from typing import Any

import httpx
from textual.pilot import Pilot
from textual.widgets import DataTable, Static

from llmgw.tui.app import ConsoleApp
from llmgw.tui.autoscale_rows import autoscale_cell, autoscale_lines
from llmgw.tui.client import AdminClient, AdminRefused
from llmgw.tui.rows import MODEL_COLUMNS, model_rows
from llmgw.tui.state import ConsoleState
from tests.test_console import drive, table_rows, until
from tests.test_console_fakes import AUTOSCALE, FakeClient, snapshot

AUTOSCALE_COLUMN = [c.label for c in MODEL_COLUMNS].index("autoscale")


def loaded_state(autoscale: Any = AUTOSCALE) -> ConsoleState:
    s = ConsoleState()
    s.apply(snapshot())
    s.put_autoscale(autoscale)
    return s


def test_the_autoscale_cell_reads_count_ready_starting_bounds_and_mode() -> None:
    llama, mistral = AUTOSCALE
    assert autoscale_cell(llama) == "3/2/1 [1–4] stable"
    assert autoscale_cell(mistral) == "2/0/0 [0–4] pinned 2"
    assert autoscale_cell({**llama, "decision": None}) == "3/2/1 [1–4] waiting"
    assert autoscale_cell(None) == "—" and autoscale_cell({"model": "x", "count": "3"}) == "?/?/? [?–?] waiting"
    rows = {r.key: r.cells[AUTOSCALE_COLUMN] for r in model_rows(loaded_state())}
    assert rows == {"ext-model": "—", "llama-8b": "3/2/1 [1–4] stable", "mistral-7b": "2/0/0 [0–4] pinned 2",
                    "qwen-7b": "—"}
    assert [r.key for r in model_rows(loaded_state(), "pinned")] == ["mistral-7b"]  # the filter sees the cell


def test_the_selected_models_decision_and_history() -> None:
    lines = autoscale_lines(loaded_state(), "llama-8b", UTC)
    assert lines[0].startswith("llama-8b: autoscaled on concurrency (target 4.0), 3/2/1 [1–4] stable; cold start 28.0")
    assert lines[1].startswith("  rule: concurrency: ceil(")
    assert lines[2] == "  now: 3 → 3 (stable) · limited by nothing"
    assert lines[3].endswith("2 → 3  stable: concurrency 10.5 over target 4.0 × 2") and "panic" in lines[4]
    pinned = autoscale_lines(loaded_state(), "mistral-7b", UTC)
    assert "pinned by `llmgw ctl scale`" in pinned[0]
    assert "limited by pinned at 2 (llmgw ctl scale); placement: needs 1 GPU" in pinned[2]
    assert autoscale_lines(loaded_state(), "qwen-7b") == [] and autoscale_lines(loaded_state(), None) == []


def test_a_daemon_without_autoscaling_and_garbage_show_nothing_extra() -> None:
    for answer in (None, [], {"error": 1}, [1, "x", {"no_model": 1}, {"model": 3}]):
        s = loaded_state(answer)
        assert s.autoscale == {}
        assert {r.cells[AUTOSCALE_COLUMN] for r in model_rows(s)} == {"—"}


def test_the_models_view_fetches_autoscale_and_the_detail_follows_the_models_table() -> None:
    async def script(pilot: Pilot[Any], app: ConsoleApp, client: FakeClient) -> None:
        await pilot.press("2")
        await until(pilot, lambda a: bool(a.state.autoscale) and not a._dirty, "GET /autoscale")
        assert ("GET", "autoscale", None) in client.calls
        rows = {r[0]: r[AUTOSCALE_COLUMN] for r in table_rows(app, "#models-table")}
        assert rows["llama-8b"] == "3/2/1 [1–4] stable" and rows["qwen-7b"] == "—"
        detail = app.screen.query_one("#replica-detail", Static)
        assert str(detail.render()).startswith("llama-8b/1a2b3c")  # the replicas table has the focus
        app.screen.query_one("#models-table", DataTable).focus()
        await pilot.press("down")  # ext-model → llama-8b
        await until(pilot, lambda a: str(detail.render()).startswith("llama-8b: autoscaled"), "the model's detail")
        assert "2 → 3  stable" in str(detail.render())
        await pilot.press("tab")  # back to the replicas: their detail again
        await until(pilot, lambda a: str(detail.render()).startswith("llama-8b/1a2b3c"), "the replica's detail")

    drive(script)


def test_a_daemon_answering_404_shows_no_autoscale_and_no_error() -> None:
    async def script(pilot: Pilot[Any], app: ConsoleApp, client: FakeClient) -> None:
        await pilot.press("2")
        await until(pilot, lambda a: ("GET", "autoscale", None) in client.calls and not a._dirty, "the fetch")
        await pilot.pause()
        assert {r[AUTOSCALE_COLUMN] for r in table_rows(app, "#models-table")} == {"—"}
        assert not app._notifications

    drive(script, autoscaled=None)


def test_the_admin_client_takes_a_404_for_no_autoscaling() -> None:
    def answer(status: int, body: Any) -> httpx.MockTransport:
        return httpx.MockTransport(lambda req: httpx.Response(status, json=body))

    async def go() -> None:
        c = AdminClient(url="http://admin.test")
        for status, body, want in ((200, [AUTOSCALE[0]], [AUTOSCALE[0]]), (200, {"x": 1}, []),
                                   (404, {"error": {"message": "Unknown route"}}, None)):
            await c._http.aclose()
            c._http = httpx.AsyncClient(transport=answer(status, body), base_url="http://admin.test")
            assert await c.autoscale() == want
        c._http = httpx.AsyncClient(transport=answer(500, {"error": {"message": "boom"}}), base_url="http://x")
        try:
            await c.autoscale()
        except AdminRefused as e:
            assert e.status == 500
        else:
            raise AssertionError("a 500 is an error, not a daemon without autoscaling")
        await c.aclose()

    asyncio.run(go())
