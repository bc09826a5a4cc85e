"""The console's facility dialogs: `h` on a node holds or releases one of its domains, `p` in
Models shows a placement's explanation (driven with Textual's pilot against the fake client)."""

from __future__ import annotations

from typing import Any

import pytest
from textual.pilot import Pilot
from textual.widgets import Input, Static

from llmgw.tui.app import ConsoleApp
from llmgw.tui.facility_screens import HoldEditor, PlacementScreen
from llmgw.tui.holds import HoldEdit, parse_hold_edit

from .test_console import drive, until
from .test_console_fakes import FakeClient

DOMAINS = ["site=dc1", "room=hall-a", "row=row3", "rack=r12", "pdu=pdu-2"]


def test_parse_hold_edit() -> None:
    assert parse_hold_edit("rack", DOMAINS) == HoldEdit("hold", "rack=r12")
    assert parse_hold_edit("row drain PDU swap", DOMAINS) == HoldEdit("hold", "row=row3", True, "PDU swap")
    assert parse_hold_edit("release pdu", DOMAINS) == HoldEdit("release", "pdu=pdu-2")
    assert parse_hold_edit("hold llmgw.io/rack=r7 maintenance", DOMAINS) == HoldEdit("hold", "rack=r7", False,
                                                                                      "maintenance")
    for bad, msg in (("", "name a level"), ("room", "no room label"), ("shelf=1", "LEVEL one of"),
                     ("release rack drain", "release takes only the domain")):
        with pytest.raises(ValueError, match=msg):
            parse_hold_edit(bad, DOMAINS if bad != "room" else ["rack=r12"])


def test_holding_a_node_s_rack_from_the_console() -> None:
    async def script(pilot: Pilot[Any], app: ConsoleApp, client: FakeClient) -> None:
        await pilot.press("1", "down", "h")  # gpu-a1: dc1/hall-a/row3/r12/pdu-2
        assert isinstance(app.screen, HoldEditor) and "rack=r12" in " ".join(app.screen.domains)
        await pilot.press(*"shelf", "enter")  # refused in the dialog, nothing sent
        assert isinstance(app.screen, HoldEditor) and client.calls == []
        assert "LEVEL one of" in str(app.screen.query_one("#hold-error", Static).render())
        app.screen.query_one("#hold-input", Input).value = ""
        await pilot.press(*"rack drain swap", "enter")
        await until(pilot, lambda a: bool(client.calls), "the hold call")
        assert client.calls == [("HOLD", "rack=r12", ("swap", True))]
        await until(pilot, lambda a: any("held rack=r12 with drain" in n.message for n in a._notifications))

    drive(script)


def test_explaining_a_placement_from_the_console() -> None:
    async def script(pilot: Pilot[Any], app: ConsoleApp, client: FakeClient) -> None:
        await pilot.press("2", "p")  # the first replica
        await until(pilot, lambda a: isinstance(a.screen, PlacementScreen), "the explanation")
        assert [c[:2] for c in client.calls if c[0] != "GET"] == [("EXPLAIN", "llama-8b/1a2b3c")]  # GETs: autoscale
        text = str(app.screen.query_one("#placement-text", Static).render())
        assert "placed on gpu-a1" in text and "held" in text and "in held domain rack=r2" in text
        await pilot.press("escape")
        assert not isinstance(app.screen, PlacementScreen)

    drive(script)
