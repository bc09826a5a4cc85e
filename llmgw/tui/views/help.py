"""Help: every key, generated from the view registry and the bindings themselves so it cannot
drift from what the keys do, and how to read the colours and sparklines."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.widget import Widget
from textual.widgets import Static

from llmgw.tui.state import ConsoleState
from llmgw.tui.views.base import ConsoleView

__all__ = ["HelpView", "help_renderable"]

KEY_WIDTH = 10
NOTES = (
    ("Colours: green = ready / chosen / hit rate at least 50%; yellow = degraded; red = lost, failed, "
     "nothing chosen; cyan = starting."),
    ("Sparklines: one block per bucket of the daemon's cache window (10 s by default), newest on the right, "
     "from ▁ (0%) to █ (100%); a blank is a bucket without traffic."),
    ("The console follows the daemon's event stream. When it drops, a red banner says so, the last data stays "
     "on screen, and the console reconnects by itself (backoff up to 5 s)."),
)


def _binding_rows(bindings: list[Binding]) -> list[tuple[str, str]]:
    return [(b.key_display or b.key, b.tooltip or b.description) for b in bindings
            if b.description and not b.action.startswith("show(")]  # the view keys are listed apart


def _keys(rows: list[tuple[str, str]]) -> Table:
    table = Table(box=None, show_header=False, padding=(0, 2), expand=False)
    table.add_column(style="bold cyan", no_wrap=True, width=KEY_WIDTH)
    table.add_column()
    for key, what in rows:
        table.add_row(key, what)
    return table


def help_renderable(views: list[type[ConsoleView]], app_bindings: list[Binding]) -> Group:
    sections: list[tuple[str, list[tuple[str, str]]]] = [
        ("views", [(v.key, f"{v.title} — {v.summary}") for v in views]),
        ("everywhere", [*_binding_rows(app_bindings), ("tab", "next table or field")]),
    ]
    for v in views:
        rows = _binding_rows([b for b in v.BINDINGS if isinstance(b, Binding)])
        if rows:
            sections.append((f"in {v.title}", rows))
    sections += [("in a rationale", [("t", "the request's trace"), ("esc", "back to the decisions")]),
                 ("in a trace", [("esc", "back")]),
                 ("in the label editor", [("key=value", "sets an operator label (several: separate with spaces)"),
                                          ("key-", "removes one"), ("esc", "cancels")])]
    parts: list[Text | Table] = []
    for title, rows in sections:
        parts += [Text(title, style="bold"), _keys(rows)]
    return Group(*parts, Text(""), *(Text(n, style="dim") for n in NOTES))


class HelpView(ConsoleView):
    key = "?"
    view_id = "help"
    title = "Help"
    summary = "this page"
    filterable = False

    def body(self) -> ComposeResult:
        with VerticalScroll(id="help-scroll"):
            yield Static(id="help-text")

    def main_widget(self) -> Widget:
        return self.query_one("#help-scroll", VerticalScroll)

    def render_state(self, state: ConsoleState) -> None:
        bindings = [b for b in type(self.app).BINDINGS if isinstance(b, Binding)]
        self.query_one("#help-text", Static).update(help_renderable(list(self.host.view_types), bindings))
