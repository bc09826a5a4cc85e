"""The console's Facility view as plain data (the rows.py pattern): every failure domain with its
hold, nodes, replicas and power draw against its budget — what ``llmgw ctl facility`` prints,
from ``GET /api/v1/facility`` (a ConsoleState's ``facility``, fetched while the view is shown).
Pure: tested without a terminal."""

from __future__ import annotations

from llmgw.admin_client.rationale import DASH
from llmgw.tui.rows import Column, Row, _filtered, _num, _str
from llmgw.tui.state import ConsoleState, as_list

__all__ = ["FACILITY_COLUMNS", "NEAR_CAP", "facility_detail", "facility_rows", "facility_summary_lines"]

FACILITY_COLUMNS = (Column("domain"), Column("level"), Column("held", toned=True), Column("nodes"),
                    Column("replicas"), Column("draw"), Column("cap"), Column("use"), Column("parent"))
NEAR_CAP = 0.9  # a domain drawing this share of its budget or more is shown in warning


def fmt_watts(w: object) -> str:
    if not isinstance(w, (int, float)) or isinstance(w, bool) or w < 0:
        return DASH
    return f"{w / 1000:.1f} kW" if w >= 10_000 else f"{w:.0f} W"


def _hold_text(d: dict[str, object]) -> str:
    if not d.get("held"):
        return ""
    reason = _str(d.get("hold_reason"), "")
    return ("drain" if d.get("hold_drain") else "held") + (f": {reason}" if reason else "")


def facility_rows(state: ConsoleState, text: str = "") -> list[Row]:
    """One row per domain, outermost level first (the daemon's order). Tones: a hold is `warn`
    (`busy` while draining); a domain at or past its budget `bad`, near it `warn`; a domain
    with nodes not ready `warn`."""
    rows: list[Row] = []
    for d in as_list(state.facility.get("domains")):
        name = _str(d.get("domain"), "?")
        draw, cap = d.get("draw_w"), d.get("cap_w")
        capped = isinstance(cap, (int, float)) and not isinstance(cap, bool) and cap > 0
        use = _num(draw) / float(cap) if capped else None  # type: ignore[arg-type]
        nodes, ready = int(_num(d.get("nodes"))), int(_num(d.get("ready_nodes")))
        tone = ""
        if use is not None and use >= 1.0:
            tone = "bad"
        elif d.get("held"):
            tone = "busy" if d.get("hold_drain") else "warn"
        elif (use is not None and use >= NEAR_CAP) or ready < nodes:
            tone = "warn"
        unknown = int(_num(d.get("unknown_power_nodes")))
        rows.append(Row(name, (
            name, _str(d.get("level")), _hold_text(d), f"{ready}/{nodes}", str(int(_num(d.get("replicas")))),
            fmt_watts(draw) + (f" (+{unknown} unknown)" if unknown else ""),
            fmt_watts(cap) if capped else DASH, f"{use * 100:.0f}%" if use is not None else DASH,
            _str(d.get("parent"))), tone))
    return _filtered(rows, text)


def facility_summary_lines(state: ConsoleState) -> list[str]:
    f = state.facility
    if not f:
        return ["no facility view yet (fetched from the daemon while this view is shown)"]
    domains = as_list(f.get("domains"))
    holds = as_list(f.get("holds"))
    out = [f"{len(domains)} domains · {len(holds)} held"
           + "".join(f" · {_str(h.get('domain'), '?')}{' (drain)' if h.get('drain') else ''}: "
                     f"{int(_num(h.get('replicas')))} replicas left" for h in holds[:4])
           + (" · …" if len(holds) > 4 else "")]
    over = [d for d in domains if isinstance(d.get("cap_w"), (int, float)) and _num(d.get("cap_w")) > 0
            and _num(d.get("draw_w")) >= _num(d.get("cap_w"))]
    if over:
        out.append("at or past budget: " + ", ".join(_str(d.get("domain"), "?") for d in over[:8]))
    lonely = [b for b in f.get("budgets_without_nodes") or [] if isinstance(b, str)]
    if lonely:
        out.append("budgets naming no node's domain: " + ", ".join(lonely[:8]))
    out += [f"warning: {w}" for w in (f.get("warnings") or [])[:3] if isinstance(w, str)]
    return out


def facility_detail(state: ConsoleState, domain: str | None) -> list[str]:
    d = next((x for x in as_list(state.facility.get("domains")) if x.get("domain") == domain), None)
    if d is None:
        return []
    out = [f"{domain}  (level {_str(d.get('level'))}, in {_str(d.get('parent'))})"]
    if d.get("held"):
        out.append(f"held{' with drain' if d.get('hold_drain') else ''}: {_str(d.get('hold_reason'), 'no reason')}"
                   " — h releases it (release " + _str(d.get("level"), "LEVEL") + ")")
    else:
        out.append("not held — h holds it (enter: hold; 'drain REASON' moves its replicas first)")
    return out
