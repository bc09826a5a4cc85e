"""What every console view shares: its place in the registry (a number key, an id, a title), the
sections of the state it shows, a filter bar, and filling a DataTable from rows without losing
the operator's place."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import tzinfo
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, cast

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.widget import Widget
from textual.widgets import DataTable, Input
from textual.widgets.data_table import CellDoesNotExist, RowDoesNotExist

from llmgw.admin_client.printable import printable
from llmgw.tui.rows import Column, Row
from llmgw.tui.state import ConsoleState
from llmgw.tui.styles import TONE_STYLE

if TYPE_CHECKING:
    from llmgw.tui.labels import LabelEdit

__all__ = ["ConsoleHost", "ConsoleView", "FilterInput", "fill_table", "row_key_at"]



class ConsoleHost(Protocol):
    """What a view may ask of the app (the app is typed apart to keep views free of it)."""

    state: ConsoleState
    tz: tzinfo | None
    view_types: Sequence[type[ConsoleView]]  # the registry (llmgw.tui.views.VIEWS), in tab order

    def open_rationale(self, seq: int) -> None: ...

    def open_trace(self, request_id: str) -> None: ...

    def apply_labels(self, node: str, edit: LabelEdit) -> None: ...

    def apply_hold(self, edit: Any) -> None:
        """Hold or release a facility domain (llmgw.tui.holds.HoldEdit)."""
        ...

    def explain_placement(self, target: str) -> None:
        """Show the placement explanation of a replica id or a model name."""
        ...

    def active_view(self) -> ConsoleView: ...

    def refresh_lifecycle(self) -> None:
        """Fetch the lifecycle section again (the Lifecycle view, while shown)."""
        ...

    def lifecycle_action(self, action: str, model: str, args: tuple[str, ...]) -> None:
        """update, eval (suite, revision), promote (required suites) or rollback, then refresh."""
        ...


def row_key_at(table: DataTable[Text | str]) -> str | None:
    """The key of the row under the cursor, or None for an empty table."""
    if table.row_count == 0:
        return None
    try:
        return table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value
    except CellDoesNotExist:  # the cursor may be past the end for a moment while rows change
        return None


def fill_table(table: DataTable[Text | str], columns: Sequence[Column], rows: Sequence[Row], *,
               follow_top: bool = False) -> None:
    """Replace the table's rows, keeping the cursor on the same row (by key) and the scroll offset.
    ``follow_top``: a cursor on the first row stays on the first row, so a live list shows its
    newest entry until the operator moves away from it."""
    if not table.columns:
        for c in columns:
            table.add_column(c.label, width=c.width)
    toned = [c.toned for c in columns]
    key = row_key_at(table)
    row, column, y = table.cursor_row, table.cursor_column, table.scroll_y
    table.clear()
    keys: set[str] = set()
    for r in rows:
        style = TONE_STYLE.get(r.tone, "")
        # Text, not str: a str cell is read as markup, and data may hold "[" (log lines, reasons)
        cells = [Text(printable(cell), style=style if t else "") for cell, t in zip(r.cells, toned)]
        k = r.key
        while k in keys:  # a daemon's data should not repeat ids, but a repeat must not kill the console
            k += "'"
        keys.add(k)
        table.add_row(*cells, key=k)
    if not rows or key is None or (follow_top and row == 0):
        return
    try:
        index = table.get_row_index(key)
    except RowDoesNotExist:  # the row left (filtered out, or gone from the daemon)
        index = min(row, len(rows) - 1)
    table.move_cursor(row=index, column=column, scroll=False)
    if y:
        table.call_after_refresh(table.scroll_to, y=y, animate=False)


class FilterInput(Input):
    """The filter bar: narrows the view's rows as it is typed; escape clears and hides it."""

    BINDINGS: ClassVar = [Binding("escape", "close", "clear filter")]

    def on_mount(self) -> None:
        self.cursor_blink = False  # a blinking cursor would make snapshots flaky, and helps no one

    def action_close(self) -> None:
        view = next((a for a in self.ancestors if isinstance(a, ConsoleView)), None)
        if view is not None:
            view.close_filter()


class ConsoleView(Vertical):
    """One view of the console. To add one: subclass, fill the class attributes, implement
    ``render_state``, and list it in llmgw.tui.views.VIEWS — its key, tab and help come from there."""

    key: ClassVar[str]  # the key that shows it, also its tab's prefix
    view_id: ClassVar[str]
    title: ClassVar[str]
    summary: ClassVar[str] = ""  # one line for the help view
    sections: ClassVar[frozenset[str]] = frozenset()  # state sections it shows: a change marks it stale
    filterable: ClassVar[bool] = True

    def __init__(self) -> None:
        super().__init__(id=f"view-{self.view_id}", classes="console-view")
        self.stale = True
        self.filter_text = ""

    @property
    def host(self) -> ConsoleHost:
        return cast(ConsoleHost, self.app)

    def compose(self) -> ComposeResult:
        if self.filterable:
            yield FilterInput(placeholder=f"filter {self.title.lower()}: words that must all appear",
                              id=f"filter-{self.view_id}", classes="filter")
        yield from self.body()

    def body(self) -> ComposeResult:
        raise NotImplementedError

    def render_state(self, state: ConsoleState) -> None:
        raise NotImplementedError

    def shown(self) -> None:
        """The view came on screen (a view that fetches its data asks for it here)."""

    def refresh_from(self, state: ConsoleState) -> None:
        self.render_state(state)
        self.stale = False

    def main_widget(self) -> Widget | None:
        """What gets the focus when the view is shown."""
        return next(iter(self.query(DataTable)), None)

    def focus_main(self) -> None:
        w = self.main_widget()
        if w is not None:
            w.focus()

    # -- the filter ---------------------------------------------------------------------------------
    def open_filter(self) -> None:
        if not self.filterable:
            return
        bar = self.query_one(FilterInput)
        bar.add_class("open")
        bar.focus()

    def close_filter(self) -> None:
        bar = self.query_one(FilterInput)
        bar.value = ""
        bar.remove_class("open")
        self.focus_main()

    def on_input_changed(self, event: Input.Changed) -> None:
        if isinstance(event.input, FilterInput):
            event.stop()
            self.filter_text = event.value
            self.refresh_from(self.host.state)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if isinstance(event.input, FilterInput):
            event.stop()
            if not event.value.strip():
                self.close_filter()
            else:
                self.focus_main()
