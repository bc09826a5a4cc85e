"""The console's LoRA adapters view as plain data (the rows.py pattern): which vLLM replica holds
which adapter, the loads in progress with the requests waiting for them, failed loads in backoff.
Pure, built from a ConsoleState's ``adapters`` section (``GET /api/v1/adapters``)."""

from __future__ import annotations

from llmgw.tui.rows import Column, Row, _filtered, _num, _str, fmt_age
from llmgw.tui.state import ConsoleState, as_dict, as_list

__all__ = ["ADAPTER_COLUMNS", "adapter_rows", "adapter_summary_lines"]

ADAPTER_COLUMNS = (Column("replica"), Column("model"), Column("slots"), Column("adapter"),
                   Column("state", toned=True), Column("inflight"), Column("idle"), Column("note"))
STATE_TONES = {"loaded": "good", "pinned": "dim", "loading": "busy", "unloading": "busy", "failed": "bad"}


def adapter_rows(state: ConsoleState, text: str = "") -> list[Row]:
    """One row per (replica, adapter): held, loading, or failed; a replica holding none gets one
    row so that its free slots show."""
    present = state.present_replicas()
    rows: list[Row] = []
    for r in as_list(state.adapters.get("replicas")):
        rid = _str(r.get("replica"), "?")
        if present and rid not in present:
            continue
        head = (rid, _str(r.get("model"), "?"), f"{int(_num(r.get('used')))}/{int(_num(r.get('cap')))}")
        items: list[tuple[str, tuple[str, ...], str]] = []
        for a in as_list(r.get("adapters")):
            st = _str(a.get("state"), "?")
            note = ""
            if st == "loading":
                note = f"{int(_num(a.get('waiting')))} waiting"
                if a.get("unloading"):
                    note += f", unloading {_str(a.get('unloading'))}"
            idle = a.get("idle_s")
            items.append((_str(a.get("adapter"), "?"),
                          (st, str(int(_num(a.get("inflight")))), fmt_age(idle) if idle is not None else "-", note),
                          STATE_TONES.get(st, "")))
        for f in as_list(r.get("failed")):
            note = (f"retry in {fmt_age(f.get('retry_in_s'))} ({int(_num(f.get('failures'), 1))}x): "
                    f"{_str(f.get('reason'), '')}")
            items.append((_str(f.get("adapter"), "?"), ("failed", "0", "-", note), "bad"))
        if not items:
            rows.append(Row(f"{rid}\0", (*head, "-", "", "", "", ""), "dim", search=rid))
        for name, cells, tone in items:
            rows.append(Row(f"{rid}\0{name}\0{cells[0]}", (*head, name, *cells), tone, search=rid))
    return _filtered(rows, text)


def adapter_summary_lines(state: ConsoleState) -> list[str]:
    a = state.adapters
    if not a:
        return ["no adapter summary yet"]
    loads = as_dict(a.get("loads"))
    unloads = as_dict(a.get("unloads"))
    done = ", ".join(f"{k} {v}" for k, v in loads.items() if v) or "none"
    out = ", ".join(f"{k} {v}" for k, v in unloads.items() if v) or "none"
    return [f"loads: {done} · unloads to make room: {out} · requests waiting for a load: {int(_num(a.get('waiting')))}"]
