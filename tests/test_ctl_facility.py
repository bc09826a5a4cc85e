"""How `llmgw ctl facility` and `ctl explain-placement` print the admin API's answers."""

from __future__ import annotations

from llmgw.cli.ctl.main import parser
from llmgw.admin_client.facility import explanation_text, facility_text


def test_facility_text_shows_holds_power_and_problems() -> None:
    data = {"domains": [
        {"domain": "rack=r1", "parent": "row=a", "nodes": 2, "ready_nodes": 1, "replicas": 3, "held": True,
         "hold_reason": "swap\x1b[2J", "hold_drain": True, "draw_w": 5500.0, "cap_w": 11000.0},
        {"domain": "pdu=p1", "parent": None, "nodes": 1, "ready_nodes": 1, "replicas": 0, "held": False,
         "hold_reason": "", "hold_drain": False, "draw_w": 0.0, "cap_w": None}],
        "holds": [{"domain": "rack=r9", "reason": "", "drain": False}], "budgets_without_nodes": ["pdu=p9"],
        "warnings": ["node x: measured power -5.0 W is absurd"]}
    text = facility_text(data)
    assert "rack=r1" in text and "1/2" in text and "5,500 W" in text and "11,000 W" in text and "50%" in text
    assert "held (drain): swap\\x1b[2J" in text and "\x1b" not in text  # escaped, never sent raw
    assert "held, with no node in it now: rack=r9" in text and "budget for a domain no node is in: pdu=p9" in text
    assert "warning: node x: measured power -5.0 W is absurd" in text
    assert "no node has facility labels" in facility_text({"domains": []})


def test_explanation_text() -> None:
    e = {"model": "m", "replica": None, "node": None, "why": "1 replica cannot be placed", "counts": {"power": 2},
         "truncated": 3, "warnings": [], "candidates": [
             {"node": "a", "verdict": "power", "detail": "pdu=p1 would draw 1540 W of its 1000 W budget",
              "domains": ["rack=r-a", "pdu=p1"]}]}
    text = explanation_text(e)
    assert text.splitlines()[0] == "model m: its next replica" and "2 power" in text
    assert "rack=r-a/pdu=p1" in text and "1000 W budget" in text and "... and 3 more" in text


def test_facility_commands_parse() -> None:
    ns = parser().parse_args(["facility", "hold", "rack=r1", "--drain", "--reason", "x"])
    assert (ns.action, ns.domain, ns.drain, ns.reason) == ("hold", "rack=r1", True, "x")
    assert parser().parse_args(["explain-placement", "m/abc"]).target == "m/abc"


def test_the_console_label_editor_takes_short_facility_keys() -> None:
    import pytest

    from llmgw.tui.labels import parse_label_edit

    e = parse_label_edit("rack=r12 pdu=p7 tier=gold row-")
    assert e.set == {"llmgw.io/rack": "r12", "llmgw.io/pdu": "p7", "tier": "gold"} and e.remove == ["llmgw.io/row"]
    with pytest.raises(ValueError, match="facility label's value"):
        parse_label_edit("rack=r/12")


def test_the_console_node_detail_shows_its_holds() -> None:
    from llmgw.tui.rows import node_detail

    lines = node_detail({"name": "a", "state": "ready", "held": ["rack=r1"], "facts": {}})
    assert "held     rack=r1: nothing new is placed here (llmgw ctl facility)" in lines
    assert not any(line.startswith("held") for line in node_detail({"name": "a", "state": "ready"}))
