"""Models and their replicas: placed replicas with the router's view of each (inflight, engine
queue, KV use, breaker), static endpoints after them, and the selected replica's last log lines;
`p` explains the selected replica's placement (or the selected model's next one). An autoscaled
model's row shows its count/ready/starting, bounds and the autoscaler's mode or pin, and selecting
it shows the decision, what limited it and the last decisions (GET /api/v1/autoscale, fetched
while the view is shown)."""

from __future__ import annotations

from typing import ClassVar

from textual import events
from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import DataTable, Static

from llmgw.admin_client.printable import printable
from llmgw.tui.autoscale_rows import autoscale_lines
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
    summary = "models (autoscaled: count/ready/starting, mode, why), their replicas: state, load, breaker, log lines"
    sections = frozenset({"models", "replicas", "endpoints", "autoscale"})
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
        models = self.query_one("#models-table", DataTable)
        fill_table(models, MODEL_COLUMNS, model_rows(state, self.filter_text))
        replicas = self.query_one("#replicas-table", DataTable)
        fill_table(replicas, REPLICA_COLUMNS, replica_rows(state, self.filter_text))
        if models.has_focus and autoscale_lines(state, row_key_at(models)):
            self._show_model(row_key_at(models))
        else:
            self._show_detail(row_key_at(replicas))

    def _show_detail(self, rid: str | None) -> None:
        self.query_one("#replica-detail", Static).update(printable("\n".join(replica_detail(self.host.state, rid)), keep_newlines=True))

    def _show_model(self, name: str | None) -> None:
        """An autoscaled model's decision and history in the detail pane (others keep the replica's)."""
        lines = autoscale_lines(self.host.state, name, self.host.tz)
        if lines:
            self.query_one("#replica-detail", Static).update(printable("\n".join(lines), keep_newlines=True))

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        if event.data_table.id == "replicas-table":
            self._show_detail(event.row_key.value)
        elif event.data_table.id == "models-table" and event.data_table.has_focus:
            self._show_model(event.row_key.value)

    def on_descendant_focus(self, event: events.DescendantFocus) -> None:
        """Tabbing between the tables: the detail follows the table that has the focus."""
        if event.widget.id == "models-table":
            self._show_model(row_key_at(self.query_one("#models-table", DataTable)))
        elif event.widget.id == "replicas-table":
            self._show_detail(row_key_at(self.query_one("#replicas-table", DataTable)))

    def action_explain_placement(self) -> None:
        models = self.query_one("#models-table", DataTable)
        replicas = self.query_one("#replicas-table", DataTable)
        target = row_key_at(models) if models.has_focus else row_key_at(replicas)
        if target is None:
            self.notify("no replica or model selected", severity="warning")
            return
        self.host.explain_placement(target)
