"""LoRA adapters: which vLLM replica holds which adapter (loaded on demand, or pinned), the loads
in progress with the requests waiting for them, and failed loads in backoff with the engine's
reason."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.widgets import DataTable, Static

from llmgw.tui.adapter_rows import ADAPTER_COLUMNS, adapter_rows, adapter_summary_lines
from llmgw.tui.state import ConsoleState
from llmgw.tui.views.base import ConsoleView, fill_table

__all__ = ["AdaptersView"]


class AdaptersView(ConsoleView):
    key = "5"
    view_id = "adapters"
    title = "Adapters"
    summary = "LoRA adapters per vLLM replica: held, loading, failed"
    sections = frozenset({"adapters", "replicas", "endpoints"})

    def body(self) -> ComposeResult:
        yield Static(id="adapters-summary", classes="detail", markup=False)
        yield DataTable(id="adapters-table", cursor_type="row", zebra_stripes=True)

    def render_state(self, state: ConsoleState) -> None:
        self.query_one("#adapters-summary", Static).update("\n".join(adapter_summary_lines(state)))
        fill_table(self.query_one("#adapters-table", DataTable), ADAPTER_COLUMNS, adapter_rows(state, self.filter_text))
