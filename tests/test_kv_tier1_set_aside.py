"""Issue 21 item 18 over real processes: router + agent + two simulated vLLM replicas publishing KV
events. A prompt is served (tier 1 records its replica; the engine's events fill the index); that
engine's cache is cleared (vLLM's reset_prefix_cache). No engine now holds the prompt's first
block, and the cleared engine's events say so: tier 1's belief about it must not count — the
next decision scores it 0 for prefix and its rationale (`ctl explain`) says why.

And the other side of that rule: a burst of one new prompt — the same prompt again straight after
its answer, before its engine's events can have reached the index — follows the first to its
replica instead of being placed by load (tier 1's belief stands while the events are on their way)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import httpx

from .test_fleet_integration import fleet_factory, sim_model  # noqa: F401 — the fixture
from .test_kv_stream_integration import index_blocks
from .test_sim_vllm import wait_for


def test_tier_1s_belief_about_a_cleared_engine_does_not_count(fleet_factory: Any) -> None:  # noqa: F811
    f = fleet_factory([sim_model(count=2, kv_events=True, env=["VLLM_SERVER_DEV_MODE=1"])])
    f.start_agent("a")
    wait_for(lambda: len(f.ready("m")) == 2, 30)
    wait_for(lambda: len(index_blocks(f)) == 2, 30)  # both engines' event streams are in the index
    body = {"model": "m", "messages": [{"role": "user", "content": "a long shared system prompt " * 40}],
            "max_tokens": 2}
    r = httpx.post(f"{f.router.url}/v1/chat/completions", json=body, timeout=10, headers={"x-request-id": "first"})
    assert r.status_code == 200, r.text
    holder = f.get("/api/v1/decisions/first")["decisions"][-1]["chosen"]
    wait_for(lambda: index_blocks(f).get(holder, 0) > 0, 30)  # its engine's events are in
    # and a decision has seen them: tier 1's belief no longer waits on events that may be on their way
    r = httpx.post(f"{f.router.url}/v1/chat/completions", json=body, timeout=10, headers={"x-request-id": "again"})
    assert r.status_code == 200, r.text
    assert f.get("/api/v1/decisions/again")["decisions"][-1]["chosen"] == holder

    url = next(e["url"] for e in f.get("/api/v1/endpoints") if e["id"] == holder)
    cleared = httpx.post(f"{url}/reset_prefix_cache", timeout=10)
    assert cleared.status_code == 200, cleared.text
    wait_for(lambda: index_blocks(f).get(holder) == 0, 30)  # AllBlocksCleared reached the index

    r = httpx.post(f"{f.router.url}/v1/chat/completions", json=body, timeout=10, headers={"x-request-id": "probe"})
    assert r.status_code == 200, r.text
    d = f.get("/api/v1/decisions/probe")["decisions"][-1]
    prefix = {c["endpoint"]: c["scores"].get("prefix", 0.0) for c in d["candidates"]}
    assert prefix[holder] == 0.0, d  # was: tier 1's belief (~1.0) drew the prompt back to the cold replica
    assert f"tier 1 set aside on {holder}: its engine's KV events show no first block" in d["note"], d["note"]
    assert "no candidate holds the first of" in d["note"]

    sock = str(f.tmp / "admin" / "admin.sock")
    out = subprocess.run([sys.executable, "-m", "llmgw", "ctl", "--socket", sock, "explain", "probe", "-o", "json"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert "tier 1 set aside on" in json.dumps(json.loads(out.stdout))


def test_a_burst_of_one_new_prompt_follows_the_first_before_its_events_are_in(fleet_factory: Any) -> None:  # noqa: F811
    # every engine's events reach the index 1.5 s late: the repeats are all decided before them
    f = fleet_factory([sim_model(count=2, kv_events=True, args=["--sim-kv-events-delay-ms", "1500"])])
    f.start_agent("a")
    wait_for(lambda: len(f.ready("m")) == 2, 30)
    wait_for(lambda: len(index_blocks(f)) == 2, 30)  # both engines' event streams are in the index
    for k in range(3):  # three new prompts, each sent four times back to back
        body = {"model": "m", "max_tokens": 2,
                "messages": [{"role": "user", "content": f"burst {k}: " + "a new long system prompt " * 40}]}
        chosen = []
        for i in range(4):
            rid = f"burst-{k}-{i}"
            r = httpx.post(f"{f.router.url}/v1/chat/completions", json=body, timeout=10, headers={"x-request-id": rid})
            assert r.status_code == 200, r.text
            d = f.get(f"/api/v1/decisions/{rid}")["decisions"][-1]
            assert "set aside" not in d["note"], d["note"]
            chosen.append(d["chosen"])
        assert len(set(chosen)) == 1, chosen  # each repeat went where the first did
