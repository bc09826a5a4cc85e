"""The console opens a request's trace from the Decisions view and from a rationale (t), headless
(Textual's pilot: no terminal), with a fake admin API."""

from __future__ import annotations

from typing import Any

from textual.pilot import Pilot
from textual.widgets import Static

from llmgw.tui.app import ConsoleApp
from llmgw.tui.rationale import RationaleScreen
from llmgw.tui.trace_screen import TraceScreen
from tests.test_console import drive
from tests.test_console_fakes import FakeClient


async def _until(pilot: Pilot[Any], cond: Any) -> None:
    for _ in range(200):  # bounded: each pause lets the worker and the screen stack move
        if cond():
            return
        await pilot.pause()
    raise AssertionError("condition not reached")


def _text(app: ConsoleApp) -> str:
    return str(app.screen.query_one("#trace-text", Static).render())


def test_t_on_a_decision_opens_its_requests_trace() -> None:
    async def script(pilot: Pilot[Any], app: ConsoleApp, client: FakeClient) -> None:
        await pilot.press("3", "down", "t")  # the second newest: req-0007
        await _until(pilot, lambda: isinstance(app.screen, TraceScreen))
        assert app.screen.sub_title == "trace of req-0007"
        text = _text(app)
        assert "request req-0007  chat  model llama-8b  stream" in text
        assert "retry after attempt 1: connect" in text and "#2 llama-8b/4d5e6f on gpu-a2: ok 200" in text
        assert "decision 1 of `llmgw ctl explain req-0007`" in text
        assert ("GET", "trace", "req-0007") in client.calls
        await pilot.press("escape")
        assert not isinstance(app.screen, TraceScreen)

    drive(script)


def test_t_in_a_rationale_opens_the_trace_and_esc_comes_back() -> None:
    async def script(pilot: Pilot[Any], app: ConsoleApp, client: FakeClient) -> None:
        await pilot.press("3", "enter")
        assert isinstance(app.screen, RationaleScreen)
        rid = app.screen.request_id
        await pilot.press("t")
        await _until(pilot, lambda: isinstance(app.screen, TraceScreen))
        assert app.screen.sub_title == f"trace of {rid}"
        await pilot.press("escape")
        assert isinstance(app.screen, RationaleScreen)

    drive(script)


def test_a_trace_that_left_the_ring_is_a_notice_not_a_crash() -> None:
    async def script(pilot: Pilot[Any], app: ConsoleApp, client: FakeClient) -> None:
        app.open_trace("gone-1")
        await _until(pilot, lambda: ("GET", "trace", "gone-1") in client.calls and app._notifications)
        assert not isinstance(app.screen, TraceScreen)
        assert any("no trace of gone-1" in n.message for n in app._notifications)

    drive(script)


def test_the_canned_trace_is_what_the_daemon_answers() -> None:
    from tests.test_console_fakes import _validator, trace_of

    errors = [f"{e.instance_path}: {e.message}" for e in _validator("TraceView").iter_errors(trace_of("req-0001"))]
    assert not errors, errors[:5]
