"""The model lifecycle's eval side and its views: suites stored and deleted, eval jobs (started
here, run by lifecycle/eval_runner.py through the router's OpenAI port, their results kept and compared
with the live revision's last one), and what the admin API answers of jobs and revisions. The
Lifecycle holds one (``lifecycle.evals``); it reaches the Lifecycle's state only through
:class:`EvalsHost`."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Protocol

import trio

from llmgw.daemon.control.lifecycle.eval_runner import EvalTarget, run_cases
from llmgw.lifecycle.evals import compare, summarize
from llmgw.lifecycle.jobs import Job
from llmgw.lifecycle.revisions import LifecycleError, ModelRevisions, candidate_key
from llmgw.lifecycle.suites import Suite, parse_suite, suite_name_problem
from llmgw.inputs.echo import echo

if TYPE_CHECKING:
    from llmgw.daemon.net.upstream import UpstreamPool

log = logging.getLogger("llmgw.lifecycle")

__all__ = ["MAX_RESULTS", "MAX_RUNNING_EVALS", "MAX_SUITES", "Evals", "EvalsHost"]

MAX_SUITES = 1000
MAX_RESULTS = 200  # eval results kept (the newest); each holds at most 1,000 cases of a few KiB
MAX_RUNNING_EVALS = 4  # eval jobs at once (each with its suite's concurrency)


class EvalsHost(Protocol):
    """What the evals and views read and call of the Lifecycle (lifecycle/lifecycle.py)."""
    plane: Any  # the ControlPlane: models, guard, unplaceable, router's request counts
    revisions: dict[str, ModelRevisions]
    suites: dict[str, Suite]
    results: dict[str, dict[str, Any]]
    jobs: dict[str, Job]
    _canary_base: dict[str, Any]
    _nursery: trio.Nursery | None
    _pool: UpstreamPool | None
    _target: EvalTarget | None

    def _new_job(self, kind: str, model: str, revision_id: str = "", **params: Any) -> Job: ...

    def _save_job(self, job: Job) -> None: ...

    def _candidate_replicas(self, name: str) -> list[Any]: ...


class Evals:
    def __init__(self, lifecycle: EvalsHost) -> None:
        self.lc = lifecycle
        self.running: set[trio.CancelScope] = set()  # one per eval job under way
        self.stopping = False

    def stop(self) -> int:
        """The router is stopping (SIGTERM: it drains, docs/ha.md "Behind a load balancer"): its
        OpenAI port, which evals go through, refuses connections now, so an eval under way would
        score refusals as failed cases. Cut them now, as the stop would (their jobs stay running
        in the store: the next start says what becomes of them), and start no new one; how many."""
        self.stopping = True
        for scope in self.running:
            scope.cancel()
        return len(self.running)

    # -- suites ------------------------------------------------------------------------------------
    def put_suite(self, name: str, text: str) -> Suite:
        if (why := suite_name_problem(name)) is not None:
            raise LifecycleError(400, why)
        if name not in self.lc.suites and len(self.lc.suites) >= MAX_SUITES:
            raise LifecycleError(409, f"at most {MAX_SUITES} suites; delete one first")
        suite = parse_suite(text, f"suite {name}", name=name)  # ConfigError: every problem, file:line:key
        self.lc.plane.guard.must_write("put_doc", "suite", name, {"toml": text})
        self.lc.suites[name] = suite
        return suite

    def delete_suite(self, name: str) -> None:
        if name not in self.lc.suites:
            raise LifecycleError(404, f"No suite {echo(name)}.")
        self.lc.plane.guard.must_write("delete_doc", "suite", name)
        del self.lc.suites[name]

    # -- evals -------------------------------------------------------------------------------------
    def last_result(self, model: str, suite: str, revision_id: str) -> dict[str, Any] | None:
        return self.lc.results.get(f"{model}/{suite}/{revision_id}")

    def start_eval(self, name: str, suite_name: str, revision: str) -> Job:
        p = self.lc.plane
        if name not in p.models:
            raise LifecycleError(404, f"No model {echo(name)}.")
        suite = self.lc.suites.get(suite_name)
        if suite is None:
            raise LifecycleError(404, f"No suite {echo(suite_name)}.")
        revs = self.lc.revisions.get(name) or ModelRevisions(name)
        if revision == "candidate" and revs.candidate is None:
            raise LifecycleError(409, f"model {name} has no candidate: `llmgw ctl models update {name}` makes one")
        if self.lc._nursery is None or self.lc._pool is None or self.lc._target is None:
            raise LifecycleError(409, "the router's OpenAI port is not listening yet; retry in a moment")
        if self.stopping:
            raise LifecycleError(409, "this router is stopping; start the eval on another router, or once it is back")
        running = [j.id for j in self.lc.jobs.values() if j.kind == "eval" and not j.done]
        if len(running) >= MAX_RUNNING_EVALS:
            raise LifecycleError(409, f"{len(running)} eval jobs are running ({', '.join(running)}); wait for one")
        rid = revs.candidate.id if revision == "candidate" and revs.candidate else revs.live_id
        job = self.lc._new_job("eval", name, rid, suite=suite_name, revision=revision)
        job.step(f"running {len(suite.cases)} cases on {revision} {rid}", job.created_at,
                 f"concurrency {suite.concurrency}, {suite.timeout_s:g} s a case")
        self.lc._save_job(job)
        self.lc._nursery.start_soon(self._eval, job, suite, name, revision, rid)
        return job

    async def _eval(self, job: Job, suite: Suite, name: str, revision: str, rid: str) -> None:
        with trio.CancelScope() as scope:  # stop() cuts it
            self.running.add(scope)
            try:
                await self._run_eval(job, suite, name, revision, rid)
            except Exception as e:  # noqa: BLE001 — a bug (or a damaged stored result) fails the job, not the router
                log.exception("eval job %s failed", job.id)
                job.fail(time.time(), f"the eval failed: {e}")
                self.lc._save_job(job)
            finally:
                self.running.discard(scope)
        if scope.cancelled_caught:
            log.warning("eval job %s is cut: the router is stopping", job.id)

    async def _run_eval(self, job: Job, suite: Suite, name: str, revision: str, rid: str) -> None:
        assert self.lc._pool is not None and self.lc._target is not None
        started = time.time()
        cases = await run_cases(self.lc._pool, self.lc._target, suite, name, revision, job.id)
        result = {"suite": suite.name, "model": name, "revision": revision, "revision_id": rid,
                  "job": job.id, "started_at": started, "ended_at": time.time(), **summarize(suite, cases),
                  "cases": cases}
        revs = self.lc.revisions.get(name)
        live_id = revs.live_id if revs else "r1"
        result["compare"] = None if rid == live_id else compare(result, self.last_result(name, suite.name, live_id))
        key = f"{name}/{suite.name}/{rid}"
        self.lc.results.pop(key, None)
        self.lc.results[key] = result
        for old in list(self.lc.results)[:max(0, len(self.lc.results) - MAX_RESULTS)]:
            del self.lc.results[old]
            self.lc.plane.guard.write("delete_doc", "result", old)
        self.lc.plane.guard.write("put_doc", "result", key, result)
        t = result["totals"]
        verdict = "passed" if result["passed"] else "failed"
        job.step("stored the result", time.time())
        job.params["result"] = key
        figures = f"{t['passed']}/{t['cases']} cases ({result['pass_rate']:.0%}; {result['threshold']:.0%} needed)"
        if result["passed"]:
            job.succeed(time.time(), f"suite {suite.name} passed: {figures}")
        else:  # the job's state says the verdict (jobs.py); its result is attached all the same
            job.fail(time.time(), f"suite {suite.name} did not pass: {figures}")
        self.lc._save_job(job)
        self.lc.plane.guard.record("eval " + verdict, model=name, detail=f"{suite.name} on {rid} (job {job.id})")

    # -- views ------------------------------------------------------------------------------------
    def job_view(self, job: Job, *, result: bool = True) -> dict[str, Any]:
        """The job as the admin API answers it; with `result`, an eval's whole result (a list of
        jobs leaves it out: a result may hold a thousand cases)."""
        d = job.to_dict()
        d.pop("trace")  # GET /api/v1/traces/{job_id} answers it
        key = job.params.get("result")
        d["result"] = self.lc.results.get(key) if result and isinstance(key, str) else None
        return d

    def revisions_view(self, name: str) -> dict[str, Any]:
        p = self.lc.plane
        if name not in p.models:
            raise LifecycleError(404, f"No model {echo(name)}.")
        revs = self.lc.revisions.get(name) or ModelRevisions(name)
        cand = revs.candidate
        out: dict[str, Any] = {"model": name, "live": revs.live_id,
                               "live_restored_from": revs.live_restored_from or None, "candidate": None,
                               "previous": revs.previous.id if revs.previous else None,
                               "promoted_at": revs.promoted_at, "canary": None}
        if cand is not None:
            reps = self.lc._candidate_replicas(name)
            out["candidate"] = {"id": cand.id, "restored_from": cand.restored_from or None,
                                "created_at": cand.created_at, "definition": cand.definition,
                                "replicas": sorted(a.replica for a in reps),
                                "ready": sum(1 for a in reps if a.engine_state == "ready"),
                                "unplaceable": p.unplaceable.get(candidate_key(name))}
            if cand.canary > 0:
                base = self.lc._canary_base.get(name, ((0, 0, 0.0, 0), (0, 0, 0.0, 0)))
                out["canary"] = {"share": cand.canary,
                                 "live": _since(p.router.request_counts(name), base[0]),
                                 "candidate": _since(p.router.request_counts(candidate_key(name)), base[1])}
        return out


def _since(now: tuple[int, int, float, int], base: tuple[int, int, float, int]) -> dict[str, Any]:
    n, failed, ttft_sum, ttft_n = (a - b for a, b in zip(now, base))
    return {"requests": n, "failed": failed, "error_rate": round(failed / n, 4) if n else None,
            "ttft_ms_mean": round(ttft_sum / ttft_n * 1e3, 2) if ttft_n else None}
