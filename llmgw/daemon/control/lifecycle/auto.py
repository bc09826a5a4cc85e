"""A config-file candidate that promotes itself: `[models.lifecycle] auto_promote = true`
(docs/lifecycle.md). Once every candidate replica is ready, its update job runs the model's
`require_suites` on the candidate (eval jobs like `llmgw ctl eval`), and promotes it when all of
them passed — the same promote, with the same checks, as `llmgw ctl models promote --require-suite`.
A suite that fails (or is missing, or an eval that cannot run) leaves the candidate for an
operator: the update job ends saying why, and nothing live changed.

The update job stays `running` while its evals run; its params keep their ids (`auto_evals`)."""

from __future__ import annotations

import logging
from typing import Any

from llmgw.daemon.control.store.guard import StoreUnavailable
from llmgw.lifecycle.jobs import Job
from llmgw.lifecycle.revisions import LifecycleError

__all__ = ["auto_promote_step"]

log = logging.getLogger("llmgw.lifecycle")


def _stop(lc: Any, job: Job, now: float, why: str) -> None:
    job.succeed(now, f"candidate {job.revision_id} ready, not promoted: {why}; promote it by hand (llmgw ctl "
                     f"models promote {job.model}) or roll it back")
    lc._save_job(job)
    lc.plane.guard.record("auto-promote withheld", model=job.model, detail=why[:500])
    log.warning("model %s: candidate %s not promoted by itself: %s", job.model, job.revision_id, why)


def auto_promote_step(lc: Any, job: Job, now: float) -> None:
    """One reconcile round of a ready auto-promote candidate (`lc`: the Lifecycle)."""
    require = [str(s) for s in job.params.get("require_suites") or []]
    evals = job.params.get("auto_evals")
    if evals is None:
        missing = [s for s in require if s not in lc.suites]
        if missing:
            _stop(lc, job, now, f"required suite{'s' if len(missing) > 1 else ''} {', '.join(missing)} not found "
                                f"(llmgw ctl suites put)")
            return
        ids = []
        try:
            for s in require:
                ids.append(lc.evals.start_eval(job.model, s, "candidate").id)
        except LifecycleError as e:  # the OpenAI port not listening yet, too many evals: next round
            if ids:
                job.params["auto_evals"] = ids  # those started are waited on; the rest failed to start
                _stop(lc, job, now, f"an eval could not start: {e}")
            return
        job.params["auto_evals"] = ids
        if ids:
            job.step("evaluating the candidate", now, ", ".join(f"{s} ({i})" for s, i in zip(require, ids)))
        lc._save_job(job)
        if ids:
            return
    if any((j := lc.jobs.get(i)) is not None and not j.done for i in job.params["auto_evals"]):
        return
    try:
        lc.promote(job.model, require)
    except (LifecycleError, StoreUnavailable) as e:
        _stop(lc, job, now, str(e))
        return
    job.succeed(now, f"candidate {job.revision_id} promoted by itself (auto_promote"
                     f"{'; passed: ' + ', '.join(require) if require else ''})")
    lc._save_job(job)
