"""The small dialog behind `l` on a node: key=value sets an operator label, key- removes one."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Static

from llmgw.tui.labels import LabelEdit, parse_label_edit

__all__ = ["LabelEditor"]


def _labels(labels: Mapping[str, Any]) -> str:
    return "  ".join(f"{k}={v}" for k, v in sorted(labels.items())) or "—"


class LabelEditor(ModalScreen[LabelEdit | None]):
    BINDINGS: ClassVar = [Binding("escape", "cancel", "cancel")]

    def __init__(self, node: str, operator_labels: Mapping[str, Any], agent_labels: Mapping[str, Any]) -> None:
        super().__init__()
        self.node, self.operator_labels, self.agent_labels = node, operator_labels, agent_labels

    def compose(self) -> ComposeResult:
        with Vertical(id="label-dialog"):
            yield Static(Text(f"Labels of node {self.node}", style="bold"))
            yield Static(f"operator  {_labels(self.operator_labels)}\nagent     {_labels(self.agent_labels)}",
                         classes="detail")
            yield Input(placeholder="llmgw.io/rack=r12  other=value  old-key-", id="label-input")
            yield Static("", id="label-error")
            yield Static("key=value sets · key- removes · enter applies · esc cancels", classes="hint")

    def on_mount(self) -> None:
        field = self.query_one("#label-input", Input)
        field.cursor_blink = False
        field.focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        try:
            edit = parse_label_edit(event.value)
        except ValueError as e:
            self.query_one("#label-error", Static).update(Text(str(e), style="red"))
            return
        self.dismiss(edit)

    def action_cancel(self) -> None:
        self.dismiss(None)
