"""Cache hits: per model and per replica, how often routing sent a request to a replica that held
its prefix, and the engines' own prefix-cache hit rate, each with a sparkline over the window."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.widgets import DataTable, Static

from llmgw.tui.cache_rows import (
    CACHE_MODEL_COLUMNS,
    CACHE_REPLICA_COLUMNS,
    cache_model_rows,
    cache_replica_rows,
    cache_total_lines,
)
from llmgw.tui.state import ConsoleState
from llmgw.tui.views.base import ConsoleView, fill_table

__all__ = ["CacheView"]


class CacheView(ConsoleView):
    key = "4"
    view_id = "cache"
    title = "Cache hits"
    summary = "prefix-cache hits, per model and replica, with trends; tier 2's decisions and parity"
    # the fleet's sections too: a replica that leaves drops out of the rows without a cache update
    sections = frozenset({"cache", "models", "replicas", "endpoints", "kv"})

    def body(self) -> ComposeResult:
        yield Static(id="cache-total", classes="detail", markup=False)
        yield Static("per model", classes="section-title")
        yield DataTable(id="cache-models-table", cursor_type="row", zebra_stripes=True)
        yield Static("per replica", classes="section-title")
        yield DataTable(id="cache-replicas-table", cursor_type="row", zebra_stripes=True)

    def render_state(self, state: ConsoleState) -> None:
        self.query_one("#cache-total", Static).update("\n".join(cache_total_lines(state)))
        fill_table(self.query_one("#cache-models-table", DataTable), CACHE_MODEL_COLUMNS,
                   cache_model_rows(state, self.filter_text))
        fill_table(self.query_one("#cache-replicas-table", DataTable), CACHE_REPLICA_COLUMNS,
                   cache_replica_rows(state, self.filter_text))
