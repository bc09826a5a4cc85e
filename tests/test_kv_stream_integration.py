"""Tier 2 over real processes: a router, an agent and a simulated vLLM with kv_events on. The
engine's KV events travel agent → router and fill the router's index for that replica."""

from __future__ import annotations

import math
import re
import time
from typing import Any

import httpx

from .raw_agent import RawAgent
from .test_fleet_integration import TOKEN, fleet_factory, sim_model  # noqa: F401 — the fixture
from .test_sim_vllm import wait_for


def index_blocks(f: Any) -> dict[str, float]:
    text = httpx.get(f"{f.router.url}/metrics", timeout=5).text
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r'^llmgw_kv_index_blocks\{endpoint="([^"]+)"\} (\S+)$', text, re.MULTILINE)}


def join_events(f: Any, urls: dict[str, str], words: int = 20) -> None:
    """Until each engine's KV events reach the router's index (ZMQ's slow joiner: the agent's SUB may
    join after an engine's first events, and nothing shows the gap until a later one): a new prompt a
    second, sent to the engine directly (`urls`: replica id -> its URL), until the index holds blocks
    of that replica. A repeated prompt would be a cache hit that publishes no event. Each probe adds
    ~`words` tokens of blocks to that engine (not through the router: tier 1 does not see them)."""
    asked = iter(range(1_000_000))
    for rid, url in urls.items():
        last = -math.inf

        def probed() -> bool:
            nonlocal last
            if time.monotonic() - last > 1.0:
                last = time.monotonic()
                text = " ".join(f"probe{next(asked)}-{i}" for i in range(words))
                r = httpx.post(f"{url}/v1/chat/completions", timeout=10, json={
                    "model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 1})
                assert r.status_code == 200, r.text
            return index_blocks(f).get(rid, 0) > 0  # noqa: B023 — called before the loop moves on

        wait_for(probed, 30)


def test_engine_kv_events_reach_the_router_index(fleet_factory: Any) -> None:  # noqa: F811
    f = fleet_factory([sim_model(count=1, kv_events=True)])
    f.start_agent("a")
    wait_for(lambda: len(f.ready("m")) == 1, 30)
    rid = f.ready("m")[0]["replica"]
    sent = []

    def filled() -> bool:
        # A new prompt each time: a repeated one is a cache hit that publishes no event, so events
        # lost before the agent's SUB joined (ZMQ's slow joiner) would never be followed by one
        # that shows the gap and brings the replay.
        sent.append(1)
        body = {"model": "m", "max_tokens": 2,
                "messages": [{"role": "user", "content": f"{len(sent)} tell me about caches " * 40}]}
        r = httpx.post(f"{f.router.url}/v1/chat/completions", json=body, timeout=10)
        assert r.status_code == 200, r.text
        return index_blocks(f).get(rid, 0.0) > 0

    # Other agents' writes come before any request of this replica, so no event of its own engine can be
    # in flight while its index is compared (a request's events reach the index some time after its
    # answer); written, any of them would show as blocks.
    # another node's agent cannot write this replica: refused, counted, its session goes on
    other = RawAgent(f.control_port, node="x", token=TOKEN, features=["kv_events"])
    try:
        assert other.answer["t"] == "welcome" and "kv_events" in other.answer["features"]
        other.send("kv_events", replica=rid, event_seq=1, reset=True, added=[[None, 1], [None, 2]], removed=[])
        other.send("kv_events", replica="m/nope", event_seq=1, reset=False, added=[[None, 3]], removed=[])
        wait_for(lambda: 'llmgw_kv_events_refused_total{reason="unknown_replica"} 1.0'
                 in httpx.get(f"{f.router.url}/metrics", timeout=5).text, 10)
        text = httpx.get(f"{f.router.url}/metrics", timeout=5).text
        assert 'llmgw_kv_events_refused_total{reason="other_node"} 1.0' in text
        assert index_blocks(f).get(rid, 0.0) == 0.0 and not other.closed.is_set()
    finally:
        other.close()
    # an agent that did not list the feature may not send them: its connection is closed
    old = RawAgent(f.control_port, node="y", token=TOKEN, features=["credential"])
    try:
        assert old.answer["t"] == "welcome"
        old.send("kv_events", replica=rid, event_seq=1, reset=False, added=[[None, 4]], removed=[])
        assert old.closed.wait(10)
        assert index_blocks(f).get(rid, 0.0) == 0.0
    finally:
        old.close()

    wait_for(filled, 30)  # the agent's SUB may join after the first events: requests until one lands
    text = httpx.get(f"{f.router.url}/metrics", timeout=5).text
    assert 'llmgw_kv_events_refused_total{reason="other_node"} 1.0' in text  # its own agent's are taken

    # the agent stops: its replica leaves routing and its blocks leave the index
    f.agents["a"].stop()
    wait_for(lambda: rid not in index_blocks(f), 30)
