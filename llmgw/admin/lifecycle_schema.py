"""The admin API's bodies and answers for the model lifecycle (llmgw.lifecycle): jobs and their
steps, a model's revisions, eval suites, the eval and promote bodies. Same conventions as
schema.py: request bodies closed, answers may grow fields; ``*_at`` fields are Unix time."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from llmgw.admin.typeinfo import prop

__all__ = ["EvalBody", "JobView", "PromoteBody", "RevisionsView", "StepView", "SuiteBody", "SuiteView",
           "UpdateBody"]

MAX_SUITE_TEXT = 1 << 20

# The changed parts of a model's definition (as PUT /models/{name} takes the whole): tables merge
# key by key, anything else is replaced; the merged definition is checked like a PUT's.
UpdateBody = dict[str, Any]


@dataclass(slots=True)
class StepView:
    name: str = prop("what the step does")
    state: str = prop("`running`, `done` or `failed`")
    started_at: float = prop("Unix time")
    ended_at: float | None = prop("Unix time; null while it runs")
    detail: str = prop("progress, or why it failed (an engine's log tail included)")


@dataclass(slots=True)
class JobView:
    id: str = prop("e.g. `update-1a2b3c4d`")
    kind: Literal["update", "eval", "promote", "rollback", "scale"] = prop(
        "what the job does; `scale`: an autoscaler changed the model's count (one step: from → to, why, the mode)")
    model: str = prop("the model it acts on")
    created_at: float = prop("Unix time")
    state: Literal["running", "succeeded", "failed"] = prop("`running` until it ends")
    ended_at: float | None = prop("Unix time; null while it runs")
    detail: str = prop("how it ended")
    revision_id: str = prop("the revision it acts on (`r2`, …)")
    params: dict[str, Any] = prop("what it was asked (an eval's suite and revision, an update's change, …)")
    steps: list[StepView] = prop("each step with its state and times: the job's trace")
    result: dict[str, Any] | None = prop("an eval's result: verdict, totals, every case (pass/fail, the "
                                         "failed checks, an answer excerpt, TTFT and latency in ms), and the "
                                         "comparison with the live revision's last result of the suite")


@dataclass(slots=True)
class RevisionsView:
    model: str = prop("the model")
    live: str = prop("the live revision's id")
    live_restored_from: str | None = prop("a rollback's revision: the id whose definition it brought back")
    candidate: dict[str, Any] | None = prop("the candidate: id, restored_from (a rollback's: the revision whose "
                                            "definition it brings back), definition, replicas, how many are "
                                            "ready, why the rest cannot be placed (if so)")
    previous: str | None = prop("the revision a rollback brings back (within the grace period after a promote)")
    promoted_at: float | None = prop("Unix time of the last promote")
    canary: dict[str, Any] | None = prop("with a canary share: the share, and the candidate's and the live "
                                         "revision's requests, failures, error rate and mean TTFT since the update")


@dataclass(slots=True)
class SuiteBody:
    toml: str = prop("the suite file's text (docs/lifecycle.md describes it)", maxLength=MAX_SUITE_TEXT)


@dataclass(slots=True)
class SuiteView:
    name: str = prop("the suite's name")
    description: str = prop("what it checks")
    pass_threshold: float = prop("the share of cases that must pass")
    concurrency: int = prop("cases in flight at once")
    timeout_s: float = prop("each case's time limit")
    cases: int = prop("how many cases")
    toml: str = prop("the suite file as stored")


@dataclass(slots=True)
class PromoteBody:
    require_suites: list[str] = prop("suites that must have passed on this candidate", factory=list)


@dataclass(slots=True)
class EvalBody:
    suite: str = prop("the suite to run")
    revision: Literal["candidate", "live"] | None = prop("default: the candidate if there is one, else live",
                                                         default=None)
