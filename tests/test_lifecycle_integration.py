"""The model lifecycle over real processes: a router, an agent, simulated engines. Update makes a
candidate beside the live replicas; eval runs a suite on it through the router's OpenAI port;
promote switches with client load running and no failed request; rollback discards a candidate
or brings the previous revision back; a candidate that never becomes ready fails its job with the
engine's log tail and live traffic is untouched; a router restart resumes an update job."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx

from .test_fleet_integration import Fleet, fleet_factory, sim_model  # noqa: F401 (fixture)
from .test_sim_vllm import wait_for

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "suites"
FAST = ["--sim-decode-ms-per-token", "1"]
PASSING = """
name = "ok"
pass_threshold = 1.0
[[cases]]
name = "answers"
prompt = "hello"
params = { max_tokens = 4 }
checks = { regex = "\\\\w", max_tokens = 4 }
[[cases]]
name = "chat"
messages = [{ role = "user", content = "hi" }]
params = { max_tokens = 3 }
checks = { max_latency_ms = 20000 }
"""
FAILING = """
name = "strict"
[[cases]]
name = "json"
prompt = "answer JSON"
params = { max_tokens = 4 }
checks = { json = true }
"""


def api(f: Fleet, method: str, path: str, **kw: Any) -> httpx.Response:
    return f.admin.request(method, "/api/v1" + path, **kw)


def job(f: Fleet, jid: str) -> dict[str, Any]:
    return f.get(f"/api/v1/jobs/{jid}")


def wait_job(f: Fleet, jid: str, timeout: float = 40) -> dict[str, Any]:
    wait_for(lambda: job(f, jid)["state"] != "running", timeout)
    return job(f, jid)


def api_model(f: Fleet, name: str = "m", count: int = 1, **deploy: Any) -> None:
    body = {"name": name, "engine": "vllm", "deploy": {"count": count, "simulate": True, "health_timeout_s": 20.0,
                                                       "args": FAST, **deploy}}
    r = api(f, "POST", "/models", json=body)
    assert r.status_code == 201, r.text
    wait_for(lambda: len(f.ready(name)) == count, 30)


class Load:
    """Client requests in a loop (bounded), counting the failures."""

    def __init__(self, url: str, model: str, limit: int = 2000) -> None:
        self.url, self.model, self.limit = url, model, limit
        self.ok = self.failed = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        with httpx.Client(timeout=20) as c:
            while not self._stop.is_set() and self.ok + self.failed < self.limit:
                try:
                    r = c.post(f"{self.url}/v1/chat/completions", json={
                        "model": self.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                        "stream": True})
                    good = r.status_code == 200 and "upstream_failed" not in r.text and "[DONE]" in r.text
                except httpx.HTTPError as e:
                    good, r = False, None
                    self.errors.append(repr(e))
                if good:
                    self.ok += 1
                else:
                    self.failed += 1
                    if r is not None:
                        self.errors.append(f"{r.status_code} {r.text[:200]}")

    def stop(self) -> None:
        self._stop.set()
        self._t.join(30)


def test_update_eval_promote_under_load_fails_no_request(fleet_factory: Any) -> None:  # noqa: F811
    f = fleet_factory([])
    f.start_agent("a")
    api_model(f, count=1)
    live_id = f.ready("m")[0]["replica"]
    assert api(f, "PUT", "/api/v1/suites/ok".removeprefix("/api/v1"), json={"toml": PASSING}).status_code == 200
    load = Load(f.router.url, "m")
    try:
        r = api(f, "POST", "/models/m/update", json={"deploy": {"args": [*FAST, "--sim-seed", "7"]}})
        assert r.status_code == 202, r.text
        up = r.json()
        assert up["kind"] == "update" and up["revision_id"] == "r2"
        # a second update while this one runs is refused
        again = api(f, "POST", "/models/m/update")
        assert again.status_code == 409 and "running" in again.json()["error"]["message"]
        # promote before the candidate is ready is refused, and nothing changes
        early = api(f, "POST", "/models/m/promote")
        assert early.status_code == 409
        done = wait_job(f, up["id"])
        assert done["state"] == "succeeded", done
        assert done["steps"][0]["name"] == "placing candidate replicas"
        rev = f.get("/api/v1/models/m/revisions")
        assert rev["live"] == "r1" and rev["candidate"]["id"] == "r2" and rev["candidate"]["ready"] == 1
        # the candidate takes no client traffic: every client request went to the live replica
        before = load.ok
        wait_for(lambda: load.ok >= before + 20, 20)
        decisions = f.get("/api/v1/decisions?model=m&limit=20")
        assert {d["chosen"] for d in decisions if d.get("chosen")} == {live_id}
        # a client cannot reach the candidate with the header alone
        sneak = httpx.post(f"{f.router.url}/v1/chat/completions", headers={"x-llmgw-revision": "candidate"},
                           json={"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
        assert sneak.status_code == 403
        assert httpx.post(f"{f.router.url}/v1/chat/completions", json={
            "model": "m#candidate", "messages": [{"role": "user", "content": "x"}]}).status_code == 404
        # a failing suite blocks a guarded promote
        assert api(f, "PUT", "/suites/strict", json={"toml": FAILING}).status_code == 200
        ev = api(f, "POST", "/models/m/eval", json={"suite": "strict"})
        assert ev.status_code == 202, ev.text
        bad = wait_job(f, ev.json()["id"])
        assert bad["result"]["passed"] is False and bad["result"]["revision_id"] == "r2"
        refused = api(f, "POST", "/models/m/promote", json={"require_suites": ["strict"]})
        assert refused.status_code == 409 and "failed on candidate r2" in refused.json()["error"]["message"]
        # the live revision's result, then the candidate's: compared
        live_ev = wait_job(f, api(f, "POST", "/models/m/eval", json={"suite": "ok", "revision": "live"}).json()["id"])
        assert live_ev["result"]["passed"] is True and live_ev["result"]["revision_id"] == "r1"
        ev = wait_job(f, api(f, "POST", "/models/m/eval", json={"suite": "ok"}).json()["id"])
        res = ev["result"]
        assert res["passed"] is True, res
        assert all(c["ttft_ms"] is not None and c["latency_ms"] is not None and c["excerpt"] for c in res["cases"])
        assert res["compare"]["live_revision_id"] == "r1" and res["compare"]["live_pass_rate"] == 1.0
        # the eval went through the normal request path: its decisions chose the candidate
        cand_reps = {r["replica"] for r in f.replicas("m#candidate")}
        assert cand_reps and any(d["chosen"] in cand_reps for d in f.get("/api/v1/decisions?limit=200"))
        # a long stream on the live replica, in flight across the switch
        stream: dict[str, Any] = {}
        started = threading.Event()

        def long_stream() -> None:
            with httpx.stream("POST", f"{f.router.url}/v1/chat/completions", timeout=30, json={
                    "model": "m", "messages": [{"role": "user", "content": "tell"}], "max_tokens": 500,
                    "stream": True, "ignore_eos": True}) as r:
                stream.update(status=r.status_code, endpoint=r.headers.get("x-llmgw-endpoint"))
                started.set()
                stream["text"] = r.read().decode()

        t = threading.Thread(target=long_stream)
        t.start()
        assert started.wait(10)
        p = api(f, "POST", "/models/m/promote", json={"require_suites": ["ok"]})
        assert p.status_code == 200, p.text
        assert t.is_alive()  # the switch came while the stream was in flight
        t.join(30)
        assert stream["status"] == 200 and stream["text"].rstrip().endswith("data: [DONE]"), stream
        assert stream["endpoint"] == live_id
        assert p.json()["state"] == "succeeded"
        wait_for(lambda: {r["replica"] for r in f.replicas("m")} == cand_reps, 30)
        after = load.ok
        wait_for(lambda: load.ok >= after + 20, 20)
    finally:
        load.stop()
    assert load.failed == 0, load.errors[:5]
    rev = f.get("/api/v1/models/m/revisions")
    assert rev["live"] == "r2" and rev["candidate"] is None and rev["previous"] == "r1"
    kinds = [j["kind"] for j in f.get("/api/v1/jobs?model=m")]
    assert kinds[0] == "promote" and "update" in kinds and "eval" in kinds
    history = [e["event"] for e in f.get("/api/v1/history?model=m&limit=200")]
    assert "promoted" in history and "candidate created" in history


def test_rollback_discards_a_candidate_then_undoes_a_promote(fleet_factory: Any) -> None:  # noqa: F811
    f = fleet_factory([])
    f.start_agent("a")
    api_model(f, count=1)
    assert api(f, "POST", "/models/m/rollback").status_code == 409  # nothing to roll back
    assert api(f, "POST", "/models/m/promote").status_code == 409  # no candidate
    up = api(f, "POST", "/models/m/update", json={"deploy": {"args": [*FAST, "--sim-seed", "3"]}}).json()
    assert wait_job(f, up["id"])["state"] == "succeeded"
    live = {r["replica"] for r in f.ready("m")}
    rb = api(f, "POST", "/models/m/rollback")
    assert rb.status_code == 200 and rb.json()["kind"] == "rollback", rb.text
    wait_for(lambda: not f.replicas("m#candidate"), 30)
    assert {r["replica"] for r in f.ready("m")} == live
    assert f.get("/api/v1/models/m/revisions")["candidate"] is None
    # promote a new one, then roll the promote back: r1's definition returns as a new candidate, promoted once ready
    up = api(f, "POST", "/models/m/update", json={"deploy": {"args": [*FAST, "--sim-seed", "5"]}}).json()
    assert wait_job(f, up["id"])["state"] == "succeeded"
    assert api(f, "POST", "/models/m/promote").status_code == 200
    assert "--sim-seed" in f.get("/api/v1/models/m")["deploy"]["args"]
    back = api(f, "POST", "/models/m/rollback")
    assert back.status_code == 200, back.text
    wait_for(lambda: f.get("/api/v1/models/m/revisions")["candidate"] is None
             and f.get("/api/v1/models/m")["deploy"]["args"] == FAST, 40)
    wait_for(lambda: len(f.ready("m")) == 1 and f.chat("m").status_code == 200, 30)


def test_a_candidate_that_never_becomes_ready_fails_its_job_and_live_serves_on(fleet_factory: Any) -> None:  # noqa: F811
    f = fleet_factory([])
    f.start_agent("a")
    api_model(f, count=1)
    live = {r["replica"] for r in f.ready("m")}
    up = api(f, "POST", "/models/m/update", json={"deploy": {"args": ["--no-such-flag"]}}).json()
    done = wait_job(f, up["id"], 40)
    assert done["state"] == "failed"
    assert "--no-such-flag" in done["detail"] or "unrecognized" in done["detail"], done["detail"]
    assert "log tail" in done["detail"]
    wait_for(lambda: not f.replicas("m#candidate"), 30)
    assert {r["replica"] for r in f.ready("m")} == live
    assert f.chat("m").status_code == 200
    assert f.get("/api/v1/models/m/revisions")["candidate"] is None


def test_a_router_restart_resumes_an_update_job_and_fails_an_eval(fleet_factory: Any) -> None:  # noqa: F811
    f = fleet_factory([])
    f.start_agent("a")
    slow = ["--sim-decode-ms-per-token", "50"]  # 64 tokens: 3 s an answer
    api_model(f, count=1, args=slow)
    long = 'name = "long"\n[[cases]]\nprompt = "x"\nparams = { max_tokens = 60 }\n'  # about 3 s
    assert api(f, "PUT", "/suites/long", json={"toml": long}).status_code == 200
    up = api(f, "POST", "/models/m/update",
             json={"deploy": {"args": [*slow, "--sim-load-seconds", "3"]}}).json()
    ev = api(f, "POST", "/models/m/eval", json={"suite": "long", "revision": "live"}).json()
    assert job(f, ev["id"])["state"] == "running"
    f.stop_router()
    f.start_router()
    gone = job(f, ev["id"])
    assert gone["state"] == "failed" and "the router restarted" in gone["detail"]
    assert gone["steps"][-1]["state"] == "failed"
    j = wait_job(f, up["id"], 40)
    assert j["state"] == "succeeded", j
    assert any("router restarted: resumed" in s["name"] for s in j["steps"])
    assert api(f, "POST", "/models/m/promote").status_code == 200


def test_a_canary_share_reaches_the_candidate_and_is_shown(fleet_factory: Any) -> None:  # noqa: F811
    f = fleet_factory([])
    f.start_agent("a")
    api_model(f, count=1)
    up = api(f, "POST", "/models/m/update?canary=20", json={"deploy": {"args": [*FAST, "--sim-seed", "9"]}}).json()
    assert wait_job(f, up["id"])["state"] == "succeeded"
    cand = {r["replica"] for r in f.replicas("m#candidate")}
    hits = 0
    with httpx.Client(timeout=10) as c:
        for _ in range(2000):
            r = c.post(f"{f.router.url}/v1/chat/completions",
                       json={"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1})
            assert r.status_code == 200, r.text
            hits += r.headers["x-llmgw-endpoint"] in cand
    assert abs(hits / 2000 - 0.20) <= 0.03, hits
    view = f.get("/api/v1/models/m/revisions")["canary"]
    assert view["share"] == 0.2 and view["candidate"]["requests"] == hits
    assert view["live"]["requests"] == 2000 - hits and view["candidate"]["error_rate"] == 0.0
    assert view["candidate"]["ttft_ms_mean"] is not None


def test_a_case_that_times_out_fails_and_the_run_goes_on(fleet_factory: Any) -> None:  # noqa: F811
    f = fleet_factory([])
    f.start_agent("a")
    api_model(f, count=1, args=["--sim-decode-ms-per-token", "20", "--sim-output-len", "200"])  # 4 s an answer
    suite = """name = "slow"
pass_threshold = 0.5
timeout_s = 0.5
concurrency = 2
[[cases]]
name = "long"
prompt = "x"
params = { max_tokens = 300, ignore_eos = true }
[[cases]]
name = "short"
prompt = "y"
params = { max_tokens = 2 }
"""
    r = api(f, "PUT", "/suites/slow", json={"toml": suite})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["problems"][0]["message"].startswith(
        "suite slow:8: cases[0].params.ignore_eos: unknown sampling parameter")
    assert api(f, "PUT", "/suites/slow", json={"toml": suite.replace(", ignore_eos = true", "")}).status_code == 200
    res = wait_job(f, api(f, "POST", "/models/m/eval", json={"suite": "slow"}).json()["id"])["result"]
    assert res["revision"] == "live" and res["passed"] is True
    long, short = res["cases"]
    assert not long["passed"] and long["failures"] == ["timed out after 0.5 s"]
    assert short["passed"]
    assert api(f, "POST", "/models/m/eval", json={"suite": "nope"}).status_code == 404
    assert api(f, "POST", "/models/m/eval", json={"suite": "slow", "revision": "candidate"}).status_code == 409


def test_a_candidates_replicas_are_stored_and_kept_across_a_router_restart(fleet_factory: Any) -> None:  # noqa: F811
    f = fleet_factory([])
    f.start_agent("a")
    api_model(f, count=1)
    up = api(f, "POST", "/models/m/update", json={"deploy": {"args": [*FAST, "--sim-seed", "4"]}}).json()
    assert wait_job(f, up["id"])["state"] == "succeeded"
    wait_for(lambda: all(r["pid"] for r in f.ready("m#candidate")), 20)
    before = {r["replica"]: (r["node"], r["pid"]) for r in f.ready("m#candidate")}
    assert len(before) == 1
    f.stop_router()
    f.start_router()
    # the same engine, adopted by the restarted router: not stopped, not placed anew
    wait_for(lambda: len(f.ready("m#candidate")) == 1 and all(r["pid"] for r in f.ready("m#candidate")), 20)
    after = {r["replica"]: (r["node"], r["pid"]) for r in f.ready("m#candidate")}
    assert after == before
    assert all(r["restarts"] == 0 for r in f.ready("m#candidate"))
    assert {r["replica"] for r in f.replicas("m#candidate")} == set(before)
    rev = f.get("/api/v1/models/m/revisions")
    assert rev["candidate"]["id"] == "r2" and rev["candidate"]["ready"] == 1
    p = api(f, "POST", "/models/m/promote")
    assert p.status_code == 200, p.text
    wait_for(lambda: {r["replica"] for r in f.ready("m")} == set(before), 30)


def test_eval_requests_are_told_apart_and_traces_carry_revision_ids(fleet_factory: Any) -> None:  # noqa: F811
    f = fleet_factory([])
    f.start_agent("a")
    api_model(f, count=1)
    assert api(f, "PUT", "/suites/ok", json={"toml": PASSING}).status_code == 200
    assert api(f, "PUT", "/suites/strict", json={"toml": FAILING}).status_code == 200
    # a client request to a model never updated: its trace says r1
    r = f.chat("m")
    assert r.status_code == 200
    assert f.get(f"/api/v1/traces/{r.headers['x-request-id']}")["revision"] == "r1"
    up = api(f, "POST", "/models/m/update?canary=50", json={"deploy": {"args": [*FAST, "--sim-seed", "2"]}}).json()
    assert wait_job(f, up["id"])["state"] == "succeeded"
    # evals on both revisions: the canary's tally counts no eval request
    for rev in ("candidate", "live"):
        ev = wait_job(f, api(f, "POST", "/models/m/eval", json={"suite": "ok", "revision": rev}).json()["id"])
        assert ev["state"] == "succeeded" and ev["result"]["revision"] == rev, ev
        assert ev["id"].startswith("eval-")
    canary = f.get("/api/v1/models/m/revisions")["canary"]
    assert canary["candidate"]["requests"] == 0 and canary["live"]["requests"] == 0, canary
    # the eval's requests: ids of their own (case-HEX-i), traces with the revision's id
    hexes = {ev_hex for ev_hex in (j["id"].removeprefix("eval-") for j in f.get("/api/v1/jobs?model=m")
                                   if j["kind"] == "eval")}
    reqs = [t for t in f.get("/api/v1/traces?kind=request&limit=200") if t["model"] == "m"]
    cases = [t for t in reqs if t["id"].startswith("case-")]
    assert len(cases) == 4 and not any(t["id"].startswith("eval-") for t in reqs)
    assert {t["id"].split("-")[1] for t in cases} == hexes
    revisions = sorted(f.get(f"/api/v1/traces/{t['id']}")["revision"] for t in cases)
    assert revisions == ["r1", "r1", "r2", "r2"], revisions
    # client requests now: half to the candidate (r2), counted in the tally; traces say which
    seen = set()
    for _ in range(40):
        r = f.chat("m")
        assert r.status_code == 200
        seen.add(f.get(f"/api/v1/traces/{r.headers['x-request-id']}")["revision"])
    assert seen == {"r1", "r2"}
    canary = f.get("/api/v1/models/m/revisions")["canary"]
    assert canary["candidate"]["requests"] + canary["live"]["requests"] == 40, canary
    # a suite that ran and did not pass: the job failed, saying so, its result attached
    bad = wait_job(f, api(f, "POST", "/models/m/eval", json={"suite": "strict"}).json()["id"])
    assert bad["state"] == "failed" and bad["detail"].startswith("suite strict did not pass: 0/1 cases"), bad
    assert bad["result"]["passed"] is False and bad["steps"][-1]["name"] == "stored the result"
