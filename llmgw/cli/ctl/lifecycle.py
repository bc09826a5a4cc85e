"""`llmgw ctl`'s model lifecycle commands (docs/lifecycle.md): `models update|promote|rollback|
revisions NAME`, `eval MODEL --suite S`, `jobs [JOB]`, `suites [NAME | put [NAME] FILE | delete
NAME]`. main registers them (`register`) and hands each handler its connection; the output
functions come from output."""

from __future__ import annotations

import argparse
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

from llmgw.inputs.nesting import TooDeep, toml_loads
from llmgw.lifecycle.revisions import parse_sets
from llmgw.cli.ctl.output import CtlError, emit, table

__all__ = ["MODEL_ACTIONS", "model_action", "register"]

MODEL_ACTIONS = ("update", "promote", "rollback", "revisions")
MAX_PROFILE_BYTES = 1 << 20
_POLL_S = 0.5

def _m(name: str) -> str:
    return quote(name, safe="")


def _job_text(j: dict[str, Any]) -> str:
    what = " ".join(str(x) for x in (j["kind"], j["model"], j.get("revision_id")) if x)  # a scale job has no revision
    lines = [f"job {j['id']}: {what} — {j['state']}"
             + (f": {j['detail']}" if j.get("detail") else "")]
    for s in j.get("steps", []):
        took = "" if s.get("ended_at") is None else f" ({s['ended_at'] - s['started_at']:.1f}s)"
        lines.append(f"  {time.strftime('%H:%M:%S', time.localtime(s['started_at']))} {s['state']:<7} "
                     f"{s['name']}{took}")
        for d in (s.get("detail") or "").splitlines()[:40]:
            lines.append(f"      {d}")
    r = j.get("result")
    if r:
        lines.append(_result_text(r))
    return "\n".join(lines)


def _result_text(r: dict[str, Any]) -> str:
    t = r["totals"]
    out = [(f"suite {r['suite']} on {r['revision']} {r['revision_id']}: {'PASSED' if r['passed'] else 'FAILED'} "
            f"{t['passed']}/{t['cases']} ({r['pass_rate']:.0%}, {r['threshold']:.0%} needed); "
            f"TTFT p50 {t.get('ttft_ms_p50')} ms, latency p50 {t.get('latency_ms_p50')} ms")]
    rows = [[c["name"], "pass" if c["passed"] else "FAIL", c.get("ttft_ms"), c.get("latency_ms"),
             "; ".join(c.get("failures", []))[:120]] for c in r["cases"]]
    out.append(table(rows, ["CASE", "RESULT", "TTFT_MS", "LATENCY_MS", "WHY"]))
    cmp_ = r.get("compare")
    if cmp_:
        out.append(f"vs live {cmp_.get('live_revision_id')}: pass rate {cmp_.get('live_pass_rate')} → "
                   f"{cmp_.get('pass_rate')}, TTFT p50 {cmp_.get('live_ttft_ms_p50')} → {cmp_.get('ttft_ms_p50')} ms"
                   + (f"; newly failing: {', '.join(cmp_['newly_failing'])}" if cmp_.get("newly_failing") else "")
                   + (f"; newly passing: {', '.join(cmp_['newly_passing'])}" if cmp_.get("newly_passing") else ""))
    return "\n".join(out)


def _wait(api: Any, job: dict[str, Any], timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while job["state"] == "running":
        if time.monotonic() > deadline:
            raise CtlError(f"job {job['id']} still running after {timeout:g} s: `llmgw ctl jobs {job['id']}` "
                          "shows it later")
        time.sleep(_POLL_S)
        job = api.call("GET", f"/jobs/{_m(job['id'])}")
    return job


def _change(ns: argparse.Namespace) -> dict[str, Any] | None:
    change: dict[str, Any] = {}
    if ns.file:
        try:
            raw = Path(ns.file).read_bytes()
            if len(raw) > MAX_PROFILE_BYTES:
                raise CtlError(f"{ns.file}: larger than {MAX_PROFILE_BYTES} bytes")
            doc = toml_loads(raw.decode())
        except OSError as e:
            raise CtlError(f"{ns.file}: {e.strerror or e}") from None
        except TooDeep as e:
            raise CtlError(f"{ns.file}: {e}" + (f" (line {e.line})" if e.line else "")) from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise CtlError(f"{ns.file}: not valid TOML: {e}") from None
        models = doc.get("models")  # a config-style file with one [[models]] is accepted too
        if isinstance(models, list) and len(models) == 1 and set(doc) == {"models"}:
            doc = models[0]
        change.update(doc)
    if ns.set:
        try:
            sets = parse_sets(ns.set)
        except ValueError as e:
            raise CtlError(str(e)) from None
        for k, v in sets.items():
            change[k] = {**change[k], **v} if isinstance(v, dict) and isinstance(change.get(k), dict) else v
    return change or None


def _percent(text: str) -> float:
    try:
        v = float(text.strip().rstrip("%"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a share like 5%, got {text!r}") from None
    if not 0 <= v <= 100:
        raise argparse.ArgumentTypeError(f"a share from 0% to 100%, got {text!r}")
    return v


def model_action(api: Any, ns: argparse.Namespace) -> None:
    name, action = ns.target, ns.name
    base = f"/models/{_m(name)}"
    if action == "revisions":
        emit(ns, api.call("GET", f"{base}/revisions"), _revisions_text)
        return
    if action == "update":
        params = {"canary": ns.canary, "ready_timeout_s": ns.ready_timeout}
        job = api.call("POST", f"{base}/update", params=params, body=_change(ns))
    elif action == "promote":
        job = api.call("POST", f"{base}/promote", body={"require_suites": ns.require_suite or []})
    else:
        job = api.call("POST", f"{base}/rollback")
    if ns.wait:
        job = _wait(api, job, ns.wait_timeout)
    emit(ns, job, _job_text)
    if job["state"] == "failed":
        raise CtlError(f"job {job['id']} failed")


def _revisions_text(r: dict[str, Any]) -> str:
    lines = [f"model {r['model']}: live {r['live']}"
             + (f" (restored from {r['live_restored_from']})" if r.get("live_restored_from") else "")
             + (f"; previous {r['previous']} (rollback brings it back)" if r.get("previous") else "")]
    c = r.get("candidate")
    if c:
        lines.append(f"candidate {c['id']}" + (f" (restored from {c['restored_from']})" if c.get("restored_from")
                                               else "") + f": {c['ready']}/{len(c['replicas'])} replicas ready"
                     + (f"; cannot place: {c['unplaceable']}" if c.get("unplaceable") else ""))
    else:
        lines.append("no candidate")
    k = r.get("canary")
    if k:
        lines.append(table([[rev, k[rev]["requests"], k[rev]["failed"], k[rev]["error_rate"], k[rev]["ttft_ms_mean"]]
                              for rev in ("live", "candidate")],
                             [f"CANARY {k['share']:.0%}", "REQUESTS", "FAILED", "ERROR_RATE", "TTFT_MS"]))
    return "\n".join(lines)


def cmd_eval(api: Any, ns: argparse.Namespace) -> None:
    job = api.call("POST", f"/models/{_m(ns.model)}/eval", body={"suite": ns.suite, "revision": ns.revision})
    if ns.no_wait:
        emit(ns, job, _job_text)
        return
    job = _wait(api, job, ns.wait_timeout)
    emit(ns, job, _job_text)
    r = job.get("result")
    if job["state"] == "failed" or (r is not None and not r["passed"]):
        raise CtlError(f"suite {ns.suite} did not pass (job {job['id']})")


def cmd_jobs(api: Any, ns: argparse.Namespace) -> None:
    if ns.job:
        emit(ns, api.call("GET", f"/jobs/{_m(ns.job)}"), _job_text)
        return

    def render(jobs: list[dict[str, Any]]) -> str:
        rows = [[j["id"], j["kind"], j["model"], j.get("revision_id"), j["state"],
                 time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(j["created_at"])),
                 (j["steps"][-1]["name"] if j["steps"] else ""), (j.get("detail") or "").splitlines()[0:1]]
                for j in jobs]
        return table(rows, ["JOB", "KIND", "MODEL", "REVISION", "STATE", "CREATED", "STEP", "DETAIL"])

    emit(ns, api.call("GET", "/jobs", params={"model": ns.model, "kind": ns.kind, "limit": ns.limit}), render)


def cmd_suites(api: Any, ns: argparse.Namespace) -> None:
    if ns.action == "put":
        name, text = _suite_file(ns.name if ns.file else None, ns.file or ns.name)
        s = api.call("PUT", f"/suites/{_m(name)}", body={"toml": text})
        print(f"suite {s['name']} stored: {s['cases']} cases, pass threshold {s['pass_threshold']:.0%}")
        return
    if ns.action == "delete":
        if not ns.name:
            raise CtlError("suites delete NAME")
        api.call("DELETE", f"/suites/{_m(ns.name)}")
        print(f"suite {ns.name} deleted")
        return
    if ns.action == "show" or (ns.action and not ns.name):
        name = ns.name or ns.action
        emit(ns, api.call("GET", f"/suites/{_m(name)}"), lambda s: s["toml"])
        return
    emit(ns, api.call("GET", "/suites"), lambda ss: table(
        [[s["name"], s["cases"], f"{s['pass_threshold']:.0%}", s["description"]] for s in ss],
        ["SUITE", "CASES", "THRESHOLD", "DESCRIPTION"]))


def _suite_file(name: str | None, file: str | None) -> tuple[str, str]:
    """`suites put [NAME] FILE`: the name the suite is stored under — the file's own `name`, else
    the file's stem — and the file's text. A NAME that differs from the file's `name` is refused."""
    if not file:
        raise CtlError("suites put [NAME] FILE: the suite's TOML file is missing")
    try:
        text = Path(file).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise CtlError(f"suites put: {file}: {getattr(e, 'strerror', None) or e}") from None
    try:
        own = toml_loads(text).get("name")
    except (tomllib.TOMLDecodeError, TooDeep):
        own = None  # the router names every problem (its line, or how deep it nests)
    if isinstance(own, str) and own:
        if name is not None and name != own:
            raise CtlError(f"suites put: {file} names suite {own!r}, not {name!r}: drop NAME (the file's name is "
                          f"used) or change the file's `name`")
        return own, text
    return name or Path(file).stem, text


def add_model_options(sp: argparse.ArgumentParser) -> None:
    """`models update|promote|rollback` options, on the `models` command."""
    g = sp.add_argument_group("update, promote, rollback")
    g.add_argument("--file", metavar="PROFILE.toml", help="update: the changed parts of the definition (a model "
                                                          "table, or a file with one [[models]])")
    g.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="update: change one key (dotted: deploy.args='[\"--x\"]'); repeatable")
    g.add_argument("--canary", type=_percent, default=None, metavar="PERCENT",
                   help="update: send this share of the model's client requests to the candidate once it is ready")
    g.add_argument("--ready-timeout", type=float, default=None, metavar="SECONDS",
                   help="update: fail the job if the candidate is not ready by then (default: 900)")
    g.add_argument("--require-suite", action="append", metavar="SUITE",
                   help="promote: refuse unless this suite passed on the candidate; repeatable")
    g.add_argument("--wait", action="store_true", help="wait for the job to end and print it")
    g.add_argument("--wait-timeout", type=float, default=1800.0, metavar="SECONDS",
                   help="how long --wait waits (default: 1800)")


def register(add: Callable[..., argparse.ArgumentParser]) -> None:
    sp = add("eval", cmd_eval, "run an eval suite against a model's candidate (or live) revision",
             "Runs the suite through the router's OpenAI port and prints each case and the totals, compared with "
             "the live revision's last result. Exits 1 when the suite does not pass.")
    sp.add_argument("model", metavar="MODEL", help="the model's name")
    sp.add_argument("--suite", required=True, metavar="SUITE", help="the suite's name (`llmgw ctl suites`)")
    sp.add_argument("--revision", choices=("candidate", "live"), default=None,
                    help="default: the candidate if there is one, else live")
    sp.add_argument("--no-wait", action="store_true", help="print the job and return at once")
    sp.add_argument("--wait-timeout", type=float, default=1800.0, metavar="SECONDS",
                    help="how long to wait for the result (default: 1800)")
    sp = add("jobs", cmd_jobs, "lifecycle jobs (update, eval, promote, rollback) and scale events with their steps, "
                               "or one job")
    sp.add_argument("job", nargs="?", metavar="JOB", help="one job's id: its steps and (an eval's) result")
    sp.add_argument("--model", help="only this model's jobs")
    sp.add_argument("--kind", metavar="KIND[,KIND]", help="only jobs of these kinds: update, eval, promote, rollback, "
                                                          "scale (an autoscaler's changes of a count)")
    sp.add_argument("--limit", type=int, default=20, metavar="N", help="at most N, newest first (default: 20)")
    sp = add("suites", cmd_suites, "eval suites: list, show NAME, put [NAME] FILE, delete NAME",
             "put stores FILE under the name the file gives (`name = ...`), else the file's stem; a NAME given "
             "must match the file's.")
    sp.add_argument("action", nargs="?", metavar="NAME | show | put | delete",
                    help="a suite's name (show it), or show, put, delete with the NAME")
    sp.add_argument("name", nargs="?", metavar="NAME", help="with an action: the suite (put: optional)")
    sp.add_argument("file", nargs="?", metavar="FILE", help="put: the suite's TOML file")
