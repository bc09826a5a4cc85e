"""What the Lifecycle view shows, fetched from the admin API (it is not on the event stream): the
recent jobs, the stored suites, each shown model's revisions, and the results of its recent eval
jobs. Bounded: at most MAX_MODELS revisions calls and MAX_NEW_RESULTS result fetches a round;
a finished eval's result never changes, so the ones fetched are kept (MAX_RESULTS of them) and
not asked for again. No Textual: the app runs it in a worker while the view is on screen."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from llmgw.tui.client import AdminAPI, AdminError, AdminRefused
from llmgw.tui.state import as_dict, as_list

__all__ = ["JOBS_LISTED", "MAX_MODELS", "MAX_NEW_RESULTS", "MAX_RESULTS", "SCALE_JOBS_LISTED", "fetch_lifecycle"]

JOBS_LISTED = 50
SCALE_JOBS_LISTED = 20  # an autoscaler's changes of a count, listed apart (lifecycle jobs keep their 50)
LIFECYCLE_KINDS = "update,eval,promote,rollback"
MAX_MODELS = 32
MAX_NEW_RESULTS = 4
MAX_RESULTS = 16


async def _jobs(client: AdminAPI) -> list[dict[str, Any]]:
    """The last JOBS_LISTED lifecycle jobs and the last SCALE_JOBS_LISTED scale events, newest first:
    a busy autoscaler's events must not push an update or an eval off the list. A daemon older than
    scale jobs refuses `kind` (400): its last jobs, all kinds, as before."""
    try:
        jobs = as_list(await client.get("/jobs", {"limit": JOBS_LISTED, "kind": LIFECYCLE_KINDS}))
        scale = as_list(await client.get("/jobs", {"limit": SCALE_JOBS_LISTED, "kind": "scale"}))
    except AdminRefused as e:
        if e.status != 400:
            raise
        return as_list(await client.get("/jobs", {"limit": JOBS_LISTED}))
    both = [*jobs, *scale]
    return sorted(both, key=lambda j: j.get("created_at") if isinstance(j.get("created_at"), (int, float)) else 0.0,
                  reverse=True)


async def fetch_lifecycle(client: AdminAPI, models: list[str], kept: dict[str, Any]) -> dict[str, Any]:
    """The lifecycle section (lifecycle_rows.py's shape). ``models``: whose revisions to ask for;
    ``kept``: the section fetched before (its results are reused). An AdminError of the jobs or
    suites call is raised (the view shows it); a model that went away between calls is skipped."""
    jobs = await _jobs(client)
    suites = as_list(await client.get("/suites"))
    names = sorted({*models, *(str(j["model"]) for j in jobs
                               if isinstance(j.get("model"), str) and j.get("kind") != "scale")})[:MAX_MODELS]
    revisions: dict[str, Any] = {}
    for name in names:
        try:
            revisions[name] = as_dict(await client.get(f"/models/{quote(name, safe='')}/revisions"))
        except AdminRefused as e:
            if e.status != 404:
                raise
    old = as_dict(kept.get("results"))
    results: dict[str, Any] = {}
    fresh = 0
    for j in jobs:  # newest first: the latest results are the ones kept
        jid = j.get("id")
        if j.get("kind") != "eval" or j.get("state") != "succeeded" or not isinstance(jid, str):
            continue
        if len(results) >= MAX_RESULTS:
            break
        if jid in old:
            results[jid] = old[jid]
        elif fresh < MAX_NEW_RESULTS:
            fresh += 1
            try:
                r = as_dict(await client.get(f"/jobs/{quote(jid, safe='')}")).get("result")
            except AdminError:
                continue
            if isinstance(r, dict):
                results[jid] = r
    return {"jobs": jobs, "suites": suites, "revisions": revisions, "results": results, "error": ""}
