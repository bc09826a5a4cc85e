"""`llmgw ctl config check|reload`: the config file the daemon started with, against what runs
(docs/configuration.md, "Reloading the config file"). main registers it (`register`); the output
functions come from output."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from llmgw.cli.ctl.output import emit, table

__all__ = ["register"]

_ACTIONS = {"apply": "apply now", "candidate": "candidate", "restart": "at next start"}


def _text(r: dict[str, Any]) -> str:
    changes = r["changes"]
    head = f"config file {r['file']}: " + (f"{len(changes)} change{'s' if len(changes) != 1 else ''}"
                                           if changes else "no change from what runs")
    if not changes:
        return head
    rows = [[c["section"], c["key"] or "-", _ACTIONS.get(c["action"], c["action"]), f"{c['old']} → {c['new']}",
             c["why"]] for c in changes]
    out = [head + (" (applied)" if r["applied"] else " (nothing changed: `llmgw ctl config reload` applies them)"),
           table(rows, ["SECTION", "KEY", "ACTION", "CHANGE", "WHY"])]
    if r["jobs"]:
        out.append("candidates: " + ", ".join(r["jobs"]) + " (llmgw ctl jobs JOB; llmgw ctl models promote MODEL)")
    return "\n".join(out)


def cmd_config(api: Any, ns: argparse.Namespace) -> None:
    if ns.action == "check":
        emit(ns, api.call("GET", "/config/check"), _text)
    else:
        emit(ns, api.call("POST", "/config/reload"), _text)


def register(add: Callable[..., argparse.ArgumentParser]) -> None:
    sp = add("config", cmd_config, "check or reload the config file the daemon started with",
             "check: every difference between the config file and what runs, and what a reload would do with "
             "each: apply it at once (strategies, budgets, scale, …), make the model's new definition a candidate "
             "(eval → promote, like `models update`), or wait for the next start (listen addresses, …). reload: "
             "do it (SIGHUP to the daemon does the same). A file that does not parse changes nothing.")
    sp.add_argument("action", choices=["check", "reload"], help="check: show the differences; reload: apply them")
