"""Hashing only as far as a replica holds, end to end (router + agent + two simulated vLLM
replicas with kv_events): a long prompt nobody holds yet is hashed 16 blocks deep, not whole; once
its engine has stored it, the repeat is hashed further without tokenizing again, every block
hashed once, and tier 2 votes the whole prompt."""

from __future__ import annotations

import re
from typing import Any

import httpx

from .test_fleet_integration import fleet_factory, sim_model  # noqa: F401 — the fixture
from .test_kv_stream_integration import index_blocks
from .test_sim_vllm import wait_for


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert m is not None, name
    return float(m.group(1))


def test_a_long_prompt_is_hashed_lazily_then_whole_once_held(fleet_factory: Any) -> None:  # noqa: F811
    f = fleet_factory([sim_model(count=2, kv_events=True)])
    f.start_agent("a")
    wait_for(lambda: len(f.ready("m")) == 2, 30)
    body = {"model": "m", "messages": [{"role": "user", "content": "a long prompt nobody holds yet " * 150}],
            "max_tokens": 2}
    r = httpx.post(f"{f.router.url}/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 200, r.text
    text = httpx.get(f"{f.router.url}/metrics", timeout=5).text
    assert _metric(text, 'llmgw_kv_hash_blocks_total{how="hashed"}') == 16.0
    skipped = _metric(text, 'llmgw_kv_hash_blocks_total{how="skipped"}')
    assert skipped > 16  # the router handed its index to the tokenize step: most blocks not hashed

    def filled() -> bool:
        r = httpx.post(f"{f.router.url}/v1/chat/completions", json=body, timeout=10)
        assert r.status_code == 200, r.text
        return any(v > 0 for v in index_blocks(f).values())

    wait_for(filled, 30)
    r = httpx.post(f"{f.router.url}/v1/chat/completions", json=body, timeout=10,
                   headers={"x-request-id": "lazy-probe"})
    assert r.status_code == 200, r.text
    d = f.get("/api/v1/decisions/lazy-probe")["decisions"][-1]
    m = re.search(r"tier 2: (\d+)/(\d+) blocks on (\S+)", d["note"])
    assert m is not None, d["note"]
    blocks = int(m.group(2))
    assert blocks == 16 + skipped and m.group(1) == m.group(2)
    # the repeats may have reached both replicas before the first one's events did: then both hold
    # it whole, the note names one, and the pick between them is the load's
    whole = {rid for rid, n in index_blocks(f).items() if n >= blocks}
    assert m.group(3) in whole and d["chosen"] in whole, (m.group(3), d["chosen"], index_blocks(f))
    text = httpx.get(f"{f.router.url}/metrics", timeout=5).text
    assert _metric(text, 'llmgw_kv_tokenize_total{outcome="ok"}') == 1.0  # tokenized once
    assert _metric(text, 'llmgw_kv_hash_blocks_total{how="hashed"}') == blocks  # each block hashed once
