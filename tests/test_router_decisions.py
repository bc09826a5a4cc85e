"""The router keeps a bounded ring of recent decisions, each with its whole rationale."""

from __future__ import annotations

import trio

from llmgw.config import parse_config
from llmgw.daemon.router.proxy import Router
from llmgw.route.attempt import Attempt

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
        core = router.core
        router.registry.replicas["m/0"].view.inflight = 5  # busy: the other one should win
        body = b'{"model": "m", "messages": [{"role": "system", "content": "%s"}]}' % (b"be brief. " * 20)
        for i in range(5):
            now = trio.current_time()
            plan = core.plan("chat", body, f"r{i}", strategy=None, session=None, now=now)
            a = core.next(plan, now, 0.0)
            assert isinstance(a, Attempt) and a.replica.id == a.decision.chosen
            core.finish(plan, a, now, None, first_byte_at=now, status=200)
        ring = list(router.decisions)
        assert [d.request_id for d in ring] == ["r2", "r3", "r4"]
        last = ring[-1].to_json()
        assert last["chosen"] == "m/1" and last["strategy"] == "chat" and last["picker"] == "max-score"
        scores = {c["endpoint"]: c["scores"] for c in last["candidates"]}
        assert scores["m/1"]["load"] > scores["m/0"]["load"]
        assert set(last["weights"]) == {"prefix", "kv_cache", "load", "queue", "kv"}  # cache-aware by default
        assert "prefix hit" in last["note"]  # the same prompt each time: m/1 holds it
        assert last["decide_us"] > 0

    trio.run(main)
