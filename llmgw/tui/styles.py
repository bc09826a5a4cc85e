"""The console's look, as Textual CSS. Data first: thin chrome, the tables take the room. Kept in
Python rather than a .tcss file so that it ships with the package without package-data setup."""

from __future__ import annotations

__all__ = ["CONSOLE_CSS", "TONE_STYLE"]

# A row's or a message's tone (llmgw.tui.rows) as a Rich style.
TONE_STYLE = {"good": "green", "warn": "yellow", "bad": "bold red", "busy": "cyan", "dim": "dim"}

CONSOLE_CSS = """
#banner {
    display: none;
    background: $error;
    color: $text;
    text-style: bold;
    padding: 0 1;
    height: auto;
}

#views {
    height: 1fr;
}

TabPane {
    padding: 0;
}

.console-view {
    height: 1fr;
}

.filter {
    display: none;
    margin: 0 0;
}

.filter.open {
    display: block;
}

.section-title {
    color: $accent;
    text-style: bold;
    padding: 0 1;
    height: 1;
}

.detail {
    height: auto;
    max-height: 8;
    padding: 0 1;
    background: $boost;
}

#nodes-table, #decisions-table, #replicas-table, #cache-replicas-table {
    height: 1fr;
}

#models-table, #cache-models-table {
    height: auto;
    max-height: 10;
}

#status {
    height: 1;
    padding: 0 1;
    background: $panel;
    color: $text-muted;
}

#help-scroll {
    padding: 0 1;
}

/* rationale */
#candidates-table {
    height: auto;
    max-height: 60%;
}

#drops-table {
    height: 1fr;
}

/* label editor */
LabelEditor, ChoiceScreen {
    align: center middle;
}

#choice-list {
    height: auto;
    max-height: 12;
    margin: 1 0;
}

#label-dialog {
    width: 80;
    height: auto;
    padding: 1 2;
    border: thick $accent;
    background: $surface;
}

#label-dialog .detail {
    margin: 1 0;
}

#label-error {
    height: auto;
}

.hint {
    color: $text-muted;
}
"""
