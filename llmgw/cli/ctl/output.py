"""What ctl.py lends its command modules (ctl_routing.py, ctl_lifecycle.py): its output helpers and
error type, set once by ``lend`` when the parser is built — the command modules cannot import
ctl.py (it imports them)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["T", "lend"]


class _Tools:
    """emit(ns, data, render), table(rows, headers), and ctl's error type."""
    emit: Callable[..., None]
    table: Callable[..., str]
    error: type[Exception]


T = _Tools()


def lend(tools: dict[str, Any]) -> None:
    T.emit, T.table, T.error = tools["emit"], tools["table"], tools["error"]
