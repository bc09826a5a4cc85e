"""A job's trace: its steps as the phases of a :class:`llmgw.route.trace.Trace` of kind ``job``,
on the router's monotonic clock, so that ``GET /api/v1/traces/{job_id}`` and ``llmgw ctl trace
JOB_ID`` show an update, an eval, a promote or a rollback like a request.

The trace lives with its job (:class:`llmgw.lifecycle.jobs.Job` marks it at each step when the
shell has given the job a clock) and is stored with the job record as ``Trace.to_dict()``, so it
outlives the router's ring of recent traces and a restart. Pure: the clock is injected."""

from __future__ import annotations

import math
from typing import Any

from llmgw.route.trace import MAX_MARKS, MAX_NAME, MAX_NOTE, Trace

__all__ = ["new_job_trace", "rebase", "trace_from_dict"]


def new_job_trace(job_id: str, kind: str, model: str, revision_id: str, *, started: float, wall: float) -> Trace:
    t = Trace(job_id, kind="job", name=f"{kind} {model}"[:MAX_NAME], started=started, wall=wall,
              model=model[:MAX_NAME])
    t.revision = revision_id[:MAX_NAME]
    return t


def _ms(d: dict[str, Any], key: str) -> float | None:
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ValueError(f"trace {key}: {v!r} is not a time in ms")
    return float(v)


def trace_from_dict(d: Any, *, started: float) -> Trace:
    """A stored job trace (its ``to_dict`` form) back as a Trace whose start is ``started`` on the
    clock it goes on with (the store is input: ValueError/TypeError/KeyError for one that is not a
    job's trace; strings and counts are bounded as a live trace's are)."""
    if not isinstance(d, dict) or d.get("kind") != "job":
        raise ValueError("not a job's trace")
    wall = d.get("started_at")
    if isinstance(wall, bool) or not isinstance(wall, (int, float)) or not math.isfinite(wall):
        raise ValueError("trace started_at: not a Unix time")
    t = Trace(str(d["id"])[:MAX_NAME], kind="job", name=str(d.get("name", ""))[:MAX_NAME], started=started,
              wall=float(wall), model=str(d.get("model", ""))[:MAX_NAME])
    t.revision = str(d.get("revision", ""))[:MAX_NAME]
    phases = d.get("phases", [])
    if not isinstance(phases, list):
        raise ValueError("trace phases: not a list")
    for p in phases[:MAX_MARKS]:
        if not isinstance(p, dict):
            raise ValueError("trace phase: not an object")
        at = _ms(p, "start_ms")
        t.mark(str(p["name"])[:MAX_NAME], started + (at or 0.0) / 1e3, note=str(p.get("note", "")))
    total = _ms(d, "total_ms")
    outcome = str(d.get("outcome", "in_flight"))[:MAX_NOTE]
    if total is not None and outcome != "in_flight":
        status = d.get("status")
        t.end(started + total / 1e3, outcome, status if isinstance(status, int) and not isinstance(status, bool)
              else None)
    return t


def rebase(t: Trace, started: float) -> None:
    """Move `t` (an unfinished trace) onto a clock where it began at `started`."""
    d = started - t.started
    t.started = started
    t.marks = [(name, at + d, attempt, note) for name, at, attempt, note in t.marks]
    if t.ended is not None:
        t.ended += d
