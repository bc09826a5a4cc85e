"""What every `llmgw ctl` command prints with, as plain functions: ``emit`` (the API's JSON with
`-o json`, else the command's text), ``table`` (rows under headers, one line each), ``age``, and
``CtlError``, the one error a command raises to tell the operator what failed and what to do."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from llmgw.admin_client.printable import printable
from llmgw.admin_client.rationale import text_table

__all__ = ["CtlError", "age", "emit", "table"]


class CtlError(Exception):
    """A failure to tell the operator, with what to do about it."""


def table(rows: list[list[Any]], headers: list[str]) -> str:
    return "\n".join(text_table(headers, [[_cell(c) for c in row] for row in rows]))


def _cell(v: Any) -> str:
    """One table cell, on one line whatever the daemon sent."""
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, list | tuple):
        return printable(",".join(map(str, v))) or "-"
    return printable(str(v))


def age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    return f"{s}s" if s < 120 else f"{s // 60}m" if s < 7200 else f"{s // 3600}h"


def emit(ns: argparse.Namespace, data: Any, render: Callable[[Any], str]) -> None:
    if ns.output == "json":
        print(json.dumps(data, indent=2, sort_keys=True))  # ensure_ascii: no control character gets through
    else:
        print(printable(render(data), keep_newlines=True))
