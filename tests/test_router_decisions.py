"""The router keeps a bounded ring of recent decisions, each with its whole rationale."""

from __future__ import annotations

import trio

from llmgw.config import parse_config
from llmgw.daemon.router.proxy import Router
from llmgw.route.types import RequestInfo

CFG = """
[router]
decisions_kept = 3
[[models]]
name = "m"
engine = "vllm"
[[models.replicas]]
url = "http://127.0.0.1:1"
[[models.replicas]]
url = "http://127.0.0.1:2"
"""


def test_decision_ring_is_bounded_and_explains_each_pick() -> None:
    async def main() -> None:
        router = Router(parse_config(CFG), pool=None, seed=1)  # type: ignore[arg-type]
        entry = router.registry.models["m"]
        router.registry.replicas["m/0"].view.inflight = 5  # busy: the other one should win
        for i in range(5):
            info = RequestInfo(request_id=f"r{i}", model="m", base_model="m")
            rep, d = router._decide(entry, info, router._strategy(entry, None), set())
            assert rep is not None and rep.id == d.chosen
        ring = list(router.decisions)
        assert [d.request_id for d in ring] == ["r2", "r3", "r4"]
        last = ring[-1].to_json()
        assert last["chosen"] == "m/1" and last["strategy"] == "chat" and last["picker"] == "max-score"
        scores = {c["endpoint"]: c["scores"] for c in last["candidates"]}
        assert scores["m/1"]["inflight"] > scores["m/0"]["inflight"]
        assert set(last["weights"]) == {"load", "queue", "kv", "inflight", "session"}
        assert last["decide_us"] > 0

    trio.run(main)
