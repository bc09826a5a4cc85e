"""One request's trace, a keypress (t) from a decision or its rationale: the timeline `llmgw ctl
trace` prints (llmgw.admin_client.trace_view), phases with their bars, then each attempt and why
it was retried. Fetched once from ``GET /api/v1/traces/{request_id}`` when opened."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import tzinfo
from typing import Any, ClassVar

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Header, Static

from llmgw.admin_client.printable import printable
from llmgw.admin_client.trace_view import trace_lines

__all__ = ["TraceScreen"]


class TraceScreen(Screen[None]):
    BINDINGS: ClassVar = [Binding("escape", "app.pop_screen", "back")]

    def __init__(self, trace: Mapping[str, Any], tz: tzinfo | None) -> None:
        super().__init__(id="trace")
        self.lines = trace_lines(dict(trace), tz)
        self.sub_title = f"trace of {printable(str(trace.get('id', '?')))}"

    def compose(self) -> ComposeResult:
        yield Header()
        with VerticalScroll(id="trace-scroll"):
            yield Static("\n".join(self.lines), id="trace-text", markup=False)
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#trace-scroll", VerticalScroll).focus()
