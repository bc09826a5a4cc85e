"""Models and their replicas: placed replicas with the router's view of each (inflight, engine
queue, KV use, breaker), static endpoints after them, and the selected replica's last log lines;
`p` explains the selected replica's placement (or the selected model's next one)."""

from __future__ import annotations

from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import DataTable, Static

from llmgw.admin_client.printable import printable
from llmgw.tui.rows import (
    MODEL_COLUMNS,
    REPLICA_COLUMNS,
    model_rows,
    replica_detail,
    replica_rows,
)
from llmgw.tui.state import ConsoleState
from llmgw.tui.views.base import ConsoleView, fill_table, row_key_at

__all__ = ["ModelsView"]


class ModelsView(ConsoleView):
    key = "2"
    view_id = "models"
    title = "Models"
    summary = "models, and their replicas: state, load, breaker, last log lines"
    sections = frozenset({"models", "replicas", "endpoints"})
    BINDINGS: ClassVar = [Binding("p", "explain_placement", "placement",
                                  tooltip="why the selected replica is on its node (or where the model's next goes)")]

    def body(self) -> ComposeResult:
        yield Static("models", classes="section-title")
        yield DataTable(id="models-table", cursor_type="row", zebra_stripes=True)
        yield Static("replicas", classes="section-title")
        yield DataTable(id="replicas-table", cursor_type="row", zebra_stripes=True)
        yield Static(id="replica-detail", classes="detail", markup=False)

    def main_widget(self) -> DataTable[object]:
        return self.query_one("#replicas-table", DataTable)

    def render_state(self, state: ConsoleState) -> None:
        fill_table(self.query_one("#models-table", DataTable), MODEL_COLUMNS, model_rows(state, self.filter_text))
        replicas = self.query_one("#replicas-table", DataTable)
        fill_table(replicas, REPLICA_COLUMNS, replica_rows(state, self.filter_text))
        self._show_detail(row_key_at(replicas))

    def _show_detail(self, rid: str | None) -> None:
        self.query_one("#replica-detail", Static).update(printable("\n".join(replica_detail(self.host.state, rid)), keep_newlines=True))

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        if event.data_table.id == "replicas-table":
            self._show_detail(event.row_key.value)

    def action_explain_placement(self) -> None:
        models = self.query_one("#models-table", DataTable)
        replicas = self.query_one("#replicas-table", DataTable)
        target = row_key_at(models) if models.has_focus else row_key_at(replicas)
        if target is None:
            self.notify("no replica or model selected", severity="warning")
            return
        self.host.explain_placement(target)
