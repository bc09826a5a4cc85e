"""Tier 2 over real processes: a router, an agent and a simulated vLLM with kv_events on. The
engine's KV events travel agent → router and fill the router's index for that replica."""

from __future__ import annotations

import re
from typing import Any

import httpx

from .test_fleet_integration import fleet_factory, sim_model  # noqa: F401 — the fixture
from .test_sim_vllm import wait_for


def index_blocks(f: Any) -> dict[str, float]:
    text = httpx.get(f"{f.router.url}/metrics", timeout=5).text
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r'^llmgw_kv_index_blocks\{endpoint="([^"]+)"\} (\S+)$', text, re.MULTILINE)}


def test_engine_kv_events_reach_the_router_index(fleet_factory: Any) -> None:  # noqa: F811
    f = fleet_factory([sim_model(count=1, kv_events=True)])
    f.start_agent("a")
    wait_for(lambda: len(f.ready("m")) == 1, 30)
    rid = f.ready("m")[0]["replica"]
    body = {"model": "m", "messages": [{"role": "user", "content": "tell me about caches " * 40}], "max_tokens": 2}

    def filled() -> bool:
        r = httpx.post(f"{f.router.url}/v1/chat/completions", json=body, timeout=10)
        assert r.status_code == 200, r.text
        return index_blocks(f).get(rid, 0.0) > 0

    wait_for(filled, 30)  # the agent's SUB may join after the first events: requests until one lands
    text = httpx.get(f"{f.router.url}/metrics", timeout=5).text
    assert 'llmgw_kv_events_refused_total{reason="other_node"} 0.0' in text
    # the agent stops: its replica leaves routing and its blocks leave the index
    f.agents["a"].stop()
    wait_for(lambda: rid not in index_blocks(f), 30)
