"""Jobs' traces (llmgw/lifecycle/jobs.py + job_trace.py): a job's steps are the phases of a trace of
kind "job" on an injected monotonic clock, stored with the job and carried over a restart."""

from __future__ import annotations

import json

import pytest

from llmgw.admin.schema_traces import trace_view
from llmgw.lifecycle.job_trace import trace_from_dict
from llmgw.lifecycle.jobs import Job, after_restart, job_from_dict


class Clock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _update_job(clock: Clock) -> Job:
    job = Job("update-1a2b3c4d", "update", "qwen", 1_700_000_000.0, revision_id="r2")
    job.start_trace(clock, job.created_at)
    job.step("placing candidate replicas", job.created_at, "2 replicas of r2 beside live r1")
    clock.t += 1.5
    job.step("waiting for the candidate", job.created_at + 1.5)
    job.note("1/2 ready")
    clock.t += 3.25
    job.succeed(job.created_at + 4.75, "candidate r2 ready: 2/2 replicas")
    return job


def test_a_jobs_steps_are_its_traces_phases_with_monotonic_timings() -> None:
    job = _update_job(Clock())
    d = job.trace.to_dict()  # type: ignore[union-attr]
    assert (d["id"], d["kind"], d["name"], d["model"], d["revision"]) == \
        ("update-1a2b3c4d", "job", "update qwen", "qwen", "r2")
    assert d["started_at"] == job.created_at and d["outcome"] == "ok" and d["total_ms"] == 4750.0
    assert [(p["name"], p["start_ms"], p["duration_ms"], p["note"]) for p in d["phases"]] == [
        ("placing candidate replicas", 0.0, 1500.0, "2 replicas of r2 beside live r1"),
        ("waiting for the candidate", 1500.0, 3250.0, "1/2 ready"),
        ("succeeded", 4750.0, 0.0, "candidate r2 ready: 2/2 replicas"),
    ]
    assert sum(p["duration_ms"] for p in d["phases"]) == d["total_ms"]
    trace_view(job.trace, 0.0)  # the admin API's answer can be built from it


def test_a_failed_job_ends_its_trace_failed_with_the_reason() -> None:
    clock = Clock()
    job = Job("eval-00000001", "eval", "qwen", 1000.0, revision_id="r2")
    job.start_trace(clock, 1000.0)
    job.step("running 3 cases on candidate r2", 1000.0)
    clock.t += 0.5
    job.fail(1000.5, "the eval failed: boom")
    d = job.trace.to_dict()  # type: ignore[union-attr]
    assert d["outcome"] == "failed" and d["total_ms"] == 500.0
    assert d["phases"][0]["note"] == "the eval failed: boom"  # the failed step says why
    assert d["phases"][-1]["name"] == "failed"


def test_the_trace_is_stored_with_the_job_and_comes_back_from_the_store() -> None:
    job = _update_job(Clock())
    stored = json.loads(json.dumps(job.to_dict()))
    back = job_from_dict(stored)
    assert back.trace is not None
    assert back.trace.to_dict() == job.trace.to_dict()  # type: ignore[union-attr]


def test_a_running_jobs_trace_goes_on_after_a_restart_on_the_new_clock() -> None:
    clock = Clock(100.0)
    job = Job("update-1", "update", "qwen", 1000.0, revision_id="r2")
    job.start_trace(clock, 1000.0)
    job.step("placing", 1000.0)
    clock.t += 2.0
    job.step("waiting", 1002.0)
    stored = json.loads(json.dumps(job.to_dict()))
    assert stored["trace"]["outcome"] == "in_flight"
    back = job_from_dict(stored)
    new_clock = Clock(5.0)  # another process: another monotonic clock
    back.start_trace(new_clock, 1010.0)  # 10 s after the job began
    assert after_restart(back, 1010.0, candidate_exists=True) == "resume"
    new_clock.t += 1.0
    back.succeed(1011.0, "ready")
    d = back.trace.to_dict()  # type: ignore[union-attr]
    assert [(p["name"], p["start_ms"]) for p in d["phases"]] == [
        ("placing", 0.0), ("waiting", 2000.0), ("router restarted: resumed", 10000.0), ("succeeded", 11000.0)]
    assert d["total_ms"] == 11000.0


def test_a_job_stored_before_traces_gets_one_from_its_steps() -> None:
    job = Job("promote-1", "promote", "qwen", 1000.0, revision_id="r2")
    job.step("making the candidate live", 1000.0)
    job.step("draining the old replicas", 1000.25)
    job.succeed(1000.5, "r2 is live")
    d = job.to_dict()
    assert d["trace"] is None
    d.pop("trace")
    back = job_from_dict(d)
    back.start_trace(Clock(), 2000.0)
    t = back.trace.to_dict()  # type: ignore[union-attr]
    assert [(p["name"], p["start_ms"]) for p in t["phases"]] == [
        ("making the candidate live", 0.0), ("draining the old replicas", 250.0), ("succeeded", 500.0)]
    assert t["outcome"] == "ok" and t["total_ms"] == 500.0


@pytest.mark.parametrize("bad", [
    "x", {"kind": "request"}, {"kind": "job", "id": "update-1a2b3c4d", "started_at": "yesterday"},
    {"kind": "job", "id": "update-1a2b3c4d", "started_at": 1.0, "phases": [{"name": "a", "start_ms": -1}]},
    {"kind": "job", "id": "update-1a2b3c4d", "started_at": 1.0, "phases": [{"start_ms": 1}]},
    {"kind": "job", "id": "update-1a2b3c4d", "started_at": 1.0, "phases": "many"},
    {"kind": "job", "id": "someone-else", "started_at": 1.0, "phases": []},
])
def test_a_damaged_stored_trace_is_dropped_and_the_job_kept(bad: object) -> None:
    d = _update_job(Clock()).to_dict()
    d["trace"] = bad
    job = job_from_dict(d)
    assert job.trace is None and job.state == "succeeded" and len(job.steps) == 2
    job.start_trace(Clock(), 2000.0)  # rebuilt from its steps
    assert job.trace is not None and job.trace.to_dict()["outcome"] == "ok"


def test_a_stored_trace_is_bounded() -> None:
    d = _update_job(Clock()).to_dict()
    d["trace"]["phases"] = [{"name": "x" * 10_000, "start_ms": i, "note": "n" * 10_000} for i in range(10_000)]
    t = trace_from_dict(d["trace"], started=0.0)
    assert len(t.marks) == 64 and max(len(m[0]) for m in t.marks) <= 256 and max(len(m[3]) for m in t.marks) <= 512


def test_an_ended_job_whose_stored_trace_was_left_open_gets_one_from_its_steps() -> None:
    clock = Clock()
    job = Job("rollback-1", "rollback", "qwen", 1000.0, revision_id="r2")
    job.start_trace(clock, 1000.0)
    job.step("discarding the candidate", 1000.0)
    d = job.to_dict()  # saved while running...
    job.succeed(1000.25, "discarded")
    d.update(state="succeeded", ended_at=1000.25, detail="discarded",
             steps=[{**d["steps"][0], "state": "done", "ended_at": 1000.25}])  # ...and the job alone saved after
    back = job_from_dict(d)
    assert back.trace is not None and back.trace.ended is None
    back.start_trace(Clock(7.0), 2000.0)
    t = back.trace.to_dict()  # type: ignore[union-attr]
    assert t["outcome"] == "ok" and t["total_ms"] == 250.0 and t["phases"][-1]["note"] == "discarded"
