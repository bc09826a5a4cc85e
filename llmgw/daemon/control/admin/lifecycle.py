"""The admin API's handlers for the model lifecycle (routes tagged `lifecycle` in
llmgw.admin.routes): update, promote, rollback, eval, revisions, jobs, suites. Each is
``async (app, call) -> answer``; admin/server.py registers them by route name. A request that
cannot be done now raises LifecycleError (its status and message become the answer); bad input
raises ConfigError (a 400 naming every field, with the suite file's line)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from llmgw.admin.lifecycle_schema import SuiteView
from llmgw.config import ConfigError
from llmgw.lifecycle.jobs import JOB_KINDS
from llmgw.lifecycle.revisions import LifecycleError
from llmgw.lifecycle.suites import Suite
from llmgw.inputs.echo import echo

__all__ = ["LIFECYCLE_HANDLERS", "BodyProblems"]

Handler = Callable[[Any, Any], Awaitable[Any]]


def _suite_view(s: Suite) -> SuiteView:
    return SuiteView(s.name, s.description, s.pass_threshold, s.concurrency, s.timeout_s, len(s.cases), s.source)


async def update_model(app: Any, call: Any) -> Any:
    lc = app.control.lifecycle
    job = lc.update(call.params["name"], call.body, canary=call.query["canary"] / 100.0,
                    ready_timeout_s=call.query["ready_timeout_s"])
    return lc.evals.job_view(job)


async def promote_model(app: Any, call: Any) -> Any:
    lc = app.control.lifecycle
    require = list(call.body.require_suites) if call.body is not None else []
    return lc.evals.job_view(lc.promote(call.params["name"], require))


async def rollback_model(app: Any, call: Any) -> Any:
    lc = app.control.lifecycle
    return lc.evals.job_view(lc.rollback(call.params["name"]))


async def eval_model(app: Any, call: Any) -> Any:
    lc = app.control.lifecycle
    name = call.params["name"]
    revision = call.body.revision
    if revision is None:
        revs = lc.revisions.get(name)
        revision = "candidate" if revs is not None and revs.candidate is not None else "live"
    return lc.evals.job_view(lc.evals.start_eval(name, call.body.suite, revision))


async def get_revisions(app: Any, call: Any) -> Any:
    return app.control.lifecycle.evals.revisions_view(call.params["name"])


def _kinds(text: str | None) -> frozenset[str] | None:
    """`?kind=update,eval`: the kinds asked for (None: all); an unknown one is a 400 naming `kind`."""
    if text is None:
        return None
    kinds = frozenset(k.strip() for k in text.split(",") if k.strip())
    unknown = sorted(kinds - set(JOB_KINDS))
    if unknown or not kinds:
        raise BodyProblems([("kind", f"unknown job kind {echo(', '.join(unknown))}; the kinds are "
                                     f"{', '.join(JOB_KINDS)}" if unknown else "no kind named")], code="invalid_query")
    return kinds


async def list_jobs(app: Any, call: Any) -> Any:
    lc = app.control.lifecycle
    model, kinds = call.query["model"], _kinds(call.query["kind"])
    jobs = [j for j in reversed(lc.jobs.values())
            if (model is None or j.model == model) and (kinds is None or j.kind in kinds)]
    return [lc.evals.job_view(j, result=False) for j in jobs[:call.query["limit"]]]


async def get_job(app: Any, call: Any) -> Any:
    lc = app.control.lifecycle
    job = lc.jobs.get(call.params["id"])
    if job is None:
        raise LifecycleError(404, f"No job {echo(call.params['id'])}.")
    return lc.evals.job_view(job)


async def list_suites(app: Any, call: Any) -> Any:
    return [_suite_view(s) for _, s in sorted(app.control.lifecycle.suites.items())]


async def get_suite(app: Any, call: Any) -> Any:
    s = app.control.lifecycle.suites.get(call.params["name"])
    if s is None:
        raise LifecycleError(404, f"No suite {echo(call.params['name'])}.")
    return _suite_view(s)


class BodyProblems(Exception):
    """Problems with the body (or, `code` invalid_query, a query parameter), each (field, message):
    a 400 listing them."""

    def __init__(self, problems: list[tuple[str, str]], code: str = "invalid_body") -> None:
        super().__init__("; ".join(f"{f}: {m}" for f, m in problems))
        self.problems, self.code = problems, code


async def put_suite(app: Any, call: Any) -> Any:
    try:
        return _suite_view(app.control.lifecycle.evals.put_suite(call.params["name"], call.body.toml))
    except ConfigError as e:  # each problem of the file, with its line: `suite NAME:LINE: key: what`
        raise BodyProblems([("toml", str(p)) for p in e.problems]) from None


async def delete_suite(app: Any, call: Any) -> Any:
    app.control.lifecycle.evals.delete_suite(call.params["name"])
    return None


LIFECYCLE_HANDLERS: dict[str, Handler] = {
    f.__name__: f for f in (update_model, promote_model, rollback_model, eval_model, get_revisions, list_jobs,
                            get_job, list_suites, get_suite, put_suite, delete_suite)
}
