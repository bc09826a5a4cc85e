"""The admin API's trace answers (``GET /api/v1/traces``, ``GET /api/v1/traces/{id}``): a
request's (or a job's) phases and attempts, as llmgw.route.trace records them. Offsets are
milliseconds from the trace's start on the router's monotonic clock; ``started_at`` is Unix time."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmgw.admin.typeinfo import prop
from llmgw.route.trace import Trace

__all__ = ["AttemptTraceView", "PhaseView", "TraceSummary", "TraceView", "trace_summary", "trace_view"]


@dataclass(slots=True)
class PhaseView:
    name: str = prop("prepare, queued, decide, connect, head, first_byte, body; a split request's prefill, "
                     "transfer, decode (a job names its own steps)")
    attempt: int = prop("the attempt it belongs to (1, 2, ...); 0: none")
    start_ms: float = prop("from the trace's start")
    duration_ms: float | None = prop("null: the phase is still running")
    note: str = prop("e.g. why a retry was made")


@dataclass(slots=True)
class AttemptTraceView:
    n: int = prop("1 for the first attempt")
    replica: str
    node: str | None = prop("the node it runs on; null for a static replica")
    revision: str = prop("the id of the model revision the replica serves (r1, r2, …); empty when not known")
    decision: int = prop("its decision's index in GET /api/v1/decisions/{request_id} (the rationale)")
    sent_ms: float
    connected_ms: float | None = prop("the connection was there (pooled or new)")
    head_ms: float | None = prop("the engine's response head came")
    first_byte_ms: float | None = prop("the first body byte went to the client")
    ended_ms: float | None
    status: int | None = prop("the engine's HTTP status, when it answered")
    outcome: str = prop("ok, connect, timeout, reset, http_5xx, client_cancel, or in_flight")
    error: str = prop("why it failed, as the client may read it (never an address)")
    retried: bool = prop("another attempt followed this one")
    bytes_in: int = prop("response body bytes relayed to the client")
    span_id: str = prop("the attempt's W3C span id (16 hex digits): the parent span the engine was sent in its "
                        "traceparent")
    phase: str = prop("a disaggregated model's split request: prefill (on a prefiller) or decode (with its KV); "
                      "empty otherwise", "")


@dataclass(slots=True)
class TraceView:
    """One request (or job) phase by phase: the phases are contiguous, so their durations add up
    to total_ms."""
    id: str = prop("the request id (x-request-id), or the job's id")
    kind: str = prop("request or job")
    name: str = prop("a request's endpoint kind (chat, completions, embeddings); a job's title")
    model: str = prop("the model as the client named it")
    stream: bool
    started_at: float = prop("Unix time")
    total_ms: float | None = prop("null while in flight")
    outcome: str = prop("ok, engine_error, upstream_failed, failed, rejected, client_cancelled, or in_flight")
    status: int | None = prop("the status the client got")
    revision: str = prop("the id of the model revision that served it (r1, r2, …); empty when not known")
    bytes_out: int = prop("request body bytes")
    bytes_in: int = prop("response body bytes relayed to the client")
    retries: int
    trace_id: str = prop("the W3C trace id (32 hex digits): the client's when it sent a valid traceparent, else "
                         "the router's own; empty for a job")
    span_id: str = prop("the router's span for the request (16 hex digits); empty for a job")
    parent_span_id: str = prop("the client's span (its traceparent's parent-id); empty when it sent none")
    phases: list[PhaseView]
    attempts: list[AttemptTraceView]
    tenant: str | None = prop("the tenant that sent it (\"-\": none named); null for a job", None)
    key: str | None = prop("the API key's id (\"static\": a key of [server] api_keys, \"-\": none); null for a job",
                           None)
    band: str | None = prop("its priority band (batch, low, normal, high, critical); null for a job", None)
    share: float | None = prop("its tenant's share of the band when admission let it through (1.0 when it did not "
                               "wait); null for a job", None)


@dataclass(slots=True)
class TraceSummary:
    """A trace in a listing: GET /api/v1/traces/{id} has its phases."""
    id: str
    kind: str
    model: str
    started_at: float = prop("Unix time")
    total_ms: float | None = prop("null while in flight")
    outcome: str
    status: int | None
    attempts: int
    replica: str | None = prop("the last attempt's replica")
    trace_id: str = prop("the W3C trace id; empty for a job")


def trace_view(t: Trace, now: float) -> TraceView:
    d: dict[str, Any] = t.to_dict(now)
    d["phases"] = [PhaseView(**p) for p in d["phases"]]
    d["attempts"] = [AttemptTraceView(**a) for a in d["attempts"]]
    return TraceView(**d)


def trace_summary(t: Trace) -> TraceSummary:
    return TraceSummary(id=t.id, kind=t.kind, model=t.model, started_at=t.wall,
                        total_ms=None if t.ended is None else round((t.ended - t.started) * 1e3, 3),
                        outcome=t.outcome or "in_flight", status=t.status, attempts=len(t.attempts),
                        replica=t.attempts[-1].replica if t.attempts else None, trace_id=t.trace_id)
