"""The console against a real admin API: the whole admin stack (tests/admin_support.py) runs on
trio in a thread, the console's client and app on asyncio in the test's thread, as in real life
(two processes, one socket). Covers what a fake cannot: the wire, the token, a daemon restart."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from datetime import UTC
from pathlib import Path
from typing import Any

import pytest
import trio

from llmgw.tui.client import AdminClient, AdminRefused, DaemonUnreachable

admin_support = pytest.importorskip("tests.admin_support")  # needs schemathesis' jsonschema_rs


class DaemonThread:
    """One admin stack at a time on a fixed socket path; start() again after stop() is a restart."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.stack: Any = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> Any:
        ready = threading.Event()
        failure: list[BaseException] = []

        async def main() -> None:
            self._token = trio.lowlevel.current_trio_token()
            self._stop = trio.Event()
            async with admin_support.admin_stack(self.tmp, events_tick_s=0.2, ping_s=1.0,
                                                 decisions_poll_s=0.02) as stack:
                self.stack = stack
                ready.set()
                await self._stop.wait()

        def run() -> None:
            try:
                trio.run(main)
            except BaseException as e:  # noqa: BLE001 — surfaced by start() if it never got ready
                failure.append(e)
                ready.set()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        assert ready.wait(20), "the admin stack did not start"
        if failure:
            raise failure[0]
        return self.stack

    def stop(self) -> None:
        if self._thread is not None and self._stop is not None and self._token is not None:
            trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
            self._thread.join(20)
            self._thread = None

    async def chat(self, request_id: str) -> None:
        """A chat request through the router (on the daemon's trio loop), so a decision happens."""
        r = await asyncio.to_thread(trio.from_thread.run, self.stack.chat, f"hello from the console test {request_id}",
                                    request_id, trio_token=self._token)
        assert r.status_code == 200, r.text


@pytest.fixture
def daemon(tmp_path: Path) -> Any:
    d = DaemonThread(tmp_path)
    d.start()
    yield d
    d.stop()


async def _next(it: AsyncIterator[dict[str, Any]], match: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    async with asyncio.timeout(10):
        async for ev in it:
            if match(ev):
                return ev
    raise AssertionError("the stream ended")


def test_client_follows_events_and_sets_labels(daemon: DaemonThread, tmp_path: Path) -> None:
    async def go() -> None:
        client = AdminClient(socket=daemon.stack.socket)
        try:
            events = client.events()
            snap = await _next(events, lambda e: True)
            assert snap["type"] == "snapshot" and [m["name"] for m in snap["models"]] == ["m"]
            await daemon.chat("console-1")
            ev = await _next(events, lambda e: e["type"] == "decision")
            assert ev["decision"]["request_id"] == "console-1" and ev["decision"]["chosen"] == "m/0"
            await events.aclose()

            node = await client.set_labels("rack-node", {"llmgw.io/rack": "r12", "tier": "prod"})
            assert node["operator_labels"] == {"llmgw.io/rack": "r12", "tier": "prod"}
            node = await client.remove_labels("rack-node", ["tier"])
            assert node["operator_labels"] == {"llmgw.io/rack": "r12"}
            with pytest.raises(AdminRefused) as bad:
                await client.set_labels("rack-node", {"bad key!": "x"})
            assert bad.value.status == 400 and "bad key!" in str(bad.value)
        finally:
            await client.aclose()

        tcp = AdminClient(url=daemon.stack.tcp_url, token=admin_support.TOKEN)
        wrong = AdminClient(url=daemon.stack.tcp_url, token="wrong")
        gone = AdminClient(socket=str(tmp_path / "nowhere.sock"))
        try:
            assert (await _next(tcp.events(), lambda e: True))["type"] == "snapshot"
            with pytest.raises(AdminRefused, match="401"):
                await _next(wrong.events(), lambda e: True)
            with pytest.raises(DaemonUnreachable):
                await _next(gone.events(), lambda e: True)
        finally:
            for c in (tcp, wrong, gone):
                await c.aclose()

    asyncio.run(go())


def test_console_watches_decisions_live_and_survives_a_daemon_restart(daemon: DaemonThread) -> None:
    from textual.widgets import DataTable, Static

    from llmgw.tui.app import ConsoleApp

    app = ConsoleApp(AdminClient(socket=daemon.stack.socket), tz=UTC, redraw_s=0.05, redraw_budget=1.0)
    app.animation_level = "none"

    async def wait(cond: Callable[[], bool], what: str) -> None:
        try:
            async with asyncio.timeout(15):
                while not cond():
                    await asyncio.sleep(0.02)
        except TimeoutError:
            raise AssertionError(f"timed out waiting for {what} (link: {app.state.link})") from None

    def decisions() -> list[str]:
        table = app.query_one("#decisions-table", DataTable)
        return [str(table.get_row_at(i)[1]) for i in range(table.row_count)]

    async def go() -> None:
        async with app.run_test(size=(120, 36)) as pilot:
            await wait(lambda: app.state.link.connected, "the snapshot")
            await pilot.press("3")
            await daemon.chat("live-1")
            await wait(lambda: "live-1" in decisions(), "the decision on screen")
            banner = app.query_one("#banner", Static)
            assert not banner.display

            await asyncio.to_thread(daemon.stop)
            await wait(lambda: bool(banner.display), "the unreachable banner")
            assert "daemon unreachable at unix:" in str(banner.render())

            await asyncio.to_thread(daemon.start)
            await wait(lambda: app.state.snapshots >= 2 and app.state.link.connected and not banner.display,
                       "the reconnection")
            await daemon.chat("live-2")
            await wait(lambda: "live-2" in decisions(), "a decision after the restart")
            assert "live-1" in decisions()  # the history from before the restart is kept

    asyncio.run(go())
