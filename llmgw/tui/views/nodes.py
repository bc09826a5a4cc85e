"""Nodes: state and for how long, location, agent, hardware, the engines placed there; `l` sets
or removes operator labels on the selected node, `h` holds or releases one of its facility domains."""

from __future__ import annotations

from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import DataTable, Static

from llmgw.admin_client.printable import printable
from llmgw.fleet.domains import node_domains
from llmgw.tui.facility_screens import HoldEditor
from llmgw.tui.holds import HoldEdit
from llmgw.tui.label_editor import LabelEditor
from llmgw.tui.labels import LabelEdit
from llmgw.tui.rows import NODE_COLUMNS, node_detail, node_rows
from llmgw.tui.state import ConsoleState, as_dict
from llmgw.tui.views.base import ConsoleView, fill_table, row_key_at

__all__ = ["NodesView"]


class NodesView(ConsoleView):
    key = "1"
    view_id = "nodes"
    title = "Nodes"
    summary = "state, location, hardware and engines of each node; l sets labels, h holds a domain"
    sections = frozenset({"nodes", "replicas", "models"})
    BINDINGS: ClassVar = [Binding("l", "edit_labels", "set labels",
                                  tooltip="set or remove operator labels on the selected node"),
                          Binding("h", "edit_hold", "hold",
                                  tooltip="hold (nothing new placed) or release one of the selected node's domains")]

    def body(self) -> ComposeResult:
        yield DataTable(id="nodes-table", cursor_type="row", zebra_stripes=True)
        yield Static(id="node-detail", classes="detail", markup=False)

    def render_state(self, state: ConsoleState) -> None:
        table = self.query_one("#nodes-table", DataTable)
        fill_table(table, NODE_COLUMNS, node_rows(state, self.filter_text))
        self._show_detail(row_key_at(table))

    def _show_detail(self, name: str | None) -> None:
        node = self.host.state.node(name) if name is not None else None
        self.query_one("#node-detail", Static).update(printable("\n".join(node_detail(node)), keep_newlines=True))

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        self._show_detail(event.row_key.value)

    def action_edit_labels(self) -> None:
        name = row_key_at(self.query_one("#nodes-table", DataTable))
        node = self.host.state.node(name) if name is not None else None
        if name is None or node is None:
            self.notify("no node selected", severity="warning")
            return

        def done(edit: LabelEdit | None) -> None:
            if edit is not None:
                self.host.apply_labels(name, edit)

        self.app.push_screen(LabelEditor(name, as_dict(node.get("operator_labels")),
                                         as_dict(node.get("agent_labels"))), done)

    def action_edit_hold(self) -> None:
        name = row_key_at(self.query_one("#nodes-table", DataTable))
        node = self.host.state.node(name) if name is not None else None
        if name is None or node is None:
            self.notify("no node selected", severity="warning")
            return
        domains = [d for d in node_domains({str(k): str(v) for k, v in as_dict(node.get("labels")).items()}) if d]
        held = [str(d) for d in node.get("held") or [] if isinstance(d, str)]

        def done(edit: HoldEdit | None) -> None:
            if edit is not None:
                self.host.apply_hold(edit)

        self.app.push_screen(HoldEditor(name, domains, held), done)
