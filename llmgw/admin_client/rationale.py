"""A routing decision's rationale, from the admin API's decision record to text: its facts, the
candidates × scorers matrix (weights in the column headers, best total first, the chosen one
marked ▶) and the endpoints the filters dropped, with why. `llmgw ctl explain` prints
:func:`rationale_lines`; the console shows the same cells of :func:`explain` in its tables, styled.

Pure: no Textual, no I/O, no clock (a decision's wall time is formatted in the zone the caller
passes; None: the machine's). Tolerant: a field missing or of the wrong type shows as ``—``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, tzinfo
from typing import Any

__all__ = ["DASH", "DROP_COLUMNS", "CandidateRow", "Rationale", "explain", "fmt_score", "fmt_time", "fmt_us",
           "fmt_weight", "rationale_lines", "text_table"]

DASH = "—"
CHOSEN_MARK = "▶ "
DROP_COLUMNS = ("filter", "endpoint", "reason")


# -- formatting -------------------------------------------------------------------------------------
def fmt_us(us: Any) -> str:
    if not isinstance(us, (int, float)):
        return DASH
    if us < 1000:
        return f"{us:.0f}µs"
    if us < 1_000_000:
        return f"{us / 1000:.1f}ms"
    return f"{us / 1_000_000:.2f}s"


def fmt_time(unix: Any, tz: tzinfo | None) -> str:
    """Wall time of a decision (HH:MM:SS.mmm) in ``tz``; None: the machine's local zone."""
    if not isinstance(unix, (int, float)):
        return DASH
    return datetime.fromtimestamp(unix, tz).strftime("%H:%M:%S.%f")[:-3]


def fmt_score(v: Any) -> str:
    return f"{v:.2f}" if isinstance(v, (int, float)) else DASH


def fmt_weight(w: Any) -> str:
    return f"{w:g}" if isinstance(w, (int, float)) else "?"


def _str(v: Any, default: str = DASH) -> str:
    return v if isinstance(v, str) and v else default


def _num(v: Any, default: float = 0.0) -> float:
    return float(v) if isinstance(v, (int, float)) else default


def _dict(v: Any) -> dict[str, Any]:
    return v if isinstance(v, dict) else {}


def _objects(v: Any) -> list[dict[str, Any]]:
    return [x for x in v if isinstance(x, dict)] if isinstance(v, list) else []


def _strs(v: Any) -> list[str]:
    return [str(x) for x in v] if isinstance(v, list) else []


# -- the layout -------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class CandidateRow:
    cells: tuple[str, ...]  # endpoint (▶ when chosen), a score per scorer column, total, flags
    chosen: bool


@dataclass(frozen=True, slots=True)
class Rationale:
    """One decision laid out as text cells."""

    facts: list[tuple[str, str]]  # (name, value): request, model, chosen, strategy, picker, decided, took, note
    # (and tenant, band when the record has them)
    columns: tuple[str, ...]  # endpoint, "<scorer> ×<weight>"..., total, flags
    candidates: list[CandidateRow]  # best total first
    hidden: int  # candidates scored but not kept in the decision (it keeps the best few)
    drops: list[tuple[str, str, str]] = field(default_factory=list)  # DROP_COLUMNS

    @property
    def candidates_title(self) -> str:
        more = f" — {self.hidden} more scored but not kept" if self.hidden else ""
        return f"candidates × scorers: scores 0..1 (1 = best), total = Σ weight × score{more}"

    @property
    def drops_title(self) -> str:
        return f"dropped by filters ({len(self.drops)})"


def _scorers(weights: Mapping[str, Any], candidates: Sequence[Mapping[str, Any]]) -> list[str]:
    """Weighted scorers, heaviest first; then any that scored without a weight."""
    named = sorted(weights, key=lambda s: (-_num(weights[s]), s))
    extra = sorted({s for c in candidates for s in _dict(c.get("scores"))} - set(weights))
    return [*named, *extra]


def explain(d: Mapping[str, Any], tz: tzinfo | None = None) -> Rationale:
    """A decision record (GET /api/v1/decisions/{id}, or the event stream's) as a Rationale."""
    weights = _dict(d.get("weights"))
    cands = _objects(d.get("candidates"))
    scorers = _scorers(weights, cands)
    chosen = d.get("chosen")
    rows: list[CandidateRow] = []
    for c in sorted(cands, key=lambda c: -_num(c.get("total"))):
        ep = _str(c.get("endpoint"), "?")
        scores = _dict(c.get("scores"))
        mine = ep == chosen
        rows.append(CandidateRow(((CHOSEN_MARK if mine else "  ") + ep, *(fmt_score(scores.get(s)) for s in scorers),
                                  fmt_score(c.get("total")), "; ".join(_strs(c.get("flags")))), mine))
    drops = [(_str(x.get("filter"), "?"), _str(x.get("endpoint"), "?"), _str(x.get("reason"), ""))
             for x in _objects(d.get("dropped"))]
    n = d.get("n_candidates")
    facts = [("request", _str(d.get("request_id"), "?")), ("model", _str(d.get("model"), "?")),
             ("chosen", _str(chosen, "none")), ("strategy", _str(d.get("strategy"))),
             ("picker", _str(d.get("picker"))), ("decided", fmt_time(d.get("decided_at"), tz)),
             ("took", fmt_us(d.get("decide_us"))), ("note", _str(d.get("note")))]
    if d.get("phase"):  # a disaggregated model's split request: the prefiller's or the decoder's decision
        facts.insert(1, ("step", _str(d.get("phase"))))
    if isinstance(d.get("tenant"), str):  # admission: who sent it, its band and share (routers since issue 24)
        share = d.get("share")
        facts += [("tenant", _str(d.get("tenant"))),
                  ("band", _str(d.get("band")) + (f", share {share:.2f}" if isinstance(share, (int, float)) else ""))]
    columns = ("endpoint", *(f"{s} ×{fmt_weight(weights.get(s))}" for s in scorers), "total", "flags")
    return Rationale(facts, columns, rows, max(0, n - len(cands)) if isinstance(n, int) else 0, drops)


# -- as plain text ----------------------------------------------------------------------------------
def text_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Columns padded to their widest cell, two spaces apart, trailing blanks trimmed."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [headers, *rows]]


def rationale_lines(d: Mapping[str, Any], tz: tzinfo | None = None) -> list[str]:
    """The rationale as the console lays it out: the facts two to a line, then each table under
    its title."""
    r = explain(d, tz)
    key_width = max(len(k) for k, _ in r.facts)
    pairs = [r.facts[i:i + 2] for i in range(0, len(r.facts), 2)]
    value_width = max(len(p[0][1]) for p in pairs)
    out = [(f"{p[0][0]:<{key_width}}  {p[0][1]:<{value_width}}"
            + "".join(f"  {k:<{key_width}}  {v}" for k, v in p[1:])).rstrip() for p in pairs]
    out += ["", r.candidates_title, *text_table(r.columns, [c.cells for c in r.candidates])]
    out += ["", r.drops_title]
    if r.drops:
        out += text_table(DROP_COLUMNS, r.drops)
    return out
