"""One decision's rationale, a keypress from the decisions list: the candidates × scorers matrix
(weights in the column headers, the chosen one marked ▶ and first among equals), and the
endpoints the filters dropped, with why. The text is llmgw.admin_client.rationale's, the same as
`llmgw ctl explain` prints; this screen puts it in tables and colours it."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import tzinfo
from typing import Any, ClassVar

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Header, Static

from llmgw.admin_client.printable import printable
from llmgw.admin_client.rationale import DROP_COLUMNS as DROP_LABELS
from llmgw.tui.rows import Column, rationale
from llmgw.tui.views.base import fill_table

__all__ = ["RationaleScreen"]

DROP_COLUMNS = tuple(Column(label) for label in DROP_LABELS)


class RationaleScreen(Screen[None]):
    BINDINGS: ClassVar = [Binding("escape", "app.pop_screen", "back"),
                          Binding("t", "trace", "trace", tooltip="the request's trace: phases, attempts, retries")]

    def __init__(self, decision: Mapping[str, Any], tz: tzinfo | None) -> None:
        super().__init__(id="rationale")
        self.request_id = str(decision.get("request_id", ""))
        self.view = rationale(decision, tz)
        self.sub_title = f"rationale of {decision.get('request_id', '?')}"

    def compose(self) -> ComposeResult:
        facts = Table.grid(padding=(0, 2))
        facts.add_column(style="bold")
        facts.add_column()
        facts.add_column(style="bold")
        facts.add_column()
        items = [(Text(k), Text(printable(v))) for k, v in self.view.facts]
        for i in range(0, len(items), 2):
            pair = items[i:i + 2]
            facts.add_row(*pair[0], *(pair[1] if len(pair) > 1 else (Text(""), Text(""))))
        yield Header()
        yield Static(facts, id="rationale-facts", classes="detail")
        yield Static(self.view.candidates_title, classes="section-title", markup=False)
        yield DataTable(id="candidates-table", cursor_type="row")
        yield Static(self.view.drops_title, classes="section-title", markup=False)
        yield DataTable(id="drops-table", cursor_type="row")
        yield Footer()

    def on_mount(self) -> None:
        fill_table(self.query_one("#candidates-table", DataTable),
                   [Column(c, toned=i == 0) for i, c in enumerate(self.view.columns)],
                   self.view.candidates)
        fill_table(self.query_one("#drops-table", DataTable), DROP_COLUMNS, self.view.drops)
        self.query_one("#candidates-table", DataTable).focus()

    def action_trace(self) -> None:
        if self.request_id:
            self.app.open_trace(self.request_id)  # type: ignore[attr-defined]
