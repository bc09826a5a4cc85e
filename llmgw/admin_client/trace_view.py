"""A trace (``GET /api/v1/traces/{id}``) as a timeline of text lines: `llmgw ctl trace` prints
it and the console shows it. Works from the JSON alone (fields a newer daemon adds are ignored,
missing ones shown as "-"); every string from the daemon goes through ``printable``."""

from __future__ import annotations

from datetime import datetime, tzinfo
from typing import Any

from llmgw.admin_client.printable import printable
from llmgw.admin_client.rationale import text_table

__all__ = ["BAR_WIDTH", "trace_lines"]

BAR_WIDTH = 32


def _ms(v: Any) -> str:
    if not isinstance(v, int | float) or isinstance(v, bool):
        return "-"
    return f"{v:.3f}" if v < 10 else f"{v:.2f}" if v < 1000 else f"{v:.0f}"


def _bytes(n: Any) -> str:
    if not isinstance(n, int) or isinstance(n, bool):
        return "-"
    return f"{n} B" if n < 1024 else f"{n / 1024:.1f} KiB" if n < 1 << 20 else f"{n / (1 << 20):.1f} MiB"


def _bar(start: float, duration: float | None, total: float) -> str:
    """The phase's place on a line of BAR_WIDTH cells (at least one cell, so each shows)."""
    if total <= 0:
        return "▏"
    a = int(max(0.0, min(start / total, 1.0)) * BAR_WIDTH)
    d = total - start if duration is None else duration
    b = max(a + 1, min(BAR_WIDTH, round((start + d) / total * BAR_WIDTH)))
    return " " * a + "█" * (b - a)


def _num(v: Any) -> float:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else 0.0


def trace_lines(t: dict[str, Any], tz: tzinfo | None = None) -> list[str]:
    """``tz``: the zone of the start time shown (None: the local one)."""
    p = lambda v: printable(str(v)) if v not in (None, "") else "-"  # noqa: E731
    total = t.get("total_ms")
    phases = [ph for ph in t.get("phases") or [] if isinstance(ph, dict)]
    attempts = [a for a in t.get("attempts") or [] if isinstance(a, dict)]
    span = _num(total) if total is not None else max(
        (_num(ph.get("start_ms")) + _num(ph.get("duration_ms")) for ph in phases), default=0.0)
    started = t.get("started_at")
    when = datetime.fromtimestamp(started, tz).strftime("%H:%M:%S.%f")[:-3] \
        if isinstance(started, int | float) and not isinstance(started, bool) and 0 <= started < 1e11 else "-"
    job = t.get("kind") == "job"  # a job's trace: its steps, no attempts or bytes
    head = [f"{p(t.get('kind'))} {p(t.get('id'))}  {p(t.get('name'))}  model {p(t.get('model'))}"
            + ("  stream" if t.get("stream") else ""),
            f"  {p(t.get('outcome'))}" + ("" if job else f" {p(t.get('status'))}")
            + f"  total {_ms(total)} ms  started {when}  "
            + ("" if job else f"{len(attempts)} attempt(s), {p(t.get('retries', 0))} retried  "
                              f"sent {_bytes(t.get('bytes_out'))}, received {_bytes(t.get('bytes_in'))}")
            + (f"  revision {p(t.get('revision'))}" if t.get("revision") else "")]
    if isinstance(t.get("tenant"), str):  # who sent it: admission's band and the share it got
        share = t.get("share")
        head.append(f"  tenant {p(t.get('tenant'))}  key {p(t.get('key'))}  band {p(t.get('band'))}"
                    + (f"  share {share:.2f}" if isinstance(share, (int, float)) and not isinstance(share, bool)
                       else ""))
    if t.get("trace_id"):  # W3C: the client's trace (its traceparent), or one of the router's own
        head.append(f"  trace {p(t.get('trace_id'))}  span {p(t.get('span_id'))}  "
                    + (f"parent {p(t.get('parent_span_id'))} (the client's)" if t.get("parent_span_id")
                       else "(no traceparent came: the router's own trace)"))
    head.append("")
    rows = []
    for ph in phases:
        n = ph.get("attempt")
        rows.append([_ms(ph.get("start_ms")), _ms(ph.get("duration_ms")) if ph.get("duration_ms") is not None
                     else "…", p(ph.get("name")), f"#{n}" if n else "",
                     _bar(_num(ph.get("start_ms")), ph.get("duration_ms"), span), printable(str(ph.get("note") or ""))])
    if job:
        rows = [r[:3] + r[4:] for r in rows]
    lines = head + text_table(["START ms", "TOOK ms", "STEP" if job else "PHASE"] + ([] if job else ["TRY"])
                              + ["TIMELINE", "NOTE"], rows)
    if attempts:
        lines.append("")
        lines.append("attempts:")
    for a in attempts:
        where = p(a.get("replica")) + (f" on {p(a.get('node'))}" if a.get("node") else "")
        outcome = p(a.get("outcome"))
        line = f"  #{p(a.get('n'))} {where}: {outcome}" + (f" {p(a.get('status'))}" if a.get("status") else "")
        if a.get("error"):
            line += f" ({p(a.get('error'))})"
        line += (f"; connected {_ms(a.get('connected_ms'))}, head {_ms(a.get('head_ms'))}, first byte "
                 f"{_ms(a.get('first_byte_ms'))}, ended {_ms(a.get('ended_ms'))} ms; {_bytes(a.get('bytes_in'))}")
        if a.get("retried"):
            line += "; retried elsewhere"
        lines.append(line)
        lines.append(f"      rationale: decision {p(a.get('decision'))} of `llmgw ctl explain {p(t.get('id'))}`")
    return lines
