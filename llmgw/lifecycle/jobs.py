"""Jobs: every lifecycle step an operator starts (update, eval, promote, rollback) is a job with
a state and timestamped steps — the job's trace until requests' traces exist. Plain data, kept in
the store (as `to_dict`) and answered by the admin API. Pure: times are passed in (Unix time).

States: ``running`` → ``succeeded`` | ``failed``. A step is ``running`` → ``done`` | ``failed``.
A job is never left running by a restarted router: what it does with one is
:func:`after_restart` (an update waiting for its candidate resumes; the rest fail, saying so)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["JOB_KINDS", "MAX_DETAIL", "MAX_JOBS", "MAX_STEPS", "Job", "Step", "after_restart", "job_from_dict"]

JOB_KINDS = ("update", "eval", "promote", "rollback")
MAX_STEPS = 32  # a job's steps beyond this are merged into the last one
MAX_DETAIL = 4000  # characters of a detail (an engine's log tail is cut to this)
MAX_JOBS = 1000  # jobs kept in memory and in the store; the oldest finished ones go first


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

    @property
    def done(self) -> bool:
        return self.state != "running"

    def step(self, name: str, now: float, detail: str = "") -> None:
        """A new step begins (the one running before it is done)."""
        self._close(now, "done")
        if len(self.steps) >= MAX_STEPS:
            last = self.steps[-1]
            last.name, last.state, last.ended_at, last.detail = name, "running", None, _cut(detail)
            return
        self.steps.append(Step(name, "running", now, None, _cut(detail)))

    def note(self, detail: str) -> None:
        """More about the running step (its detail is replaced)."""
        if self.steps:
            self.steps[-1].detail = _cut(detail)

    def succeed(self, now: float, detail: str = "") -> None:
        if self.done:
            return
        self._close(now, "done")
        self.state, self.ended_at, self.detail = "succeeded", now, _cut(detail)

    def fail(self, now: float, detail: str) -> None:
        if self.done:
            return
        self._close(now, "failed", detail)
        self.state, self.ended_at, self.detail = "failed", now, _cut(detail)

    def _close(self, now: float, state: str, detail: str = "") -> None:
        if self.steps and self.steps[-1].state == "running":
            s = self.steps[-1]
            s.state, s.ended_at = state, now
            if detail and not s.detail:
                s.detail = _cut(detail)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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
    return job


def after_restart(job: Job, now: float, *, candidate_exists: bool) -> str:
    """What a router that starts does with a job its store says was running: "resume" (an update
    whose candidate is still there: it goes on waiting for the candidate's replicas) or "failed"
    (the job is failed with the reason; its effects so far are consistent: an eval's partial
    result is dropped, a promote or rollback is applied in one store transaction or not at all)."""
    if job.done:
        return job.state
    if job.kind == "update" and candidate_exists:
        job.step("router restarted: resumed", now)
        return "resume"
    job.fail(now, "the router restarted while this job ran; run it again")
    return "failed"


def _cut(text: str) -> str:
    return text if len(text) <= MAX_DETAIL else "…" + text[-(MAX_DETAIL - 1):]
