"""Facility: every failure domain (site, room, row, rack, pdu) with its hold, nodes, replicas and
power draw against its budget — ``llmgw ctl facility`` in the console. Fetched from the daemon
while the view is shown (it is not in the event stream); `h` holds or releases the selected domain."""

from __future__ import annotations

from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import DataTable, Static

from llmgw.admin_client.printable import printable
from llmgw.tui.facility_rows import (
    FACILITY_COLUMNS,
    facility_detail,
    facility_rows,
    facility_summary_lines,
)
from llmgw.tui.facility_screens import HoldEditor
from llmgw.tui.holds import HoldEdit
from llmgw.tui.state import ConsoleState, as_list
from llmgw.tui.views.base import ConsoleView, fill_table, row_key_at

__all__ = ["FacilityView"]


class FacilityView(ConsoleView):
    key = "7"
    view_id = "facility"
    title = "Facility"
    summary = "failure domains: holds, nodes, replicas, power draw vs budget; h holds or releases one"
    sections = frozenset({"facility"})
    BINDINGS: ClassVar = [Binding("h", "edit_hold", "hold",
                                  tooltip="hold (nothing new placed) or release the selected domain")]

    def body(self) -> ComposeResult:
        yield Static(id="facility-summary", classes="detail", markup=False)
        yield DataTable(id="facility-table", cursor_type="row", zebra_stripes=True)
        yield Static(id="facility-detail", classes="detail", markup=False)

    def render_state(self, state: ConsoleState) -> None:
        self.query_one("#facility-summary", Static).update(printable("\n".join(facility_summary_lines(state)),
                                                                     keep_newlines=True))
        table = self.query_one("#facility-table", DataTable)
        fill_table(table, FACILITY_COLUMNS, facility_rows(state, self.filter_text))
        self._show_detail(row_key_at(table))

    def _show_detail(self, domain: str | None) -> None:
        lines = facility_detail(self.host.state, domain)
        self.query_one("#facility-detail", Static).update(printable("\n".join(lines), keep_newlines=True))

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        self._show_detail(event.row_key.value)

    def action_edit_hold(self) -> None:
        domain = row_key_at(self.query_one("#facility-table", DataTable))
        if domain is None:
            self.notify("no domain selected", severity="warning")
            return
        held = [str(h.get("domain")) for h in as_list(self.host.state.facility.get("holds"))
                if h.get("domain") == domain]

        def done(edit: HoldEdit | None) -> None:
            if edit is not None:
                self.host.apply_hold(edit)

        self.app.push_screen(HoldEditor(domain, [domain], held, subject=f"domain {domain}"), done)
