"""Decisions: the router's routing decisions as they happen, newest first; enter opens one's
rationale (candidates × scorers, and the filters' drops), t its request's trace."""

from __future__ import annotations

from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import DataTable, Static

from llmgw.tui.rows import (
    DECISION_COLUMNS,
    DECISIONS_SHOWN,
    decision_rows,
    decisions_caption,
)
from llmgw.tui.state import ConsoleState
from llmgw.tui.views.base import ConsoleView, fill_table, row_key_at

__all__ = ["DecisionsView"]


class DecisionsView(ConsoleView):
    key = "3"
    view_id = "decisions"
    title = "Decisions"
    summary = "routing decisions, live, newest first; enter shows why one was made, t its request's trace"
    sections = frozenset({"decisions"})
    BINDINGS: ClassVar = [Binding("enter", "rationale", "rationale",
                                  tooltip="the selected decision's rationale: candidates × scorers, drops"),
                          Binding("t", "trace", "trace", tooltip="the selected request's trace: phases, attempts")]

    def body(self) -> ComposeResult:
        yield Static(id="decisions-caption", classes="section-title", markup=False)
        yield DataTable(id="decisions-table", cursor_type="row", zebra_stripes=True)

    def render_state(self, state: ConsoleState) -> None:
        rows = decision_rows(state, self.filter_text, self.host.tz)
        shown = rows[:DECISIONS_SHOWN]
        self.query_one("#decisions-caption", Static).update(
            decisions_caption(len(shown), len(rows), len(state.decisions), self.filter_text))
        fill_table(self.query_one("#decisions-table", DataTable), DECISION_COLUMNS, shown, follow_top=True)

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        if event.row_key.value is not None:
            self.host.open_rationale(int(event.row_key.value))

    def action_rationale(self) -> None:
        key = row_key_at(self.query_one("#decisions-table", DataTable))
        if key is not None:
            self.host.open_rationale(int(key))

    def action_trace(self) -> None:
        key = row_key_at(self.query_one("#decisions-table", DataTable))
        decision = self.host.state.decision(int(key)) if key is not None else None
        if decision is not None and decision.get("request_id"):
            self.host.open_trace(str(decision["request_id"]))
