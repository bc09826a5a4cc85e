"""Jobs: every lifecycle step an operator starts (update, eval, promote, rollback) is a job with
a state and timestamped steps (Unix time), and a trace of kind ``job`` whose phases are those steps
on the router's monotonic clock (job_trace.py). Plain data, kept in the store (as `to_dict`, the
trace with it) and answered by the admin API. Pure: times are passed in, and the trace's clock is
injected by the shell (:meth:`Job.start_trace`).

States: ``running`` → ``succeeded`` | ``failed``. A step is ``running`` → ``done`` | ``failed``.
An eval job whose suite ran but did not pass is ``failed`` (its result attached, the detail
saying "suite … did not pass"), like a CI job whose tests fail; one that could not run says why.
A rollback that brings the previous revision back is one ``rollback`` job: its candidate placed,
then promoted once ready. A job is never left running by a restarted router: what it does with
one is :func:`after_restart` (an update or a rollback waiting for its candidate resumes; the rest
fail, saying so).

A ``scale`` job records one change of an autoscaled model's count (the control plane's autoscaler
decided it): created succeeded at once, its one step "from → to: reason (mode)". A busy
autoscaler makes many, so at most MAX_SCALE_JOBS of a model's are kept (:func:`scale_jobs_over`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from llmgw.lifecycle.job_trace import new_job_trace, rebase, trace_from_dict
from llmgw.route.trace import MAX_NOTE, Trace

__all__ = ["JOB_KINDS", "MAX_DETAIL", "MAX_JOBS", "MAX_SCALE_JOBS", "MAX_STEPS", "Job", "Step", "after_restart",
           "job_from_dict", "scale_job", "scale_jobs_over"]

JOB_KINDS = ("update", "eval", "promote", "rollback", "scale")
MAX_STEPS = 32  # a job's steps beyond this are merged into the last one
MAX_DETAIL = 4000  # characters of a detail (an engine's log tail is cut to this)
MAX_JOBS = 1000  # jobs kept in memory and in the store; the oldest finished ones go first
MAX_SCALE_JOBS = 50  # scale jobs kept per model; the oldest go first


@dataclass
class Step:
    name: str
    state: str  # running | done | failed
    started_at: float
    ended_at: float | None = None
    detail: str = ""


@dataclass
class Job:
    id: str
    kind: str
    model: str
    created_at: float
    state: str = "running"  # running | succeeded | failed
    ended_at: float | None = None
    detail: str = ""
    revision_id: str = ""  # the revision it acts on
    params: dict[str, Any] = field(default_factory=dict)
    steps: list[Step] = field(default_factory=list)
    # The job's trace, marked at each step once the shell gave it a clock (start_trace).
    trace: Trace | None = field(default=None, repr=False, compare=False)
    clock: Callable[[], float] | None = field(default=None, repr=False, compare=False)

    @property
    def done(self) -> bool:
        return self.state != "running"

    def start_trace(self, clock: Callable[[], float], wall_now: float) -> None:
        """Mark the trace on `clock` from now on: a new job's trace begins; a stored one that was
        running goes on (its start moved onto this clock: the time the router was down counts in
        the step that was running); a job stored without a trace gets one from its steps."""
        self.clock = clock
        now = clock()
        elapsed = max(0.0, wall_now - self.created_at)
        if self.done and self.trace is not None and self.trace.ended is None:
            self.trace = None  # a stored trace left open by an ended job is not to be trusted: rebuilt
        if self.trace is None:
            t = self.trace = new_job_trace(self.id, self.kind, self.model, self.revision_id, started=now - elapsed,
                                           wall=self.created_at)
            for s in self.steps:
                t.mark(s.name, t.started + max(0.0, s.started_at - self.created_at), note=s.detail)
            if self.done:
                t.mark(self.state, t.started + max(0.0, (self.ended_at or wall_now) - self.created_at),
                       note=self.detail[:MAX_NOTE])
                t.end(t.started + max(0.0, (self.ended_at or wall_now) - self.created_at), _OUTCOME[self.state])
        elif self.trace.ended is None:
            last = self.trace.marks[-1][1] - self.trace.started if self.trace.marks else 0.0
            rebase(self.trace, now - max(elapsed, last))

    def _mark(self, phase: str, note: str) -> None:
        if self.trace is not None and self.clock is not None:  # the first step starts with the job
            self.trace.mark(phase, self.clock() if self.trace.marks else self.trace.started, note=note)

    def _end_trace(self) -> None:
        if self.trace is not None and self.clock is not None:
            now = self.clock()
            self.trace.mark(self.state, now, note=self.detail)
            self.trace.end(now, _OUTCOME[self.state])

    def step(self, name: str, now: float, detail: str = "") -> None:
        """A new step begins (the one running before it is done)."""
        self._close(now, "done")
        self._mark(name, detail)
        if len(self.steps) >= MAX_STEPS:
            last = self.steps[-1]
            last.name, last.state, last.ended_at, last.detail = name, "running", None, _cut(detail)
            return
        self.steps.append(Step(name, "running", now, None, _cut(detail)))

    def note(self, detail: str) -> None:
        """More about the running step (its detail is replaced)."""
        if self.steps:
            self.steps[-1].detail = _cut(detail)
            _renote(self.trace, detail)

    def succeed(self, now: float, detail: str = "") -> None:
        if self.done:
            return
        self._close(now, "done")
        self.state, self.ended_at, self.detail = "succeeded", now, _cut(detail)
        self._end_trace()

    def fail(self, now: float, detail: str) -> None:
        if self.done:
            return
        self._close(now, "failed", detail)
        self.state, self.ended_at, self.detail = "failed", now, _cut(detail)
        self._end_trace()

    def _close(self, now: float, state: str, detail: str = "") -> None:
        if self.steps and self.steps[-1].state == "running":
            s = self.steps[-1]
            s.state, s.ended_at = state, now
            if detail and not s.detail:
                s.detail = _cut(detail)
                _renote(self.trace, detail)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; ``trace`` is the trace as GET /api/v1/traces/{id} answers it (None: none)."""
        return {"id": self.id, "kind": self.kind, "model": self.model, "created_at": self.created_at,
                "state": self.state, "ended_at": self.ended_at, "detail": self.detail,
                "revision_id": self.revision_id, "params": self.params, "steps": [asdict(s) for s in self.steps],
                "trace": None if self.trace is None else self.trace.to_dict()}


_OUTCOME = {"succeeded": "ok", "failed": "failed", "running": "in_flight"}


def _renote(trace: Trace | None, detail: str) -> None:
    """The running step's note in the trace is `detail` (a job's step is noted as it goes)."""
    if trace is not None and trace.ended is None and trace.marks:
        name, at, attempt, _ = trace.marks[-1]
        trace.marks[-1] = (name, at, attempt, detail[:MAX_NOTE])


def job_from_dict(d: dict[str, Any]) -> Job:
    """A stored job (raises KeyError/TypeError/ValueError for one that is not)."""
    steps = [Step(str(s["name"]), str(s["state"]), float(s["started_at"]),
                  None if s.get("ended_at") is None else float(s["ended_at"]), str(s.get("detail", "")))
             for s in d.get("steps", [])][:MAX_STEPS]
    job = Job(str(d["id"]), str(d["kind"]), str(d["model"]), float(d["created_at"]), str(d["state"]),
              None if d.get("ended_at") is None else float(d["ended_at"]), str(d.get("detail", "")),
              str(d.get("revision_id", "")), dict(d.get("params", {})), steps)
    if job.kind not in JOB_KINDS or job.state not in ("running", "succeeded", "failed"):
        raise ValueError(f"job {job.id}: kind {job.kind!r} or state {job.state!r} unknown")
    if d.get("trace") is not None:
        try:
            job.trace = trace_from_dict(d["trace"], started=0.0)
        except (KeyError, TypeError, ValueError):
            job.trace = None  # a damaged trace is not worth the job: start_trace makes one from its steps
        else:
            if job.trace.id != job.id:
                job.trace = None
    return job


def scale_job(job_id: str, model: str, from_n: int, to_n: int, reason: str, mode: str, now: float) -> Job:
    """The record of one change of an autoscaled model's count: succeeded at once, its one step
    "from → to: reason (mode)" (the job's detail stays empty: listings show the step, once);
    ``params`` holds the figures for scripts."""
    what = f"{from_n} → {to_n}: {reason or 'no reason given'} ({mode})"
    job = Job(job_id, "scale", model, now, params={"from": from_n, "to": to_n, "reason": reason, "mode": mode})
    job.step(what, now)
    job.succeed(now)
    return job


def scale_jobs_over(jobs: dict[str, Job], model: str, keep: int = MAX_SCALE_JOBS) -> list[str]:
    """The ids of ``model``'s scale jobs beyond the newest ``keep`` (``jobs`` oldest first): the
    ones to prune."""
    mine = [jid for jid, j in jobs.items() if j.kind == "scale" and j.model == model]
    return mine[:max(0, len(mine) - keep)]


def after_restart(job: Job, now: float, *, candidate_exists: bool) -> str:
    """What a router that starts does with a job its store says was running: "resume" (an update
    whose candidate is still there: it goes on waiting for the candidate's replicas) or "failed"
    (the job is failed with the reason; its effects so far are consistent: an eval's partial
    result is dropped, a promote or rollback is applied in one store transaction or not at all)."""
    if job.done:
        return job.state
    if job.kind in ("update", "rollback") and candidate_exists:
        job.step("router restarted: resumed", now)
        return "resume"
    job.fail(now, "the router restarted while this job ran; run it again")
    return "failed"


def _cut(text: str) -> str:
    return text if len(text) <= MAX_DETAIL else "…" + text[-(MAX_DETAIL - 1):]
