"""A disaggregated model's groups in words, as `llmgw ctl models` and the console show them (the
admin API's model view's ``groups``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmgw.admin_client.printable import printable

__all__ = ["groups_text"]


def groups_text(view: Mapping[str, Any]) -> str:
    """A disaggregated model's roles, ready/desired each: ``prefill 1/1, decode 2/2`` (a role of
    static endpoints only: ``prefill 2 static``); "" for a model without roles."""
    out = []
    for g in view.get("groups") or ():
        if not isinstance(g, Mapping):
            continue
        role = printable(str(g.get("role", "?")))
        static = f"{g.get('static')} static" if g.get("static") else ""
        if g.get("desired") or not static:
            out.append(f"{role} {g.get('ready', 0)}/{g.get('desired', 0)}" + (f" + {static}" if static else ""))
        else:
            out.append(f"{role} {static}")
    return ", ".join(out)
