"""One rationale renderer: `llmgw ctl explain` prints llmgw.admin_client.rationale's lines, and the
console's rationale screen shows the same cells, toned."""

from __future__ import annotations

import argparse
from datetime import UTC
from typing import Any

import pytest

from llmgw.admin_client.rationale import explain, rationale_lines, text_table
from llmgw.cli.ctl.main import parser
from llmgw.cli.ctl.routing import cmd_explain
from llmgw.tui.rows import rationale
from tests.test_console_fakes import decision

EXPECTED = """\
request   req-0003         model     llama-8b
chosen    llama-8b/1a2b3c  strategy  chat
picker    max-score        decided   15:06:40.750
took      61µs             note      prefix hit

candidates × scorers: scores 0..1 (1 = best), total = Σ weight × score — 1 more scored but not kept
endpoint           prefix ×3  load ×2  kv ×1  total  flags
▶ llama-8b/1a2b3c  1.00       0.50     0.58   4.58   prefix 12/16 blocks
  llama-8b/4d5e6f  0.25       0.83     0.82   3.23

dropped by filters (2)
filter   endpoint              reason
breaker  http://10.0.0.9:8000  breaker open until probe
ready    llama-8b/7a8b9c       starting: not ready"""


def test_the_text_of_a_rationale() -> None:
    assert "\n".join(rationale_lines(decision(3), UTC)) == EXPECTED
    sparse = rationale_lines({"request_id": "r", "candidates": [{"endpoint": "a", "scores": {"load": 0.5}}]})
    assert sparse[0] == "request   r     model     ?"
    assert sparse[-4:] == ["endpoint  load ×?  total  flags", "  a       0.50     —", "", "dropped by filters (0)"]


def test_text_table_pads_columns_and_trims_lines() -> None:
    assert text_table(["A", "BB"], [["xxx", ""], ["y", "z"]]) == ["A    BB", "xxx", "y    z"]


def test_the_console_shows_the_same_cells() -> None:
    d = decision(7, chosen="llama-8b/4d5e6f")
    shared, view = explain(d, UTC), rationale(d, UTC)
    assert view.facts == shared.facts and view.columns == shared.columns and view.hidden == shared.hidden
    assert [r.cells for r in view.candidates] == [c.cells for c in shared.candidates]
    assert [r.tone for r in view.candidates] == ["good" if c.chosen else "" for c in shared.candidates]
    assert [r.cells for r in view.drops] == shared.drops
    assert (view.candidates_title, view.drops_title) == (shared.candidates_title, shared.drops_title)


class FakeAdmin:
    def __init__(self, answer: Any) -> None:
        self.answer = answer

    def call(self, method: str, path: str, **_: Any) -> Any:
        assert (method, path) == ("GET", "/decisions/req-0003")
        return self.answer


@pytest.mark.parametrize("answer", [decision(3), {"decisions": [decision(3), decision(5)]}], ids=["one", "two"])
def test_ctl_explain_prints_the_shared_lines(answer: Any, capsys: pytest.CaptureFixture[str]) -> None:
    parser()  # lends ctl's output helpers to the command modules
    cmd_explain(FakeAdmin(answer), argparse.Namespace(request_id="req-0003", output="table"))  # type: ignore[arg-type]
    decisions = answer.get("decisions", [answer])
    assert capsys.readouterr().out == "\n\n".join("\n".join(rationale_lines(d)) for d in decisions) + "\n"
