"""The console app, driven by a fake daemon: snapshots of every view (SVGs in the top-level
snapshots/ folder; `--snapshot-update` rewrites them) and pilot-driven interactions. Deterministic:
a fixed terminal size, canned data, wall times in UTC, ages from the data, no blinking cursor,
and a backoff that stops after a known number of attempts."""

from __future__ import annotations

import asyncio
import importlib.util
import subprocess
import sys
from collections.abc import Awaitable, Callable
from datetime import UTC
from pathlib import Path
from typing import Any

import pytest
from textual.pilot import Pilot
from textual.widgets import DataTable, Input, Static, TabbedContent

from llmgw.config.defaults import default_admin_socket
from llmgw.tui.app import ConsoleApp
from llmgw.tui.client import DaemonUnreachable
from llmgw.tui.label_editor import LabelEditor
from llmgw.tui.main import TOKEN_ENV, UsageError, client_from_args
from llmgw.tui.main import main as console_main
from llmgw.tui.rationale import RationaleScreen
from tests.test_console_fakes import (
    ENDPOINTS,
    LIVE_DECISIONS,
    REPLICAS,
    Connection,
    FakeClient,
    StopAfter,
    snapshot,
    stream,
)

SIZE = (120, 36)
Cond = Callable[[ConsoleApp], bool]


def console(**client_args: Any) -> tuple[ConsoleApp, FakeClient]:
    client = FakeClient(**client_args)
    app = ConsoleApp(client, tz=UTC, backoff=StopAfter(3), redraw_s=0.02,
                     redraw_budget=1.0)
    app.animation_level = "none"  # tab underlines slide otherwise, and each pilot key waits for them
    return app, client


def loaded(app: ConsoleApp) -> bool:
    """The whole canned stream (revs 1..5) is applied and on screen."""
    return app.shown_rev >= 5 and not app._dirty


def dropped(app: ConsoleApp) -> bool:
    """The stream dropped and the third attempt failed (after which StopAfter(3) waits an hour)."""
    return app.state.link.attempt >= 3 and app.query_one("#banner").display


async def until(pilot: Pilot[Any], cond: Cond, what: str = "the console to settle") -> None:
    for _ in range(300):
        if cond(pilot.app):  # type: ignore[arg-type]
            await pilot.pause()
            return
        await pilot.pause(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def drive(script: Callable[[Pilot[Any], ConsoleApp, FakeClient], Awaitable[None]], **client_args: Any) -> None:
    app, client = console(**client_args)

    async def go() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, loaded)
            await script(pilot, app, client)

    asyncio.run(go())


def table_rows(app: ConsoleApp, selector: str) -> list[list[str]]:
    table = app.screen.query_one(selector, DataTable)
    return [[str(c) for c in table.get_row_at(i)] for i in range(table.row_count)]


# -- snapshots --------------------------------------------------------------------------------------------
@pytest.fixture
def snap(request: pytest.FixtureRequest) -> Callable[..., bool]:
    pytest.importorskip("pytest_textual_snapshot")
    compare: Callable[..., bool] = request.getfixturevalue("snap_compare")

    def check(press: tuple[str, ...] = (), cond: Cond = loaded, *, first: tuple[str, ...] = (),
              then: Cond | None = None, **client_args: Any) -> bool:
        """``first``: keys pressed once settled, then waited on with ``then`` (data a view fetches)."""
        app, _ = console(**client_args)

        async def settle(pilot: Pilot[Any]) -> None:
            await until(pilot, cond)
            if first:
                await pilot.press(*first)
            if then is not None:
                await until(pilot, then, "the view's fetched data")

        return compare(app, press=press, terminal_size=SIZE, run_before=settle)

    return check


def test_snapshot_nodes(snap: Callable[..., bool]) -> None:
    assert snap(press=("down",))


def autoscale_shown(app: ConsoleApp) -> bool:
    """GET /api/v1/autoscale answered and the Models view redrawn with it."""
    return bool(app.state.autoscale) and not app._dirty and not app.active_view().stale


def test_snapshot_models(snap: Callable[..., bool]) -> None:
    assert snap(first=("2",), then=autoscale_shown)


def test_snapshot_decisions(snap: Callable[..., bool]) -> None:
    assert snap(press=("3",))


def test_snapshot_rationale(snap: Callable[..., bool]) -> None:
    assert snap(press=("3", "down", "enter"))


def test_snapshot_cache(snap: Callable[..., bool]) -> None:
    assert snap(press=("4",))


def test_snapshot_adapters(snap: Callable[..., bool]) -> None:
    assert snap(press=("5",))


def test_snapshot_help(snap: Callable[..., bool]) -> None:
    assert snap(press=("question_mark",))


def test_snapshot_label_editor(snap: Callable[..., bool]) -> None:
    assert snap(press=("down", "l", *"rack=r14"))


def test_snapshot_unreachable(snap: Callable[..., bool]) -> None:
    assert snap(cond=dropped, connections=[Connection(stream(), then=DaemonUnreachable(
        "peer closed connection without sending complete message body"))])


# -- interactions -----------------------------------------------------------------------------------------
def test_number_keys_switch_views_and_help_is_one_key_away() -> None:
    async def script(pilot: Pilot[Any], app: ConsoleApp, client: FakeClient) -> None:
        tabs = app.query_one("#views", TabbedContent)
        for key, view in (("2", "models"), ("3", "decisions"), ("4", "cache"), ("question_mark", "help"),
                          ("1", "nodes")):
            await pilot.press(key)
            assert tabs.active == view
        await pilot.press("4")
        assert table_rows(app, "#cache-models-table")[0][:3] == ["llama-8b", "81%", "170/40"]

    drive(script)


def test_cache_view_drops_a_replica_a_scale_down_removed() -> None:
    """The fleet's update alone (no new cache summary) takes the replica's row off the Cache hits view."""
    async def script(pilot: Pilot[Any], app: ConsoleApp, client: FakeClient) -> None:
        await pilot.press("4")
        assert [r[0] for r in table_rows(app, "#cache-replicas-table")] == [
            "llama-8b/1a2b3c", "llama-8b/4d5e6f", "qwen-7b/c0ffee"]
        gone = "llama-8b/4d5e6f"
        app._on_event({"type": "update", "rev": 6, "replicas": [r for r in REPLICAS if r["replica"] != gone],
                       "endpoints": [e for e in ENDPOINTS if e["id"] != gone]})
        await until(pilot, loaded)
        assert [r[0] for r in table_rows(app, "#cache-replicas-table")] == ["llama-8b/1a2b3c", "qwen-7b/c0ffee"]
        assert "1 replica no longer in the fleet" in str(app.screen.query_one("#cache-total", Static).render())

    drive(script)


def test_text_from_agents_cannot_drive_the_terminal() -> None:
    """A replica's log line and a scrape error hold escape sequences: shown escaped, not obeyed."""
    async def script(pilot: Pilot[Any], app: ConsoleApp, client: FakeClient) -> None:
        evil = "\x1b[2J\x1b]0;owned\x07"
        reps = [{**r, "log_tail": [f"INFO {evil}done"]} if i == 0 else r for i, r in enumerate(REPLICAS)]
        eps = [{**e, "scrape_error": f"connect: {evil}"} if i == 0 else e for i, e in enumerate(ENDPOINTS)]
        app._on_event({"type": "update", "rev": 6, "replicas": reps, "endpoints": eps})
        await pilot.press("2")
        await until(pilot, loaded)
        detail = str(app.screen.query_one("#replica-detail", Static).render())
        assert "\x1b" not in detail and "\\x1b[2J\\x1b]0;owned\\x07done" in detail
        cells = [c for row in table_rows(app, "#replicas-table") for c in row]
        assert not any("\x1b" in c for c in cells)

    drive(script)


def test_selecting_a_decision_shows_its_rationale() -> None:
    async def script(pilot: Pilot[Any], app: ConsoleApp, client: FakeClient) -> None:
        await pilot.press("3", "down", "enter")  # the second newest: req-0007
        assert isinstance(app.screen, RationaleScreen)
        cands = table_rows(app, "#candidates-table")
        assert cands == [["▶ llama-8b/4d5e6f", "1.00", "0.50", "0.58", "4.58", "prefix 12/16 blocks"],
                         ["  llama-8b/1a2b3c", "0.25", "0.83", "0.82", "3.23", ""]]
        assert [r[0] for r in table_rows(app, "#drops-table")] == ["breaker", "ready"]
        await pilot.press("escape")
        assert not isinstance(app.screen, RationaleScreen)
        await pilot.press("3", "down", "enter", "2")  # a number key leaves the rationale for that view
        assert not isinstance(app.screen, RationaleScreen)
        assert app.query_one("#views", TabbedContent).active == "models"

    drive(script)


def test_filtering_decisions() -> None:
    async def script(pilot: Pilot[Any], app: ConsoleApp, client: FakeClient) -> None:
        await pilot.press("3", "slash", *"qwen")
        assert [r[1] for r in table_rows(app, "#decisions-table")] == ["req-0008", "req-0004"]
        app.query_one("#filter-decisions", Input).value = ""
        await pilot.press(*"1a")
        assert [r[3] for r in table_rows(app, "#decisions-table")] == ["llama-8b/1a2b3c"] * 3
        assert app.query_one("#views", TabbedContent).active == "decisions"  # "1" went into the filter
        await pilot.press("enter", "enter")  # back to the list, then its first row's rationale
        assert isinstance(app.screen, RationaleScreen)
        assert app.screen.sub_title == "rationale of req-0005"
        await pilot.press("escape", "slash", "escape")  # escape in the filter clears it
        assert len(table_rows(app, "#decisions-table")) == 8

    drive(script)


def test_live_decisions_keep_the_cursor_on_the_newest_row() -> None:
    async def script(pilot: Pilot[Any], app: ConsoleApp, client: FakeClient) -> None:
        await pilot.press("3")
        app._on_event({"type": "decision", "rev": 6, "decision": {**LIVE_DECISIONS[0], "request_id": "req-0100"}})
        await until(pilot, loaded)
        table = app.query_one("#decisions-table", DataTable)
        assert table.cursor_row == 0 and table_rows(app, "#decisions-table")[0][1] == "req-0100"
        await pilot.press("down", "down")  # away from the top, the cursor stays on its decision
        app._on_event({"type": "decision", "rev": 7, "decision": {**LIVE_DECISIONS[0], "request_id": "req-0101"}})
        await until(pilot, loaded)
        assert table_rows(app, "#decisions-table")[table.cursor_row][1] == "req-0007"

    drive(script)


def test_setting_a_label_on_a_node() -> None:
    async def script(pilot: Pilot[Any], app: ConsoleApp, client: FakeClient) -> None:
        await pilot.press("1", "down", "l")  # gpu-a1
        assert isinstance(app.screen, LabelEditor)
        await pilot.press(*"nonsense", "enter")  # refused in the dialog, nothing sent
        assert isinstance(app.screen, LabelEditor) and client.calls == []
        assert "key=value" in str(app.screen.query_one("#label-error", Static).render())
        app.screen.query_one("#label-input", Input).value = ""
        await pilot.press(*"rack=r9 tier-", "enter")
        await until(pilot, lambda a: len(client.calls) == 2, "the label calls")
        # rack is the facility's short key (issue 16): llmgw.io/rack
        assert client.calls == [("PUT", "gpu-a1", {"llmgw.io/rack": "r9"}), ("DELETE", "gpu-a1", ["tier"])]
        await until(pilot, loaded)
        detail = str(app.query_one("#node-detail", Static).render())
        assert "llmgw.io/rack=r9*" in detail and "tier=" not in detail  # the daemon's answer, shown at once

    drive(script)


def test_a_refused_label_is_reported_and_changes_nothing() -> None:
    async def script(pilot: Pilot[Any], app: ConsoleApp, client: FakeClient) -> None:
        await pilot.press("1", "l", *"a=b", "enter")
        await until(pilot, lambda a: bool(client.calls) and bool(a._notifications), "the refusal")
        assert "cpu-b1: labels not changed: 400: no such thing" in [n.message for n in app._notifications]
        assert app.state.node("cpu-b1")["operator_labels"] == {}  # type: ignore[index]

    drive(script, refuse_labels="no such thing")


def test_the_banner_shows_while_the_daemon_is_away_and_goes_when_it_is_back() -> None:
    back = asyncio.Event()
    again = snapshot(rev=1)
    again["decisions"] = [*again["decisions"], *LIVE_DECISIONS]

    class Gated(FakeClient):
        async def events(self):  # type: ignore[no-untyped-def,override]
            if self.attempts == 2:  # the third connection waits for the daemon to be "back"
                await back.wait()
            async for line in super().events():
                yield line

    client = Gated(connections=[Connection(stream(), then=DaemonUnreachable("peer closed connection")),
                                Connection([], then=DaemonUnreachable("[Errno 2] No such file or directory")),
                                Connection([again])])
    app = ConsoleApp(client, tz=UTC, backoff=StopAfter(10), redraw_s=0.02,
                     redraw_budget=1.0)
    app.animation_level = "none"

    async def go() -> None:
        async with app.run_test(size=SIZE) as pilot:
            banner = app.query_one("#banner", Static)
            await until(pilot, lambda a: a.state.link.attempt == 2, "the second failure")
            assert banner.display
            assert str(banner.render()).startswith(f"daemon unreachable at {client.where} — retrying (attempt 2)")
            assert len(table_rows(app, "#nodes-table")) == 4  # the last data stays on screen
            back.set()
            await until(pilot, lambda a: a.state.link.connected and not a._dirty, "the reconnection")
            assert not banner.display and app.state.snapshots == 2
            assert len(app.state.decisions) == 8  # the new snapshot's decisions did not repeat

    asyncio.run(go())


def test_quit_closes_the_client_and_default_redraw_settings_settle() -> None:
    client = FakeClient()
    app = ConsoleApp(client, tz=UTC)  # the redraw interval and budget an operator gets

    async def go() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, loaded)
            await pilot.press("q")

    asyncio.run(go())
    assert client.closed


# -- the command line ---------------------------------------------------------------------------------------
def test_command_line_picks_socket_url_token_and_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert client_from_args([]).where == f"unix:{default_admin_socket()}"
    assert client_from_args(["--socket", "/x/admin.sock"]).where == "unix:/x/admin.sock"
    with pytest.raises(UsageError, match="--url needs a token") as no_token:
        client_from_args(["--url", "http://10.0.0.5:7071"])
    assert no_token.value.code == 2
    c = client_from_args(["--url", "http://10.0.0.5:7071/", "--token", "t0k"])
    assert c.where == "http://10.0.0.5:7071" and c._http.headers["authorization"] == "Bearer t0k"
    monkeypatch.setenv(TOKEN_ENV, "from-env")
    assert client_from_args(["--url", "http://h:1"])._http.headers["authorization"] == "Bearer from-env"
    monkeypatch.delenv(TOKEN_ENV)
    cfg = tmp_path / "llmgw.toml"
    cfg.write_text(f'[admin]\nsocket = "{tmp_path}/a.sock"\ntcp = "127.0.0.1:7071"\ntoken = "cfg-token"\n')
    assert client_from_args(["--config", str(cfg)]).where == f"unix:{tmp_path}/a.sock"
    by_url = client_from_args(["--config", str(cfg), "--url", "http://127.0.0.1:7071"])
    assert by_url._http.headers["authorization"] == "Bearer cfg-token"
    with pytest.raises(UsageError, match="cannot read"):
        client_from_args(["--config", str(tmp_path / "missing.toml")])
    assert console_main(["--config", str(tmp_path / "missing.toml")]) == 1


# -- the daemon never imports the console -----------------------------------------------------------------
def test_daemon_cli_and_pure_console_modules_do_not_import_textual() -> None:
    modules = ["llmgw.daemon.main", "llmgw.daemon.control.admin.server", "llmgw.cli", "llmgw.tui.state", "llmgw.tui.rows",
               "llmgw.tui.client", "llmgw.tui.labels", "llmgw.tui.main"]
    if importlib.util.find_spec("llmgw.cli.ctl.main") is not None:
        modules.append("llmgw.cli.ctl.main")
    code = (f"import sys, importlib\nfor m in {modules!r}: importlib.import_module(m)\n"
            "bad = sorted(m for m in sys.modules if m == 'textual' or m.startswith('textual.'))\n"
            "assert not bad, bad[:5]\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_split_requests_decisions_say_their_step() -> None:
    from llmgw.tui.rows import _note
    assert _note({"phase": "prefill", "note": ""}) == "prefill step"
    assert _note({"phase": "decode", "note": "retry after attempt 2"}) == "decode step; retry after attempt 2"
    assert _note({"note": "x"}) == "x" and _note({"phase": "", "note": ""}) == ""


def test_the_models_view_shows_a_disaggregated_models_groups() -> None:
    from llmgw.tui.rows import model_rows
    from llmgw.tui.state import ConsoleState
    st = ConsoleState()
    st.models = [{"name": "m", "engine": "vllm", "source": "file", "replicas": 3, "ready": 3, "desired_replicas": 3,
                  "static_replicas": 0, "groups": [{"role": "prefill", "desired": 1, "replicas": 1, "ready": 1},
                                                   {"role": "decode", "desired": 2, "replicas": 2, "ready": 2}]}]
    (row,) = model_rows(st)
    assert "3 (prefill 1/1, decode 2/2)" in row.cells
