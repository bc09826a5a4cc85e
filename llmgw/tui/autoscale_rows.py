"""What the Models view shows of an autoscaled model (GET /api/v1/autoscale, fetched while the view
is on screen; docs/autoscaling.md): a cell in the models table — the count in force over ready and
starting replicas, its bounds, a pin and the autoscaler's mode — and, for the selected model, the
latest decision with what limited it and the last decisions, as `llmgw ctl explain-scale` words
them. Pure: no Textual; a daemon without autoscaling has no views, and its models show nothing
extra."""

from __future__ import annotations

from datetime import tzinfo
from typing import Any

from llmgw.admin_client.rationale import DASH, fmt_time
from llmgw.tui.state import ConsoleState, as_dict, as_list

__all__ = ["HISTORY_SHOWN", "autoscale_cell", "autoscale_lines"]

HISTORY_SHOWN = 5  # the last decisions under the selected model


def _int(v: Any) -> str:
    return str(v) if isinstance(v, int) and not isinstance(v, bool) else "?"


def autoscale_cell(view: dict[str, Any] | None) -> str:
    """``count/ready/starting [min–max] mode``; a pin reads ``pinned N``: e.g. ``3/2/1 [1–4] stable``."""
    if not view:
        return DASH
    d = as_dict(view.get("decision"))
    pinned = view.get("pinned")
    mode = f"pinned {_int(pinned)}" if pinned is not None else (d.get("mode") if isinstance(d.get("mode"), str)
                                                                   else "waiting")
    return (f"{_int(view.get('count'))}/{_int(view.get('ready'))}/{_int(view.get('starting'))} "
            f"[{_int(view.get('min'))}–{_int(view.get('max'))}] {mode}")


def autoscale_lines(state: ConsoleState, model: str | None, tz: tzinfo | None = None) -> list[str]:
    """The selected model's autoscaler: the rule, the decision and what limited it, the last
    decisions (newest first). Empty for a model without one."""
    view = state.autoscale.get(model or "")
    if not view:
        return []
    d = as_dict(view.get("decision"))
    out = [f"{model}: autoscaled on {view.get('metric', '?')} (target {view.get('target', '?')}), "
           f"{autoscale_cell(view)}; cold start {view.get('cold_start_s', '?')} s"
           + (" · pinned by `llmgw ctl scale`: `--release` hands it back" if view.get("pinned") is not None else "")]
    if not d:
        out.append("  no decision yet")
        return out
    out.append(f"  rule: {d.get('rule') or DASH}")
    limits = "; ".join(str(x) for x in d.get("limited_by") or []) or "nothing"
    out.append(f"  now: {_int(d.get('current'))} → {_int(d.get('desired'))} ({d.get('mode', '?')})"
               + (f": {d['reason']}" if d.get("reason") else "") + f" · limited by {limits}")
    for h in as_list(view.get("history"))[:HISTORY_SHOWN]:
        out.append(f"  {fmt_time(h.get('t_wall'), tz)}  {_int(h.get('current'))} → {_int(h.get('desired'))}  "
                   f"{h.get('mode', '?')}" + (f": {h['reason']}" if h.get("reason") else ""))
    return out
