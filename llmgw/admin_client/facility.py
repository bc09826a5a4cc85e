"""How `llmgw ctl facility` and `llmgw ctl explain-placement` print the admin API's answers
(docs/placement.md): the domains with their holds and power, and a placement's explanation."""

from __future__ import annotations

import time
from typing import Any

from llmgw.admin_client.printable import printable
from llmgw.admin_client.rationale import text_table

__all__ = ["explanation_text", "facility_text"]

_SHOWN_ROWS = 50  # candidates printed; -o json has them all


def _c(v: Any) -> str:
    return "-" if v is None else printable(str(v))


def _watts(w: Any) -> str:
    return "-" if w is None else f"{float(w):,.0f} W"


def facility_text(data: dict[str, Any]) -> str:
    rows = []
    for d in data.get("domains", []):
        cap = d.get("cap_w")
        draw = d.get("draw_w", 0.0)
        use = f"{draw / cap:.0%}" if cap else "-"
        held = ("held" + (" (drain)" if d.get("hold_drain") else "") + (f": {d['hold_reason']}" if d.get("hold_reason")
                                                                      else "")) if d.get("held") else "-"
        rows.append([_c(d.get("domain")), _c(d.get("parent")), f"{d.get('ready_nodes', 0)}/{d.get('nodes', 0)}",
                     _c(d.get("replicas")), _watts(draw), _watts(cap), use, printable(held)])
    lines = text_table(["DOMAIN", "IN", "READY/NODES", "REPLICAS", "DRAW", "CAP", "USE", "HOLD"], rows)
    if not rows:
        lines = ["no node has facility labels (llmgw.io/site, room, row, rack, pdu): `llmgw ctl label NODE rack=r1`"]
    for h in data.get("holds", []):
        if not any(d.get("domain") == h.get("domain") for d in data.get("domains", [])):
            lines.append(f"held, with no node in it now: {_c(h.get('domain'))}")
    for b in data.get("budgets_without_nodes", []):
        lines.append(f"budget for a domain no node is in: {_c(b)}")
    for w in data.get("warnings", []):
        lines.append(f"warning: {_c(w)}")
    return "\n".join(lines)


def explanation_text(e: dict[str, Any]) -> str:
    head = f"replica {_c(e.get('replica'))} of model {_c(e.get('model'))}" if e.get("replica") \
        else f"model {_c(e.get('model'))}: its next replica"
    lines = [head + (" (now)" if e.get("replica") else ""), f"  {_c(e.get('why'))}"]
    counts = e.get("counts", {})
    if counts:
        lines.append("  nodes: " + ", ".join(f"{_c(v)} {_c(k)}" for k, v in sorted(counts.items(),
                                                                                     key=lambda kv: -kv[1])))
    cands = e.get("candidates", [])
    rows = [[_c(c.get("node")), _c(c.get("verdict")), "/".join(map(_c, c.get("domains", []))) or "-",
             _c(c.get("detail"))] for c in cands[:_SHOWN_ROWS]]
    lines += ["", *text_table(["NODE", "VERDICT", "DOMAINS", "DETAIL"], rows)]
    more = len(cands) - len(rows) + int(e.get("truncated", 0) or 0)
    if more > 0:
        lines.append(f"... and {more} more (-o json lists {len(cands)})")
    for w in e.get("warnings", []):
        lines.append(f"warning: {_c(w)}")
    if e.get("replica"):
        lines += ["", *_at_placement_text(e.get("at_placement"))]
    return "\n".join(lines)


def _at_placement_text(r: dict[str, Any] | None) -> list[str]:
    """A placed replica's verdicts when it was placed, below now's."""
    if not r:
        return ["at placement: not kept (placed before this router started, or among the oldest past the records "
                "kept; docs/placement.md)"]
    try:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(r.get("at", 0))))
    except (TypeError, ValueError, OverflowError):
        when = "?"
    lines = [f"at placement ({when}):", f"  {_c(r.get('why'))}"]
    counts = r.get("counts", {})
    if counts:
        lines.append("  nodes: " + ", ".join(f"{_c(v)} {_c(k)}" for k, v in sorted(counts.items(),
                                                                                     key=lambda kv: -kv[1])))
    cands = r.get("candidates", [])
    rows = [[_c(c.get("node")), _c(c.get("verdict")), "/".join(map(_c, c.get("domains", []))) or "-",
             _c(c.get("detail"))] for c in cands[:_SHOWN_ROWS]]
    lines += text_table(["NODE", "VERDICT THEN", "DOMAINS", "DETAIL"], rows)
    if int(r.get("truncated", 0) or 0) > 0:
        lines.append(f"... and {r['truncated']} more (counted above)")
    return lines
