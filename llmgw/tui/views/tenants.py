"""Tenants: per tenant its priority band and weight, keys, today's requests and tokens, quota use
against its limits, and its requests waiting in the admission queues with its share of its band
— ``llmgw ctl tenants list`` and ``ctl usage`` in one table. Fetched from the daemon while the
view is shown (GET /api/v1/tenants: it is not in the event stream)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.widgets import DataTable, Static

from llmgw.admin_client.printable import printable
from llmgw.tui.state import ConsoleState
from llmgw.tui.tenant_rows import TENANT_COLUMNS, tenant_detail, tenant_rows, tenant_summary_lines
from llmgw.tui.views.base import ConsoleView, fill_table, row_key_at

__all__ = ["TenantsView"]


class TenantsView(ConsoleView):
    key = "8"
    view_id = "tenants"
    title = "Tenants"
    summary = "tenants: band, weight, keys, today's use, quota use vs limits, requests waiting and their share"
    sections = frozenset({"tenants"})

    def body(self) -> ComposeResult:
        yield Static(id="tenants-summary", classes="detail", markup=False)
        yield DataTable(id="tenants-table", cursor_type="row", zebra_stripes=True)
        yield Static(id="tenants-detail", classes="detail", markup=False)

    def render_state(self, state: ConsoleState) -> None:
        self.query_one("#tenants-summary", Static).update(printable("\n".join(tenant_summary_lines(state)),
                                                                    keep_newlines=True))
        table = self.query_one("#tenants-table", DataTable)
        fill_table(table, TENANT_COLUMNS, tenant_rows(state, self.filter_text))
        self._show_detail(row_key_at(table))

    def _show_detail(self, name: str | None) -> None:
        lines = tenant_detail(self.host.state, name)
        self.query_one("#tenants-detail", Static).update(printable("\n".join(lines), keep_newlines=True))

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        self._show_detail(event.row_key.value)
