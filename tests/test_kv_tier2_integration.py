"""Tier 2 end to end: router + agent + two simulated vLLM replicas with kv_events. Once the first
request's blocks are in the index, the next with the same prefix goes to that replica and the
decision's note names tier 2."""

from __future__ import annotations

import re
from typing import Any

import httpx

from .test_fleet_integration import fleet_factory, sim_model  # noqa: F401 — the fixture
from .test_kv_stream_integration import index_blocks, join_events
from .test_sim_vllm import wait_for


def test_a_shared_prefix_is_routed_by_tier_2_to_its_holder(fleet_factory: Any) -> None:  # noqa: F811
    f = fleet_factory([sim_model(count=2, kv_events=True)])
    f.start_agent("a")
    wait_for(lambda: len(f.ready("m")) == 2, 30)
    join_events(f, {r["replica"]: r["url"] for r in f.ready("m")})  # both engines' events flow
    seen = index_blocks(f)
    body = {"model": "m", "messages": [{"role": "user", "content": "a long shared system prompt " * 40}],
            "max_tokens": 2}
    r = httpx.post(f"{f.router.url}/v1/chat/completions", json=body, timeout=10, headers={"x-request-id": "first"})
    assert r.status_code == 200, r.text
    holder = f.get("/api/v1/decisions/first")["decisions"][-1]["chosen"]
    wait_for(lambda: index_blocks(f).get(holder, 0) > seen.get(holder, 0), 30)  # its events are in
    r = httpx.post(f"{f.router.url}/v1/chat/completions", json=body, timeout=10,
                   headers={"x-request-id": "tier2-probe"})
    assert r.status_code == 200, r.text
    d = f.get("/api/v1/decisions/tier2-probe")["decisions"][-1]
    assert d["chosen"] == holder
    # every full block the router hashed is one the engine reported: the hashes match exactly
    m = re.search(r"tier 2: (\d+)/(\d+) blocks on (\S+)", d["note"])
    assert m is not None, d["note"]
    assert m.group(1) == m.group(2) and int(m.group(2)) >= 10 and m.group(3) == holder
    text = httpx.get(f"{f.router.url}/metrics", timeout=5).text
    assert 'llmgw_kv_tokenize_total{outcome="cached"}' in text
