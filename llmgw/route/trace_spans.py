"""A finished request's trace as OpenTelemetry spans, as plain data (pure): what the shell's OTLP
exporter (``daemon/router/otel_export.py``) hands the OpenTelemetry SDK.

One trace becomes:

- the **request** span (kind server; its id ``Trace.span_id``; its parent the client's span when
  the client sent a valid ``traceparent``, else none: a root), from the trace's start to its end,
  with the request's attributes (model, strategy, revision, the replica that answered, status,
  outcome, retries, bytes) and an error status when it did not end ``ok``;
- one **attempt** span per try (kind client; its id ``AttemptRecord.span_id``: the span named in
  the ``traceparent`` the engine was sent, so an engine's own spans hang under it), with the
  replica, node, status, outcome and error of that try;
- each **phase** (prepare, queued, decide, connect, head, first_byte, body) on its attempt's span
  when it belongs to one, else on the request's: as a span event at the phase's start (its
  ``duration_ms`` and note as attributes) — or, with ``phase_spans``, as a child span of its own
  (a waterfall in a trace viewer; each span costs the SDK's encoder about as much CPU as the
  whole request costs the router: docs/router.md has the figures).

Times: the trace's marks are on the monotonic clock; a span's times are Unix nanoseconds, from
the trace's wall-clock start plus the monotonic offset (so the spans of one trace never drift
apart). Phase span ids come from the injected ``bits``. Tokens are not in the trace (the router
relays the body unread) and so are not in the spans."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .trace import Trace
from .traceparent import SAMPLED, new_span_id

__all__ = ["SpanData", "exported", "spans_of"]

AttrValue = str | int | float | bool


@dataclass(slots=True)
class SpanData:
    name: str
    span_id: str  # 16 hex digits
    parent_id: str  # "" for a root span
    kind: str  # "server", "client" or "internal"
    start_ns: int
    end_ns: int
    attributes: dict[str, AttrValue] = field(default_factory=dict)
    error: str | None = None  # None: not an error; else the status description
    events: list[tuple[str, int, dict[str, AttrValue]]] = field(default_factory=list)  # (name, Unix ns, attributes)


def exported(trace: Trace) -> bool:
    """A finished request's trace whose trace is sampled (the client's flag, or ours: always)."""
    return trace.kind == "request" and trace.ended is not None and bool(trace.trace_id) \
        and bool(trace.flags & SAMPLED)


def spans_of(trace: Trace, bits: Callable[[int], int], *, phase_spans: bool = False) -> list[SpanData]:
    """The trace's spans, the request's first (see the module's docstring). A trace still in
    flight has none."""
    if trace.ended is None or not trace.trace_id:
        return []
    t0, wall_ns = trace.started, int(trace.wall * 1e9)

    def ns(t: float) -> int:
        return wall_ns + int(round((t - t0) * 1e9))

    end = trace.ended
    last = trace.attempts[-1] if trace.attempts else None
    # Few attributes, each told once: the SDK's encoder costs ~8 µs an attribute (docs/router.md)
    attrs: dict[str, AttrValue] = {"llmgw.request_id": trace.id, "gen_ai.request.model": trace.model,
                                   "llmgw.outcome": trace.outcome}
    _put(attrs, "llmgw.strategy", trace.strategy)
    _put(attrs, "http.response.status_code", trace.status)
    _put(attrs, "llmgw.revision", trace.revision)
    if last is not None:
        attrs["llmgw.replica"] = last.replica
    retries = sum(a.retried for a in trace.attempts)
    if retries:
        attrs["llmgw.retries"] = retries
    if trace.stream:
        attrs["llmgw.stream"] = True
    root = SpanData(f"{trace.name} {trace.model}".strip() or "request", trace.span_id, trace.parent_span_id,
                    "server", ns(t0), ns(end), attrs,
                    None if trace.outcome == "ok" else f"{trace.outcome} ({trace.status})")
    out = [root]
    spans_by_attempt: dict[int, str] = {}
    for a in trace.attempts:
        if not a.span_id:
            continue
        spans_by_attempt[a.n] = a.span_id
        aa: dict[str, AttrValue] = {"llmgw.attempt": a.n, "llmgw.replica": a.replica,
                                    "llmgw.outcome": a.outcome or "in_flight"}
        _put(aa, "llmgw.node", a.node)
        _put(aa, "http.response.status_code", a.status)
        _put(aa, "error.type", a.error)
        if a.retried:
            aa["llmgw.retried"] = True
        stop = a.ended_at if a.ended_at is not None else end
        out.append(SpanData(f"attempt {a.n} {a.replica}", a.span_id, trace.span_id, "client", ns(a.sent_at),
                            ns(max(stop, a.sent_at)), aa, None if a.outcome == "ok" else (a.error or a.outcome)))
    marks = trace.marks
    holder = {s.span_id: s for s in out}
    for i, (phase, at, attempt, note) in enumerate(marks):
        stop = marks[i + 1][1] if i + 1 < len(marks) else end
        parent = spans_by_attempt.get(attempt, trace.span_id)
        pa: dict[str, Any] = {}
        _put(pa, "llmgw.note", note)
        if phase_spans:
            if attempt:
                pa["llmgw.attempt"] = attempt
            out.append(SpanData(phase, new_span_id(bits), parent, "internal", ns(at), ns(max(stop, at)), pa))
        else:
            pa["llmgw.duration_ms"] = round(max(stop - at, 0.0) * 1e3, 3)
            holder[parent].events.append((phase, ns(at), pa))
    return out


def _put(attrs: dict[str, Any], key: str, value: AttrValue | None) -> None:
    """Set an attribute that is known (OTLP has no null)."""
    if value is not None and value != "":
        attrs[key] = value
