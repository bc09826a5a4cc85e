"""The lifecycle's pure rules: revisions (merge, --set, when promote and rollback may act), jobs
(steps, bounds, a restart), evals (each check, totals, the comparison), and the router core's side
(a candidate's key resolves for no client; the canary share)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.config import parse_config
from llmgw.lifecycle.evals import Answer, compare, judge, summarize
from llmgw.lifecycle.jobs import (
    MAX_DETAIL,
    MAX_STEPS,
    Job,
    after_restart,
    job_from_dict,
)
from llmgw.lifecycle.revisions import (
    LifecycleError,
    ModelRevisions,
    Revision,
    merge_definition,
    parse_sets,
    promote_problem,
    revisions_from_dict,
    rollback_action,
)
from llmgw.lifecycle.suites import parse_suite
from llmgw.route.cache_stats import CacheStats
from llmgw.route.dispatch import RouterCore
from llmgw.config.names import candidate_key
from llmgw.route.openai_req import ApiError
from llmgw.route.readiness import readiness
from llmgw.route.replicas import ReplicaTable


# -- revisions --------------------------------------------------------------------------------------
def test_an_update_merges_tables_and_replaces_the_rest() -> None:
    cur = {"name": "m", "engine": "vllm", "deploy": {"count": 2, "args": ["--a"], "env": ["X=1"]}}
    assert merge_definition(cur, None) == cur
    got = merge_definition(cur, {"deploy": {"args": ["--b"]}, "strategy": "batch"})
    assert got == {"name": "m", "engine": "vllm", "strategy": "batch", "deploy": {"count": 2, "args": ["--b"],
                                                                                 "env": ["X=1"]}}
    assert cur["deploy"]["args"] == ["--a"]  # the live definition is not touched
    with pytest.raises(LifecycleError, match="cannot rename"):
        merge_definition(cur, {"name": "other"})


defs = st.recursive(st.integers() | st.text(max_size=3) | st.lists(st.integers(), max_size=2),
                    lambda kids: st.dictionaries(st.sampled_from("abcd"), kids, max_size=3), max_leaves=8)


@given(st.dictionaries(st.sampled_from("abcd"), defs, max_size=4), st.dictionaries(st.sampled_from("abcd"), defs,
                                                                                    max_size=4))
def test_a_merge_keeps_every_key_and_takes_every_change(cur: dict, change: dict) -> None:
    got = merge_definition(cur, change)
    assert set(got) == set(cur) | set(change)
    for k, v in change.items():
        if not (isinstance(v, dict) and isinstance(cur.get(k), dict)):
            assert got[k] == v
    assert merge_definition(got, change) == got  # idempotent


def test_set_pairs_are_toml_values_or_strings() -> None:
    assert parse_sets(["deploy.count=3", "deploy.args=[\"--x\", \"1\"]", "strategy=batch", "deploy.simulate=true"]) \
        == {"deploy": {"count": 3, "args": ["--x", "1"], "simulate": True}, "strategy": "batch"}
    for bad in (["count"], ["=1"], ["a..b=1"]):
        with pytest.raises(ValueError, match="key=value"):
            parse_sets(bad)
    with pytest.raises(ValueError, match="a value and a table"):
        parse_sets(["a=1", "a.b=2"])


def _revs(candidate: bool = True) -> ModelRevisions:
    r = ModelRevisions("m")
    if candidate:
        r.candidate = Revision(r.new_id(), {"name": "m"}, 0.0)
    return r


def test_promote_needs_a_ready_candidate_and_its_required_suites_passed_on_it() -> None:
    assert "no candidate" in promote_problem(None, ready=1, wanted=1, required=[], results={})
    assert "no candidate" in promote_problem(_revs(False), ready=1, wanted=1, required=[], results={})
    r = _revs()
    assert "1/2 replicas ready" in promote_problem(r, ready=1, wanted=2, required=[], results={})
    assert promote_problem(r, ready=2, wanted=2, required=[], results={}) is None
    assert "has not run on candidate r2" in promote_problem(r, ready=1, wanted=1, required=["s"], results={"s": None})
    stale = {"s": {"revision_id": "r1", "passed": True}}
    assert "has not run on candidate r2" in promote_problem(r, ready=1, wanted=1, required=["s"], results=stale)
    failed = {"s": {"revision_id": "r2", "passed": False, "pass_rate": 0.5, "threshold": 0.9}}
    assert "failed on candidate r2 (50% passed, 90% needed)" in promote_problem(
        r, ready=1, wanted=1, required=["s"], results=failed)
    assert promote_problem(r, ready=1, wanted=1, required=["s"],
                           results={"s": {"revision_id": "r2", "passed": True}}) is None


def test_rollback_discards_a_candidate_or_undoes_a_recent_promote() -> None:
    assert rollback_action(_revs(), 0.0) == "discard"
    with pytest.raises(LifecycleError, match="no candidate, and no promote"):
        rollback_action(_revs(False), 0.0)
    with pytest.raises(LifecycleError):
        rollback_action(None, 0.0)
    r = _revs(False)
    r.previous, r.promoted_at = Revision("r1", {}, 0.0), 100.0
    assert rollback_action(r, 150.0, grace_s=60) == "restore"
    with pytest.raises(LifecycleError, match="more than 60 s ago"):
        rollback_action(r, 161.0, grace_s=60)
    assert revisions_from_dict(r.to_dict()) == r
    # a restored revision says whose definition it is, candidate and then live; stored before: ""
    r.candidate = Revision("r3", {"name": "m"}, 200.0, restored_from="r1")
    r.live_restored_from = "r1"
    assert revisions_from_dict(r.to_dict()) == r
    old = r.to_dict()
    del old["live_restored_from"], old["candidate"]["restored_from"]
    back = revisions_from_dict(old)
    assert back.live_restored_from == "" and back.candidate is not None and back.candidate.restored_from == ""


# -- jobs -------------------------------------------------------------------------------------------
def test_a_job_records_each_step_with_its_times_and_stays_bounded() -> None:
    j = Job("update-1", "update", "m", 10.0)
    j.step("placing", 10.0)
    j.note("1/2 ready")
    j.step("waiting", 11.0)
    j.fail(12.0, "x" * (MAX_DETAIL + 10))
    assert [(s.name, s.state, s.started_at, s.ended_at) for s in j.steps] == [
        ("placing", "done", 10.0, 11.0), ("waiting", "failed", 11.0, 12.0)]
    assert j.steps[0].detail == "1/2 ready" and len(j.detail) == MAX_DETAIL and j.ended_at == 12.0
    j.succeed(13.0)  # an ended job stays as it ended
    assert j.state == "failed"
    assert job_from_dict(j.to_dict()) == j
    k = Job("eval-1", "eval", "m", 0.0)
    for i in range(MAX_STEPS + 20):
        k.step(f"s{i}", float(i))
    assert len(k.steps) == MAX_STEPS and k.steps[-1].name == f"s{MAX_STEPS + 19}"
    with pytest.raises(ValueError):
        job_from_dict({**k.to_dict(), "kind": "nope"})


def test_after_a_restart_an_update_resumes_and_the_rest_fail() -> None:
    up = Job("u", "update", "m", 0.0)
    assert after_restart(up, 5.0, candidate_exists=True) == "resume" and up.state == "running"
    gone = Job("u2", "update", "m", 0.0)
    assert after_restart(gone, 5.0, candidate_exists=False) == "failed" and "restarted" in gone.detail
    ev = Job("e", "eval", "m", 0.0)
    assert after_restart(ev, 5.0, candidate_exists=True) == "failed" and ev.ended_at == 5.0
    rb = Job("rollback-1", "rollback", "m", 0.0)  # a restore waiting for its candidate goes on too
    assert after_restart(rb, 5.0, candidate_exists=True) == "resume" and rb.state == "running"


# -- evals ------------------------------------------------------------------------------------------
SUITE = parse_suite("""name = "s"
pass_threshold = 0.5
[[cases]]
name = "all"
prompt = "x"
[cases.checks]
contains = ["red"]
not_contains = ["blue"]
regex = "^r"
equals = "red"
max_tokens = 3
max_ttft_ms = 100
max_latency_ms = 200
[[cases]]
name = "json"
prompt = "x"
checks = { json_schema = { type = "object", required = ["a"] } }
""")


def test_each_check_and_every_failure_is_reported() -> None:
    every, js = SUITE.cases
    ok = judge(every, Answer("red", tokens=1, ttft_ms=10, latency_ms=20))
    assert ok["passed"] and ok["failures"] == [] and ok["excerpt"] == "red"
    bad = judge(every, Answer("blue!", tokens=9, ttft_ms=500, latency_ms=900))
    assert not bad["passed"] and len(bad["failures"]) == 7, bad["failures"]
    assert judge(every, Answer(error="timed out after 1 s"))["failures"] == ["timed out after 1 s"]
    assert judge(js, Answer('```json\n{"a": 1}\n```'))["passed"]
    assert "JSON schema" in judge(js, Answer('{"b": 1}'))["failures"][0]
    assert "not JSON" in judge(js, Answer("nope"))["failures"][0]
    # a model's answer nested past the parser's recursion: a failed check, not a RecursionError
    deep = judge(js, Answer("[" * 100_000 + "]" * 100_000))["failures"][0]
    assert deep.startswith("not JSON: nested deeper than 64 levels"), deep
    assert "no token count" in judge(every, Answer("red", ttft_ms=1, latency_ms=1))["failures"][0]


def test_totals_threshold_and_the_comparison_with_live() -> None:
    every, js = SUITE.cases
    cases = [judge(every, Answer("red", tokens=1, ttft_ms=10, latency_ms=20)), judge(js, Answer("x", ttft_ms=5,
                                                                                                 latency_ms=6))]
    s = summarize(SUITE, cases)
    assert s["passed"] and s["pass_rate"] == 0.5 and s["totals"]["failed"] == 1 and s["totals"]["ttft_ms_p50"] == 10
    assert not summarize(SUITE, [])["passed"]
    mine = {**s, "cases": cases, "revision_id": "r2"}
    live = {"revision_id": "r1", "pass_rate": 1.0, "totals": {"ttft_ms_p50": 7}, "ended_at": 1.0,
            "cases": [{"name": "all", "passed": False}, {"name": "json", "passed": True}]}
    c = compare(mine, live)
    assert c["newly_failing"] == ["json"] and c["newly_passing"] == ["all"] and c["live_ttft_ms_p50"] == 7
    assert compare(mine, None) is None


# -- the router core: candidates take no client traffic but the canary share -----------------------------
CFG = """
[[models]]
name = "m"
engine = "vllm"
[[models.replicas]]
url = "http://127.0.0.1:1"
"""
BODY = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'


def _core(seed: int = 0) -> RouterCore:
    cfg = parse_config(CFG)
    core = RouterCore(cfg, ReplicaTable(cfg), cache_stats=CacheStats(), wall=lambda: 0.0, rng=random.Random(seed))
    cand = cfg.models[0].__class__(**{**cfg.models[0].__dict__, "name": candidate_key("m"), "replicas": ()})
    core.add_replica(cand, "m/cand", "http://127.0.0.1:2", pool="default", weight=1.0)
    return core


def test_a_candidate_is_reached_only_when_asked() -> None:
    core = _core()
    assert core.plan("chat", BODY, "r", strategy=None, session=None, now=0).model == "m"
    assert core.plan("chat", BODY, "r", strategy=None, session=None, now=0, revision="candidate").model == "m#candidate"
    with pytest.raises(ApiError) as e:
        core.plan("chat", b'{"model": "m#candidate", "messages": []}', "r", strategy=None, session=None, now=0)
    assert e.value.status == 404
    assert [m.model for m in readiness(core.table).models] == ["m"]  # nobody waits for a candidate


@pytest.mark.parametrize("share", [0.05, 0.3])
def test_the_canary_share_is_kept_within_three_points_over_2000_requests(share: float) -> None:
    core = _core(seed=1)
    core.set_canary("m", share)
    n = sum(core.plan("chat", BODY, "r", strategy=None, session=None, now=0).model == "m#candidate"
            for _ in range(2000))
    assert abs(n / 2000 - share) <= 0.03, n
    core.set_canary("m", 0)
    assert all(core.plan("chat", BODY, "r", strategy=None, session=None, now=0).model == "m" for _ in range(200))


def test_an_eval_on_live_is_never_diverted_and_its_counts_stay_apart() -> None:
    core = _core(seed=1)
    core.set_canary("m", 0.5)
    plans = [core.plan("chat", BODY, "r", strategy=None, session=None, now=0, revision="live", internal=True)
             for _ in range(200)]
    assert {p.model for p in plans} == {"m"} and all(p.internal for p in plans)
    core._done(plans[0], "ok", 200, 0.01, 0.02, 0.0)
    core._done(plans[1], "failed", 502, None, None, 0.0)
    assert core.counters.internal == {"m": [2, 1, 0.01, 1]}
    client = core.plan("chat", BODY, "r", strategy=None, session=None, now=0)
    core._done(client, "ok", 200, 0.01, 0.02, 0.0)
    assert core.counters.internal["m"][0] == 2  # a client's request is not in the eval tally


def test_a_trace_carries_the_revision_id_it_is_told() -> None:
    core = _core()
    assert core.plan("chat", BODY, "r", strategy=None, session=None, now=0).trace.revision == ""
    core.set_revision("m", "r2")
    core.set_revision("m#candidate", "r3")
    assert core.plan("chat", BODY, "r", strategy=None, session=None, now=0).trace.revision == "r2"
    cand = core.plan("chat", BODY, "r", strategy=None, session=None, now=0, revision="candidate")
    assert cand.trace.revision == "r3"
    core.set_revision("m#candidate", "")  # not told: still says it is the candidate
    cand = core.plan("chat", BODY, "r", strategy=None, session=None, now=0, revision="candidate")
    assert cand.trace.revision == "candidate"


def test_a_case_lists_a_bounded_number_of_failures() -> None:
    from llmgw.lifecycle.evals import MAX_FAILURE_CHARS, MAX_FAILURES
    many = parse_suite('name = "x"\n[[cases]]\nprompt = "p"\n[cases.checks]\ncontains = [' +
                       ", ".join(f'"{"w" * 500}{i}"' for i in range(40)) + "]\n").cases[0]
    v = judge(many, Answer("nothing", tokens=1, ttft_ms=1, latency_ms=1))
    assert len(v["failures"]) == MAX_FAILURES and v["failures"][-1] == f"and {40 - MAX_FAILURES + 1} more"
    assert all(len(f) <= MAX_FAILURE_CHARS for f in v["failures"])


def test_a_damaged_stored_live_result_is_compared_without_raising() -> None:
    every, _ = SUITE.cases
    cases = [judge(every, Answer("red", tokens=1, ttft_ms=10, latency_ms=20))]
    mine = {**summarize(SUITE, cases), "cases": cases}
    for live in ({"cases": "x", "totals": 3}, {"cases": [1, None, {"name": "all"}]}, {}):
        c = compare(mine, live)
        assert c is not None and c["newly_failing"] == [] and c["live_ttft_ms_p50"] is None
