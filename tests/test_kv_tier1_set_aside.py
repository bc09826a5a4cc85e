"""Issue 21 item 18 over real processes: router + agent + two simulated vLLM replicas publishing KV
events. A prompt is served (tier 1 records its replica; the engine's events fill the index); that
engine's cache is cleared (vLLM's reset_prefix_cache). No engine now holds the prompt's first
block, and the cleared engine's events say so: tier 1's belief about it must not count — the
next decision scores it 0 for prefix and its rationale (`ctl explain`) says why."""

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
