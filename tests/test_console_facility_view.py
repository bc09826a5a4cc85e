"""The console's Facility view: domains with their holds, nodes, replicas and draw vs cap, as plain
rows (no terminal), and driven with Textual's pilot: `6` shows it (fetched from the daemon), `h`
holds or releases the selected domain."""

from __future__ import annotations

from typing import Any

from textual.pilot import Pilot
from textual.widgets import DataTable

from llmgw.tui.app import ConsoleApp
from llmgw.tui.facility_rows import (
    facility_detail,
    facility_rows,
    facility_summary_lines,
    fmt_watts,
)
from llmgw.tui.facility_screens import HoldEditor
from llmgw.tui.state import ConsoleState

from .test_console import drive, until
from .test_console_fakes import FakeClient

VIEW = {
    "domains": [
        {"domain": "row=r3", "level": "row", "parent": None, "nodes": 4, "ready_nodes": 3, "replicas": 5,
         "held": False, "hold_reason": "", "hold_drain": False, "draw_w": 41000.0, "cap_w": 180000.0,
         "unknown_power_nodes": 1},
        {"domain": "rack=r12", "level": "rack", "parent": "row=r3", "nodes": 2, "ready_nodes": 2, "replicas": 2,
         "held": True, "hold_reason": "PDU swap", "hold_drain": True, "draw_w": 1500.0, "cap_w": None,
         "unknown_power_nodes": 0},
        {"domain": "pdu=p7", "level": "pdu", "parent": "rack=r12", "nodes": 2, "ready_nodes": 2, "replicas": 2,
         "held": False, "hold_reason": "", "hold_drain": False, "draw_w": 11000.0, "cap_w": 11000.0,
         "unknown_power_nodes": 0},
        {"domain": "pdu=p8", "level": "pdu", "parent": "rack=r13", "nodes": 2, "ready_nodes": 2, "replicas": 1,
         "held": False, "hold_reason": "", "hold_drain": False, "draw_w": 9950.0, "cap_w": 11000.0,
         "unknown_power_nodes": 0},
    ],
    "holds": [{"domain": "rack=r12", "reason": "PDU swap", "drain": True, "created_at": 1.0, "replicas": 2}],
    "budgets_without_nodes": ["pdu=p99"], "warnings": ["node x: measured 99999 W ignored"],
}


def test_facility_rows_show_holds_and_draw_against_the_cap() -> None:
    st = ConsoleState()
    assert facility_rows(st) == [] and "no facility view yet" in facility_summary_lines(st)[0]
    assert st.put_facility(VIEW) == frozenset({"facility"})
    rows = {r.key: r for r in facility_rows(st)}
    assert list(rows) == ["row=r3", "rack=r12", "pdu=p7", "pdu=p8"]  # the daemon's order, outermost first
    assert rows["row=r3"].cells == ("row=r3", "row", "", "3/4", "5", "41.0 kW (+1 unknown)", "180.0 kW", "23%", "—")
    assert rows["row=r3"].tone == "warn"  # a node not ready
    assert rows["rack=r12"].cells[2] == "drain: PDU swap" and rows["rack=r12"].tone == "busy"
    assert rows["rack=r12"].cells[6:8] == ("—", "—")  # no budget
    assert rows["pdu=p7"].cells[7] == "100%" and rows["pdu=p7"].tone == "bad"
    assert rows["pdu=p8"].tone == "warn"  # past 90% of its budget
    assert [r.key for r in facility_rows(st, "drain")] == ["rack=r12"]
    summary = "\n".join(facility_summary_lines(st))
    assert "4 domains · 1 held · rack=r12 (drain): 2 replicas left" in summary
    assert "at or past budget: pdu=p7" in summary and "pdu=p99" in summary and "99999 W ignored" in summary
    assert facility_detail(st, "rack=r12")[1].startswith("held with drain: PDU swap")
    assert facility_detail(st, "nope") == []
    assert fmt_watts(950) == "950 W" and fmt_watts(-1) == "—" and fmt_watts(True) == "—"


def test_facility_rows_survive_junk() -> None:
    st = ConsoleState()
    st.put_facility({"domains": [1, {"domain": 7, "draw_w": "x", "cap_w": 0, "nodes": None}, None],
                     "holds": "no", "warnings": [3]})
    (row,) = facility_rows(st)
    assert row.cells[0] == "?" and row.cells[7] == "—"
    assert facility_summary_lines(st)[0].startswith("1 domains · 0 held")
    st.put_facility(["not", "a", "dict"])
    assert facility_rows(st) == []


def test_holding_a_domain_from_the_facility_view() -> None:
    async def script(pilot: Pilot[Any], app: ConsoleApp, client: FakeClient) -> None:
        await pilot.press("7")
        await until(pilot, lambda a: a.query_one("#facility-table", DataTable).row_count == 3, "the facility rows")
        await pilot.press("h")  # the first row: rack=r12
        assert isinstance(app.screen, HoldEditor) and app.screen.domains == ["rack=r12"]
        await pilot.press(*"rack drain swap", "enter")
        await until(pilot, lambda a: ("HOLD", "rack=r12", ("swap", True)) in client.calls, "the hold call")

        def held(a: ConsoleApp) -> bool:
            t = a.query_one("#facility-table", DataTable)
            return "drain: swap" in str(t.get_row("rack=r12"))

        await until(pilot, held, "the refetched facility, rack=r12 held")
        await pilot.press("h")
        await pilot.press(*"release rack", "enter")
        await until(pilot, lambda a: ("RELEASE", "rack=r12", None) in client.calls, "the release call")

    drive(script)


def test_canned_and_sample_facility_answers_match_the_admin_document() -> None:
    import asyncio

    from .test_console_fakes import _validator

    client = FakeClient()
    client.calls.append(("HOLD", "rack=r12", ("swap", True)))
    for view in (VIEW, asyncio.run(client.facility())):
        errors = [f"{e.instance_path}: {e.message}" for e in _validator("FacilityView").iter_errors(view)]
        assert not errors, errors[:5]
