"""The Lifecycle view's dialogs: one list of choices (lifecycle_rows.Choice) to pick from — a
suite to run, whether a promote requires a suite — or a single action to confirm (promote,
rollback and update change what is served, so nothing happens on one keypress). Enter picks,
escape cancels."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import OptionList, Static
from textual.widgets.option_list import Option

from llmgw.admin_client.printable import printable
from llmgw.tui.lifecycle_rows import Choice
from llmgw.tui.styles import TONE_STYLE

__all__ = ["ChoiceScreen"]


class ChoiceScreen(ModalScreen[tuple[str, ...] | None]):
    """Answers the picked choice's value, or None (escape)."""

    BINDINGS: ClassVar = [Binding("escape", "cancel", "cancel")]

    def __init__(self, title: str, text: str, choices: Sequence[Choice]) -> None:
        super().__init__()
        self.title_text, self.text, self.choices = title, text, list(choices)

    def compose(self) -> ComposeResult:
        with Vertical(id="label-dialog"):
            yield Static(Text(printable(self.title_text), style="bold"))
            if self.text:
                yield Static(printable(self.text), classes="detail", markup=False)
            yield OptionList(*(Option(Text(printable(c.label), style=TONE_STYLE.get(c.tone, "")), id=str(i))
                               for i, c in enumerate(self.choices)), id="choice-list")
            yield Static("enter does it · esc cancels", classes="hint")

    def on_mount(self) -> None:
        self.query_one("#choice-list", OptionList).focus()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        i = int(event.option.id or 0)
        self.dismiss(self.choices[i].value)

    def action_cancel(self) -> None:
        self.dismiss(None)
