"""The console's facility dialogs: `h` on a node holds or releases one of its domains (holds.py
is the little language), `p` on a model or replica shows its placement's explanation — the
text `llmgw ctl explain-placement` prints (docs/placement.md)."""

from __future__ import annotations

from typing import Any, ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Input, Static

from llmgw.admin_client.printable import printable
from llmgw.admin_client.facility import explanation_text
from llmgw.tui.holds import HoldEdit, parse_hold_edit

__all__ = ["HoldEditor", "PlacementScreen"]


class HoldEditor(ModalScreen[HoldEdit | None]):
    BINDINGS: ClassVar = [Binding("escape", "cancel", "cancel")]

    def __init__(self, node: str, domains: list[str], held: list[str], *, subject: str | None = None) -> None:
        """`subject`: what the title names (default: the node); the Facility view passes its domain."""
        super().__init__()
        self.node, self.domains, self.held = node, domains, held
        self.subject = subject or f"a domain of node {node}"

    def compose(self) -> ComposeResult:
        with Vertical(id="label-dialog"):
            yield Static(Text(f"Hold {self.subject}", style="bold"))
            yield Static(printable(f"domains   {'  '.join(self.domains) or '—'}\nheld      "
                                   f"{'  '.join(self.held) or '—'}"), classes="detail")
            yield Input(placeholder="rack  ·  row drain PDU swap  ·  release rack", id="hold-input")
            yield Static("", id="hold-error")
            yield Static("LEVEL or DOMAIN [drain] [reason] holds · release LEVEL ends it · enter applies · "
                         "esc cancels", classes="hint")

    def on_mount(self) -> None:
        field = self.query_one("#hold-input", Input)
        field.cursor_blink = False
        field.focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        try:
            edit = parse_hold_edit(event.value, self.domains)
        except ValueError as e:
            self.query_one("#hold-error", Static).update(Text(printable(str(e)), style="red"))
            return
        self.dismiss(edit)

    def action_cancel(self) -> None:
        self.dismiss(None)


class PlacementScreen(ModalScreen[None]):
    BINDINGS: ClassVar = [Binding("escape", "app.pop_screen", "back")]

    def __init__(self, explanation: dict[str, Any]) -> None:
        super().__init__(id="placement")
        self.text = explanation_text(explanation)

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="placement-dialog"):
            yield Static(self.text, id="placement-text", markup=False)
            yield Static("esc closes · llmgw ctl explain-placement -o json has every row", classes="hint")
