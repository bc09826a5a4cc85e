"""Text from the daemon made safe for a terminal, for `llmgw ctl` and `llmgw console` alike.

Node names, labels, reasons, engines' messages and log lines come from agents and engines: from
outside, so untrusted. Printed raw, an escape sequence in them would be obeyed by the terminal
(clear the screen, retitle the window, forge colours or lines) and a bidi override would reorder
what the operator reads. Here each such character shows as an escape (`\\x1b`, `\\u202e`)."""

from __future__ import annotations

__all__ = ["printable"]

# C0 and C1 controls and the bidirectional overrides: what a terminal would obey rather than show
_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))}
_CONTROLS.update({c: f"\\u{c:04x}" for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A))})


def printable(text: str, keep_newlines: bool = False) -> str:
    """Text from the daemon (names, reasons, engines' messages: agents' words, so untrusted) made
    safe for a terminal: an escape sequence or a bidi override shows as `\\x1b`, `\\u202e`."""
    table = {k: v for k, v in _CONTROLS.items() if k != 0x0A} if keep_newlines else _CONTROLS
    return text.translate(table)
