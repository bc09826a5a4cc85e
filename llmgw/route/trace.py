"""Traces: what happened to one request (or one job), phase by phase, on the monotonic clock.

A :class:`Trace` is plain data. Its **phases** are contiguous: each mark opens a phase and closes
the one before, so the phases' durations add up to the trace's total exactly (the request's
latency as the router saw it, from ``plan`` to its last byte). Times are passed in (the core
never reads a clock); they are the trio shell's ``trio.current_time()`` for requests.

A request's phases, in order (``attempt`` says which try a phase belongs to; 0: none):

``prepare``    parse the body, resolve the model and strategy (and tier 2's tokenize step)
``queued``     admission: every replica was saturated, the request waited in the model's queue
``decide``     the scheduler's decision (its rationale is decision number ``decision`` of the
               request in ``GET /api/v1/decisions/{request_id}``)
``connect``    an attempt takes a pooled connection, or opens one
``head``       the request is sent; the engine's response head is awaited
``first_byte`` the head is in; the first body byte is awaited (prefill, on a stream)
``body``       the body is relayed to the client, up to its last byte

A disaggregated model's split request (:mod:`.pd`) has ``prefill`` (its prefill attempt, on a
prefiller, whole) before its decode attempt's ``decide``; that attempt's first byte and body
phases (after ``connect``) are ``transfer`` (the request is sent; the decoder pulls the prompt's
KV blocks and makes its first token) and ``decode`` (the body).

Each attempt also gets an :class:`AttemptRecord`: replica, node, revision, the decision's index,
its times, status, how it ended and — when another attempt followed — why it was retried.

Jobs (model updates, evals, promotions) use the same type with ``kind="job"``::

    t = Trace("job-42", kind="job", name="update qwen-7b", started=now, wall=wall)
    t.mark("place", now, note="2 replicas beside the live ones")
    t.mark("wait_ready", now2)
    t.end(now3, "ok")            # or "failed", with a status of the job's choosing
    t.to_dict()                  # the admin API's TraceView, as JSON-ready data

and :meth:`TraceRing.add` makes one findable with the requests' (``GET /api/v1/traces/{id}``).

A request's trace is also a W3C trace (:mod:`.traceparent`): ``trace_id`` is the client's when
its ``traceparent`` was valid (``parent_span_id`` its span), else one of the router's own;
``span_id`` is the router's span for the whole request, and each attempt has a span of its own
(``AttemptRecord.span_id``), the parent of what the engine traces (it gets that span in its
``traceparent``). A job's trace has none of these ("")."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

from .traceparent import format_traceparent

__all__ = ["AttemptRecord", "Trace", "TraceRing", "MAX_NAME", "MAX_NOTE", "upstream_headers"]

MAX_NAME = 256  # characters of a model name kept (a client may send any; real ones are short)
MAX_NOTE = 512  # characters of a phase's note or an attempt's error kept (an engine's words are input)
MAX_MARKS = 64  # phases kept per trace: a job's steps, or max_attempts × 5 (+3); the rest are dropped


class AttemptRecord:
    """One try on one replica. Times are monotonic seconds (None: not reached)."""

    __slots__ = ("bytes_in", "connected_at", "decision", "ended_at", "error", "first_byte_at", "head_at", "n",
                 "node", "outcome", "phase", "replica", "retried", "revision", "sent_at", "span_id", "status")

    def __init__(self, n: int, replica: str, node: str | None, revision: str, decision: int, sent_at: float,
                 span_id: str = "") -> None:
        self.n, self.replica, self.node, self.revision, self.decision = n, replica, node, revision, decision
        self.sent_at = sent_at
        self.span_id = span_id  # the attempt's span (16 hex digits): the engine's traceparent names it
        self.connected_at: float | None = None
        self.head_at: float | None = None
        self.first_byte_at: float | None = None
        self.ended_at: float | None = None
        self.status: int | None = None
        self.outcome = ""  # ok / connect / timeout / reset / http_5xx / client_cancel ...
        self.error = ""  # why it failed, in words a client may read (never an address)
        self.retried = False  # another attempt followed this one
        self.bytes_in = 0  # response body bytes relayed to the client
        self.phase = ""  # disaggregation: "prefill" (its answer read by the router) or "decode"; "": neither


class Trace:
    __slots__ = ("attempts", "band", "bytes_in", "bytes_out", "decisions", "ended", "flags", "id", "key", "kind",
                 "marks", "model", "name", "outcome", "parent_span_id", "revision", "share", "span_id", "started",
                 "status", "strategy", "stream", "tenant", "trace_id", "tracestate", "wall")

    def __init__(self, id: str, *, kind: str = "request", name: str = "", started: float, wall: float,
                 model: str = "", stream: bool = False, bytes_out: int = 0) -> None:
        self.id, self.kind, self.name, self.model, self.stream = id, kind, name, model, stream
        self.started, self.wall = started, wall
        self.marks: list[tuple[str, float, int, str]] = []  # (phase, start, attempt, note)
        self.attempts: list[AttemptRecord] = []
        self.decisions = 0  # routing decisions made for it (the next one's index)
        self.ended: float | None = None
        self.outcome = ""  # "" while in flight
        self.status: int | None = None
        self.revision = ""
        self.strategy = ""  # a request's routing strategy (its spans say it)
        self.bytes_out = bytes_out  # request body bytes
        self.bytes_in = 0
        # W3C trace context (a request's; "" for a job): see the module's docstring
        self.trace_id = ""
        self.span_id = ""
        self.parent_span_id = ""  # the client's span, when its traceparent was valid
        self.flags = 0  # trace flags (SAMPLED)
        self.tracestate = ""  # the client's, passed on to the engine
        # who sent it (a request's; None for a job): tenant, API key id, priority band, and its
        # share of the band when admission let it through (1.0 when it did not wait)
        self.tenant: str | None = None
        self.key: str | None = None
        self.band: str | None = None
        self.share: float | None = None

    def mark(self, phase: str, at: float, attempt: int = 0, note: str = "") -> None:
        """Open phase ``phase`` at ``at`` (the one before ends there). A mark before the last is
        moved up to it (phases never overlap); past MAX_MARKS they are dropped, and once ended
        nothing is added."""
        marks = self.marks
        if self.ended is not None or len(marks) >= MAX_MARKS:
            return
        if marks and at < marks[-1][1]:
            at = marks[-1][1]
        marks.append((phase, at, attempt, note[:MAX_NOTE]))

    @property
    def last_phase(self) -> str:
        return self.marks[-1][0] if self.marks else ""

    def end(self, now: float, outcome: str, status: int | None = None) -> bool:
        """The trace is complete (once: False if it had ended)."""
        if self.ended is not None:
            return False
        if self.marks and now < self.marks[-1][1]:
            now = self.marks[-1][1]
        self.ended, self.outcome, self.status = max(now, self.started), outcome, status
        return True

    def attempt_ended(self, r: AttemptRecord, sent_at: float | None, connected_at: float | None,
                      head_at: float | None, first_byte_at: float | None, now: float, status: int | None,
                      outcome: str, error: str, bytes_in: int) -> None:
        """Attempt ``r`` ended at ``now``: its phases (connect, head, first byte, body) from the
        times the shell saw, and its record. ``sent_at`` None: when it was decided. A prefill
        attempt (``r.phase``) is one phase, ``prefill``; a decode attempt with the prefiller's KV
        has ``transfer`` (from the sent request to its first byte: the decoder pulls the blocks,
        then makes its first token) and ``decode`` in place of head, first byte and body."""
        n = r.n
        if sent_at is not None:
            r.sent_at = sent_at
        if r.phase == "prefill":
            self.mark("prefill", r.sent_at, n, note=f"on {r.replica}")
        elif r.phase == "decode":  # the head may wait for the first token: one phase up to it
            self.mark("connect", r.sent_at, n)
            if connected_at is not None:
                self.mark("transfer", connected_at, n)
            if first_byte_at is not None:
                self.mark("decode", first_byte_at, n)
        else:
            self.mark("connect", r.sent_at, n)
            if connected_at is not None:
                self.mark("head", connected_at, n)
            if head_at is not None:
                self.mark("first_byte", head_at, n)
            if first_byte_at is not None:
                self.mark("body", first_byte_at, n)
        r.connected_at, r.head_at, r.first_byte_at = connected_at, head_at, first_byte_at
        r.ended_at, r.status, r.bytes_in = now, status, bytes_in
        r.outcome, r.error = outcome, error[:MAX_NOTE]
        self.bytes_in += bytes_in

    # -- the record as data ------------------------------------------------------------------------
    def to_dict(self, now: float | None = None) -> dict[str, Any]:
        """JSON-ready (the admin API's TraceView). Offsets are milliseconds from the start; an
        in-flight trace's last phase runs to ``now`` (or is open: duration null)."""
        t0 = self.started
        end = self.ended if self.ended is not None else now
        phases = []
        marks = self.marks
        for i, (name, at, attempt, note) in enumerate(marks):
            stop = marks[i + 1][1] if i + 1 < len(marks) else end
            phases.append({"name": name, "attempt": attempt, "start_ms": _ms(at - t0),
                           "duration_ms": None if stop is None else _ms(stop - at), "note": note})
        return {
            "id": self.id, "kind": self.kind, "name": self.name, "model": self.model, "stream": self.stream,
            "started_at": self.wall, "total_ms": None if self.ended is None else _ms(self.ended - t0),
            "outcome": self.outcome or "in_flight", "status": self.status, "revision": self.revision,
            "bytes_out": self.bytes_out, "bytes_in": self.bytes_in, "retries": sum(a.retried for a in self.attempts),
            "trace_id": self.trace_id, "span_id": self.span_id, "parent_span_id": self.parent_span_id,
            "phases": phases, "attempts": [_attempt_dict(a, t0) for a in self.attempts],
            "tenant": self.tenant, "key": self.key, "band": self.band, "share": self.share,
        }


def upstream_headers(trace: Trace | None, record: AttemptRecord | None) -> list[tuple[str, str]]:
    """The W3C headers of an attempt's request to the engine: ``traceparent`` in the request's
    trace, naming the attempt's span (the request's span when the attempt has none), and the
    client's ``tracestate`` when it sent one."""
    if trace is None or not trace.trace_id:
        return []
    span = record.span_id if record is not None and record.span_id else trace.span_id
    out = [("traceparent", format_traceparent(trace.trace_id, span, trace.flags))]
    if trace.tracestate:
        out.append(("tracestate", trace.tracestate))
    return out


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def _off(t: float | None, t0: float) -> float | None:
    return None if t is None else _ms(t - t0)


def _attempt_dict(a: AttemptRecord, t0: float) -> dict[str, Any]:
    return {"n": a.n, "replica": a.replica, "node": a.node, "revision": a.revision, "decision": a.decision,
            "sent_ms": _ms(a.sent_at - t0), "connected_ms": _off(a.connected_at, t0), "head_ms": _off(a.head_at, t0),
            "first_byte_ms": _off(a.first_byte_at, t0), "ended_ms": _off(a.ended_at, t0), "status": a.status,
            "outcome": a.outcome or "in_flight", "error": a.error, "retried": a.retried, "bytes_in": a.bytes_in,
            "span_id": a.span_id, "phase": a.phase}


class TraceRing:
    """The recent traces, oldest first, at most ``size`` (the oldest leave first). A trace is
    added when it starts, so in-flight requests can be looked at too."""

    __slots__ = ("_ring",)

    def __init__(self, size: int) -> None:
        self._ring: deque[Trace] = deque(maxlen=max(1, size))

    def add(self, trace: Trace) -> None:
        self._ring.append(trace)

    def __len__(self) -> int:
        return len(self._ring)

    def __iter__(self) -> Iterator[Trace]:
        return iter(self._ring)

    def get(self, id: str) -> Trace | None:
        """The newest trace with this id (a client may reuse a request id), or None."""
        for t in reversed(self._ring):
            if t.id == id:
                return t
        return None

    def recent(self, limit: int, *, kind: str | None = None, model: str | None = None,
               outcome: str | None = None) -> list[Trace]:
        """Newest first."""
        out = []
        for t in reversed(self._ring):
            if (kind is None or t.kind == kind) and (model is None or t.model == model) and \
                    (outcome is None or (t.outcome or "in_flight") == outcome):
                out.append(t)
                if len(out) >= limit:
                    break
        return out
