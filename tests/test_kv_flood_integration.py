"""A node's KV event budget over real processes: a raw agent flooding kv_events is dropped
undecoded past its budget (counted), its foreign events are refused undecoded, its session goes on,
and another node's replica — its index and its requests — is unaffected."""

from __future__ import annotations

import re
from typing import Any

import httpx

from .raw_agent import RawAgent
from .test_fleet_integration import TOKEN, fleet_factory, sim_model  # noqa: F401 — the fixture
from .test_kv_stream_integration import index_blocks
from .test_sim_vllm import wait_for


def counter(f: Any, name: str) -> float:
    text = httpx.get(f"{f.router.url}/metrics", timeout=5).text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else -1.0


def test_a_kv_events_flood_is_dropped_past_the_nodes_budget(fleet_factory: Any) -> None:  # noqa: F811
    # a budget a real engine's few events never reach, and a flood does at once
    f = fleet_factory([sim_model(count=1, kv_events=True)],
                      control={"kv_events_per_s": 2000, "kv_events_burst": 5000})
    f.start_agent("a")
    wait_for(lambda: len(f.ready("m")) == 1, 30)
    rid = f.ready("m")[0]["replica"]
    body = {"model": "m", "messages": [{"role": "user", "content": "tell me about floods " * 40}], "max_tokens": 2}
    asked = iter(range(1000))

    def filled() -> bool:
        # a new prompt each attempt: events published before the agent's SUB joined are lost with no
        # later event to show the gap, and a repeated prompt is a cache hit that publishes none
        body["messages"][0]["content"] = f"flood {next(asked)}: " + "tell me about floods " * 40
        r = httpx.post(f"{f.router.url}/v1/chat/completions", json=body, timeout=10)
        assert r.status_code == 200, r.text
        return index_blocks(f).get(rid, 0.0) > 0

    # the flood comes before any request of the real replica, so no real event can be in flight while
    # its index is compared (a request's events reach the index some time after its answer)
    assert index_blocks(f).get(rid, 0.0) == 0.0
    flood = RawAgent(f.control_port, node="x", token=TOKEN, features=["kv_events"])
    try:
        assert flood.answer["t"] == "welcome"
        blocks = [[None, i] for i in range(1000)]
        for i in range(300):  # 300,300 block events against a burst of 5,000
            flood.send("kv_events", replica=rid, event_seq=i + 1, reset=False, added=blocks, removed=[])
        wait_for(lambda: counter(f, "llmgw_kv_events_dropped_total")
                 + counter(f, 'llmgw_kv_events_refused_total{reason="other_node"}') >= 300, 30)
        dropped = counter(f, "llmgw_kv_events_dropped_total")
        refused = counter(f, 'llmgw_kv_events_refused_total{reason="other_node"}')
        assert dropped + refused == 300 and dropped >= 250, (dropped, refused)  # ~5 from the burst + 2/s
        assert counter(f, "llmgw_kv_events_dropped_blocks_total") == dropped * 1000
        assert not flood.closed.is_set()  # dropped, not disconnected: the session goes on
        wait_for(lambda: "over its event budget" in f.log(f.router), 5)
    finally:
        flood.close()
    # the other node's replica: its index untouched by the flood, and still following its own engine
    assert index_blocks(f).get(rid, 0.0) == 0.0
    wait_for(filled, 30)
    for _ in range(3):
        r = httpx.post(f"{f.router.url}/v1/chat/completions", json=body, timeout=10)
        assert r.status_code == 200, r.text
    assert counter(f, "llmgw_kv_index_gaps_total") == 0
