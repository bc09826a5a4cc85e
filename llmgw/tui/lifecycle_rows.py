"""The console's Lifecycle view as plain data (the rows.py pattern): per model its live and
candidate revisions (state, replicas ready, canary share with the two revisions' error rate and
TTFT side by side), the lifecycle jobs (state, steps, times) and the latest eval result (each
case passed or failed), and the choices the view's dialogs offer. Pure, built from a
ConsoleState's ``lifecycle`` section, which the view fetches from the admin API while it is shown
(llmgw.tui.lifecycle_fetch): ``{"revisions": {model: RevisionsView}, "jobs": [JobView],
"suites": [SuiteView], "results": {job_id: result}, "error": str}``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, tzinfo
from typing import Any

from llmgw.tui.rows import Column, Row, _filtered, _num, _short, _str, fmt_age, fmt_pct
from llmgw.tui.state import ConsoleState, as_dict, as_list

__all__ = ["JOB_COLUMNS", "REVISION_COLUMNS", "Choice", "eval_choices", "eval_lines", "job_lines", "job_rows",
           "latest_result", "lifecycle_models", "promote_choices", "revision_rows", "rollback_text",
           "suite_verdict"]

REVISION_COLUMNS = (Column("model"), Column("revision"), Column("role"), Column("state", toned=True),
                    Column("ready"), Column("canary"), Column("requests"), Column("errors"), Column("ttft"),
                    Column("note"))
JOB_COLUMNS = (Column("job"), Column("kind"), Column("model"), Column("rev"), Column("state", toned=True),
               Column("started"), Column("took"), Column("step (running) or outcome"))
JOB_TONES = {"running": "busy", "succeeded": "good", "failed": "bad"}
STEP_MARK = {"running": "…", "done": "✓", "failed": "✗"}
CASES_SHOWN = 20  # cases listed under the latest result (the rest are counted)


def _time(unix: Any, tz: tzinfo | None) -> str:
    if isinstance(unix, bool) or not isinstance(unix, (int, float)) or not 0 <= unix < 1e11:
        return "-"
    return datetime.fromtimestamp(unix, tz).strftime("%H:%M:%S")


def _ms(v: Any) -> str:
    return f"{v:.0f} ms" if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"


def _revisions(state: ConsoleState) -> dict[str, dict[str, Any]]:
    return {k: v for k, v in as_dict(state.lifecycle.get("revisions")).items() if isinstance(v, dict)}


def lifecycle_models(state: ConsoleState) -> list[str]:
    """The models the view shows: those the daemon has that an update can act on (made through
    the admin API, with a deploy profile), and any with revisions or jobs."""
    names = {m.get("name") for m in state.models
             if m.get("source") != "config" and m.get("desired_replicas") is not None}
    names |= set(_revisions(state)) | {j.get("model") for j in as_list(state.lifecycle.get("jobs"))
                                       if j.get("kind") != "scale"}  # an autoscaler's event is no revision
    present = state.present_models()
    return sorted(n for n in names if isinstance(n, str) and (not present or n in present))


def _side(c: Mapping[str, Any]) -> tuple[str, str, str]:
    """(requests, errors, ttft) of one revision under a canary."""
    return (str(int(_num(c.get("requests")))), f"{int(_num(c.get('failed')))} ({fmt_pct(c.get('error_rate'))})",
            _ms(c.get("ttft_ms_mean")))


def revision_rows(state: ConsoleState, text: str = "") -> list[Row]:
    """Per model: its live revision, then its candidate (if any), the canary's figures side by side."""
    rows: list[Row] = []
    revisions = _revisions(state)
    models = {m.get("name"): m for m in state.models}
    for name in lifecycle_models(state):
        rv = revisions.get(name, {})
        m = as_dict(models.get(name))
        canary = as_dict(rv.get("canary"))
        share = canary.get("share")
        share_s = f"{_num(share) * 100:g}%" if isinstance(share, (int, float)) else "-"
        live_fig = _side(as_dict(canary.get("live"))) if canary else ("-", "-", "-")
        prev = rv.get("previous")
        note = f"rollback brings back {prev}" if isinstance(prev, str) and prev else ""
        ready, placed = int(_num(m.get("ready"))), int(_num(m.get("replicas")))
        rows.append(Row(f"{name}\0live", (name, _str(rv.get("live"), "r1"), "live", "serving" if ready else "no replica ready",
                                          f"{ready}/{placed}", share_s if canary else "-", *live_fig, note),
                        "good" if ready else "warn", search=name))
        cand = rv.get("candidate")
        if isinstance(cand, dict):
            reps = [r for r in cand.get("replicas", []) if isinstance(r, str)] \
                if isinstance(cand.get("replicas"), list) else []
            c_ready = int(_num(cand.get("ready")))
            want = max(len(reps), int(_num(as_dict(as_dict(cand.get("definition")).get("deploy")).get("count"))))
            room = cand.get("unplaceable")
            st, tone = ("ready", "good") if want and c_ready >= want else \
                (("waiting for room", "warn") if isinstance(room, str) and room else ("starting", "busy"))
            fig = _side(as_dict(canary.get("candidate"))) if canary else ("-", "-", "-")
            rows.append(Row(f"{name}\0candidate", (name, _str(cand.get("id"), "?"), "candidate", st,
                                                   f"{c_ready}/{want}", share_s if canary else "0% (no traffic)", *fig,
                                                   _str(room, "")), tone, search=name))
    return _filtered(rows, text)


def _jobs(state: ConsoleState) -> list[dict[str, Any]]:
    return as_list(state.lifecycle.get("jobs"))


def job_rows(state: ConsoleState, text: str = "", tz: tzinfo | None = None, now: float | None = None) -> list[Row]:
    """The jobs, newest first (as the daemon lists them); ``now`` (Unix) times a running one."""
    rows = []
    for j in _jobs(state):
        jid = _str(j.get("id"), "?")
        steps = as_list(j.get("steps"))
        created, ended = j.get("created_at"), j.get("ended_at")
        took = _num(ended) - _num(created) if isinstance(ended, (int, float)) else \
            (now - _num(created) if now is not None and isinstance(created, (int, float)) else None)
        last = steps[-1] if steps else {}
        step = _str(last.get("name"), "")
        if j.get("state") != "running":  # how it ended says more than its last step
            step = _str(j.get("detail"), "") or step
        elif last.get("detail"):
            step = f"{step}: {_str(last.get('detail'))}"
        state_s = _str(j.get("state"), "?")
        rows.append(Row(jid, (jid, _str(j.get("kind"), "?"), _str(j.get("model"), "?"), _str(j.get("revision_id")),
                              state_s, _time(created, tz), fmt_age(took), _short(step.splitlines()[0] if step else "",
                                                                                  80)),
                        JOB_TONES.get(state_s, ""), search=step))
    return _filtered(rows, text)


def job_lines(state: ConsoleState, job_id: str | None, tz: tzinfo | None = None) -> list[str]:
    """The selected job's steps with their times, and how it ended."""
    j = next((j for j in _jobs(state) if j.get("id") == job_id), None)
    if j is None:
        return ["no job selected (t opens a job's trace)"]
    params = as_dict(j.get("params"))
    what = ", ".join(f"{k} {v}" for k, v in params.items() if k in ("suite", "revision", "canary", "require") and v)
    head = " ".join(x for x in (_str(j.get("kind"), "?"), _str(j.get("model"), "?"), _str(j.get("revision_id"), ""))
                    if x)  # a scale job has no revision
    out = [f"{head}: {_str(j.get('state'), '?')}" + (f" ({what})" if what else "") + " · t opens its trace"]
    for s in as_list(j.get("steps")):
        end = s.get("ended_at")
        took = fmt_age(_num(end) - _num(s.get("started_at"))) if isinstance(end, (int, float)) else "…"
        detail = _str(s.get("detail"), "").splitlines()
        out.append(f"  {STEP_MARK.get(str(s.get('state')), '?')} {_time(s.get('started_at'), tz)} {took:>6}  "
                   f"{_str(s.get('name'), '?')}" + (f": {detail[0]}" if detail else ""))
        out.extend(f"      {line}" for line in detail[1:8])
    if j.get("state") != "running" and j.get("detail"):
        out.append(f"  → {_str(j.get('detail')).splitlines()[0]}")
    return out


# -- eval results -------------------------------------------------------------------------------------
def _results(state: ConsoleState) -> dict[str, dict[str, Any]]:
    return {k: v for k, v in as_dict(state.lifecycle.get("results")).items() if isinstance(v, dict)}


def latest_result(state: ConsoleState, model: str) -> dict[str, Any] | None:
    """The model's newest eval result the console has (its jobs are newest first)."""
    results = _results(state)
    for j in _jobs(state):
        if j.get("model") == model and j.get("kind") == "eval" and j.get("id") in results:
            return results[str(j["id"])]
    return None


def suite_verdict(state: ConsoleState, model: str, suite: str, revision_id: str) -> str:
    """How `suite` last went on `revision_id`: "passed", "failed", "running" or "not run"."""
    for j in _jobs(state):
        if j.get("model") != model or j.get("kind") != "eval" or j.get("revision_id") != revision_id:
            continue
        if as_dict(j.get("params")).get("suite") != suite:
            continue
        if j.get("state") == "running":
            return "running"
        r = _results(state).get(str(j.get("id")))
        if r is not None:
            return "passed" if r.get("passed") is True else "failed"
        if j.get("state") == "failed":
            return "failed"
    return "not run"


def eval_lines(state: ConsoleState, model: str | None) -> list[str]:
    r = latest_result(state, model) if model else None
    if r is None:
        return [f"no eval result of {model} yet (e runs a suite)" if model else "no model selected"]
    t = as_dict(r.get("totals"))
    verdict = "PASSED" if r.get("passed") is True else "FAILED"
    out = [f"latest eval: suite {_str(r.get('suite'), '?')} on {_str(r.get('revision'), '?')} "
           f"{_str(r.get('revision_id'), '?')}: {verdict} {int(_num(t.get('passed')))}/{int(_num(t.get('cases')))} "
           f"({fmt_pct(r.get('pass_rate'))}; {fmt_pct(r.get('threshold'))} needed) · ttft p50 "
           f"{_ms(t.get('ttft_ms_p50'))} · latency p50 {_ms(t.get('latency_ms_p50'))}"]
    c = r.get("compare")
    if isinstance(c, dict):
        worse = ", ".join(str(x) for x in as_list_str(c.get("newly_failing"))) or "none"
        out.append(f"  vs live {_str(c.get('live_revision_id'), '?')}: pass rate {fmt_pct(c.get('live_pass_rate'))}"
                   f" → {fmt_pct(c.get('pass_rate'))}, ttft p50 {_ms(c.get('live_ttft_ms_p50'))} → "
                   f"{_ms(c.get('ttft_ms_p50'))}; newly failing: {worse}")
    cases = as_list(r.get("cases"))
    for case in cases[:CASES_SHOWN]:
        ok = case.get("passed") is True
        why = "; ".join(as_list_str(case.get("failures"))) or _str(case.get("error"), "")
        out.append(f"  {'✓' if ok else '✗'} {_str(case.get('name'), '?')}  ttft {_ms(case.get('ttft_ms'))}  "
                   f"latency {_ms(case.get('latency_ms'))}" + ("" if ok else f"  {_short(why.splitlines()[0] if why else '', 100)}"))
    if len(cases) > CASES_SHOWN:
        out.append(f"  … {len(cases) - CASES_SHOWN} more cases: llmgw ctl jobs {_str(r.get('job'), '?')}")
    return out


def as_list_str(v: Any) -> list[str]:
    return [str(x) for x in v] if isinstance(v, list) else []


# -- the dialogs' choices ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Choice:
    label: str
    value: tuple[str, ...]  # what the action is called with
    tone: str = ""


def _candidate_id(state: ConsoleState, model: str) -> str | None:
    cand = _revisions(state).get(model, {}).get("candidate")
    return str(cand.get("id")) if isinstance(cand, dict) and cand.get("id") else None


def _suite_names(state: ConsoleState) -> list[str]:
    return sorted(str(s["name"]) for s in as_list(state.lifecycle.get("suites")) if isinstance(s.get("name"), str))


def eval_choices(state: ConsoleState, model: str) -> list[Choice]:
    """Each stored suite on the candidate (if there is one) and on the live revision."""
    cand = _candidate_id(state, model)
    live = _str(_revisions(state).get(model, {}).get("live"), "r1")
    out = []
    for s in _suite_names(state):
        if cand:
            out.append(Choice(f"{s} on candidate {cand} (last: {suite_verdict(state, model, s, cand)})",
                              (s, "candidate")))
        out.append(Choice(f"{s} on live {live} (last: {suite_verdict(state, model, s, live)})", (s, "live")))
    return out


def promote_choices(state: ConsoleState, model: str) -> list[Choice]:
    """Promote with no suite required, or requiring one stored suite (its verdict on the candidate
    shown: the daemon refuses one that has not passed)."""
    cand = _candidate_id(state, model)
    if cand is None:
        return []
    out = [Choice(f"promote {cand} without requiring a suite", ())]
    for s in _suite_names(state):
        v = suite_verdict(state, model, s, cand)
        out.append(Choice(f"promote {cand} requiring suite {s} ({v} on {cand})", (s,),
                          "good" if v == "passed" else "bad"))
    return out


def rollback_text(state: ConsoleState, model: str) -> str | None:
    """What a rollback would do, or None when there is nothing to roll back."""
    rv = _revisions(state).get(model, {})
    cand = _candidate_id(state, model)
    if cand:
        return f"Discard candidate {cand} of {model}? Its replicas drain and stop; live {_str(rv.get('live'), 'r1')} is untouched."
    prev = rv.get("previous")
    if isinstance(prev, str) and prev:
        return (f"Bring back {prev} of {model}? It returns as a new candidate and is promoted once ready; "
                f"{_str(rv.get('live'), '?')} then drains.")
    return None
