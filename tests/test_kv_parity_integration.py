"""Tier 2's parity self-check over real processes: router + agent + simulated vLLM with kv_events.
An engine that hashes with another PYTHONHASHSEED than the router assumes (the simulator's
--sim-hash-seed), or with another hash algorithm, is flagged within 5 requests; a healthy one never is, through prefix hits and
evictions."""

from __future__ import annotations

import re
from typing import Any

import httpx
import pytest

from .test_ctl import ctl
from .test_fleet_integration import fleet_factory, sim_model  # noqa: F401 — the fixture
from .test_sim_vllm import wait_for


def metrics(f: Any) -> str:
    return httpx.get(f"{f.router.url}/metrics", timeout=5).text


def sample(text: str, name: str, **labels: str) -> float:
    """The value of the one series of `name` whose labels include `labels` (0 when absent)."""
    total = 0.0
    for m in re.finditer(rf"^{name}(?:\{{([^}}]*)\}})? (\S+)$", text, re.MULTILINE):
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


def chat(f: Any, text: str) -> None:
    r = httpx.post(f"{f.router.url}/v1/chat/completions", timeout=10,
                   json={"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 2})
    assert r.status_code == 200, r.text


def prompt(i: int) -> str:
    return f"conversation {i} starts here. " + f"a paragraph about topic {i} and its caches " * 30


@pytest.mark.parametrize("args", [["--sim-hash-seed", "7"], ["--prefix-caching-hash-algo", "sha256"]],
                         ids=["other-PYTHONHASHSEED", "other-hash-algo"])
def test_a_misconfigured_engine_is_flagged_within_5_requests(fleet_factory: Any, args: list[str]) -> None:  # noqa: F811
    f = fleet_factory([sim_model(count=1, kv_events=True, args=args)])
    f.start_agent("a")
    wait_for(lambda: len(f.ready("m")) == 1, 30)
    rid = f.ready("m")[0]["replica"]
    for i in range(5):
        chat(f, prompt(i))
    # every check settles within settle_s (2 s) of its request's end: no further request needed
    wait_for(lambda: sample(metrics(f), "llmgw_kv_parity_alarm", endpoint=rid) == 1.0, 15)
    text = metrics(f)
    assert sample(text, "llmgw_kv_parity_checks_total", endpoint=rid, model="m", outcome="pass") == 0
    assert 3 <= sample(text, "llmgw_kv_parity_checks_total", endpoint=rid, outcome="fail") <= 5
    log = f.log(f.router)
    assert f"tier 2 parity: replica {rid} (model m)" in log and "PYTHONHASHSEED" in log
    view = {r["replica"]: r for r in f.get("/api/v1/kv")["replicas"]}
    assert view[rid]["parity"]["status"] == "alarm" and view[rid]["parity"]["failed"] >= 3
    # the daemon's status says so too (issue 21 item 9): the API and `ctl status`
    assert f.get("/api/v1/status")["kv_parity_alarms"] == {rid: "m"}
    out = ctl("--socket", str(f.tmp / "admin" / "admin.sock"), "status")
    assert out.returncode == 0, out.stderr
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("kv parity"))
    assert f"ALARM {rid} (model m)" in line and "llmgw ctl kv" in line, out.stdout
    # a decision tier 2 could not make says why: ctl explain names the alarm
    r = httpx.post(f"{f.router.url}/v1/chat/completions", timeout=10, headers={"x-request-id": "after-alarm"},
                   json={"model": "m", "messages": [{"role": "user", "content": prompt(0)}], "max_tokens": 2})
    assert r.status_code == 200
    note = f.get("/api/v1/decisions/after-alarm")["decisions"][-1]["note"]
    assert f"parity alarm on {rid}: its engine hashes differently" in note, note


def test_a_healthy_engine_passes_through_prefix_hits_and_evictions(fleet_factory: Any) -> None:  # noqa: F811
    # 128 blocks of 16 tokens: these prompts (~20 blocks each) evict each other, but a block lives
    # through several requests (one stored and evicted within an agent flush, 0.1 s, would never travel)
    f = fleet_factory([sim_model(count=1, kv_events=True,
                                 args=["--sim-kv-blocks", "128", "--max-model-len", "1000"])])
    f.start_agent("a")
    wait_for(lambda: len(f.ready("m")) == 1, 30)
    rid = f.ready("m")[0]["replica"]
    order = [0, 1, 0, 0, 2, 3, 4, 2, 5, 6, 7, 0, 8, 8]  # repeats are prefix hits while cached
    for i in order:
        chat(f, prompt(i))
    # a prefix another router's requests stored (sent to the engine directly): the router's first
    # request for it stores nothing new, and passes because the blocks are in the index already
    url = f.ready("m")[0]["url"]
    before = sample(metrics(f), "llmgw_kv_index_block_events_total")
    r = httpx.post(f"{url}/v1/chat/completions", timeout=10,
                   json={"model": "m", "messages": [{"role": "user", "content": prompt(99)}], "max_tokens": 2})
    assert r.status_code == 200
    wait_for(lambda: sample(metrics(f), "llmgw_kv_index_block_events_total") > before, 10)
    decided = ("pass", "fail", "unknown")
    wait_for(lambda: sum(sample(metrics(f), "llmgw_kv_parity_checks_total", endpoint=rid, outcome=o)
                         for o in decided) == len(order), 15)
    passed = sample(metrics(f), "llmgw_kv_parity_checks_total", endpoint=rid, outcome="pass")
    chat(f, prompt(99))
    order.append(99)
    assert sample(metrics(f), "llmgw_kv_parity_checks_total", endpoint=rid, outcome="pass") == passed + 1

    def settled() -> bool:
        text = metrics(f)
        return sum(sample(text, "llmgw_kv_parity_checks_total", endpoint=rid, outcome=o)
                   for o in ("pass", "fail", "unknown")) == len(order)

    wait_for(settled, 15)
    text = metrics(f)
    assert sample(text, "llmgw_kv_parity_checks_total", endpoint=rid, outcome="fail") == 0
    assert sample(text, "llmgw_kv_parity_checks_total", endpoint=rid, outcome="pass") >= len(order) - 2
    assert sample(text, "llmgw_kv_parity_alarm", endpoint=rid) == 0
    # the engine evicted: more block events than blocks held (each removal is one)
    held = sample(text, "llmgw_kv_index_blocks", endpoint=rid)
    assert sample(text, "llmgw_kv_index_block_events_total") > held + 20
    assert "tier 2 parity" not in f.log(f.router)
    kv = f.get("/api/v1/kv")
    assert kv["enabled"] and kv["blocks"] == held and kv["bytes"] > 0
    row = next(r for r in kv["replicas"] if r["replica"] == rid)
    assert row["model"] == "m" and row["node"] == "a" and row["blocks"] == held
    assert row["messages"] > 0 and row["lag_s"] is not None and row["resets"] >= 1 and row["gaps"] == 0
    assert row["tier1_decisions"] + row["tier2_decisions"] == len(order) and row["tier2_decisions"] >= 2
    assert row["parity"]["status"] == "ok" and row["parity"]["mismatch_rate"] == 0.0
    assert kv["models"] == [{"model": "m", "passed": row["parity"]["passed"], "failed": 0,
                             "unknown": row["parity"]["unknown"], "mismatch_rate": 0.0}]
    assert sum(kv["decisions"].values()) == len(order)

    # one more request moves each tier-2 counter by exactly one
    series = [("llmgw_kv_decisions_total", {}), ("llmgw_kv_matched_blocks_count", {}),
              ("llmgw_kv_tokenize_seconds_count", {}), ("llmgw_kv_tokenize_total", {}),
              ("llmgw_kv_tier_decisions_total", {"endpoint": rid}), ("llmgw_prefix_decisions_total", {}),
              ("llmgw_kv_parity_checks_total", {"endpoint": rid})]
    text = metrics(f)
    before = {name: sample(text, name, **labels) for name, labels in series}
    chat(f, prompt(123))
    wait_for(lambda: sample(metrics(f), "llmgw_kv_parity_checks_total", endpoint=rid)
             == before["llmgw_kv_parity_checks_total"] + 1, 15)
    text = metrics(f)
    assert {name: sample(text, name, **labels) - before[name] for name, labels in series} == \
        {name: 1.0 for name, _ in series}
    assert sample(text, "llmgw_kv_parity_checks_total", endpoint=rid, outcome="pass") == len(order) + 1 - \
        sample(text, "llmgw_kv_parity_checks_total", endpoint=rid, outcome="unknown")
