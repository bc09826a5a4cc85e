"""Tier 2's tokenize step over a real socket: a fake engine's /tokenize answers, hangs, fails or
answers garbage; the router hashes what it gets as a kv_events engine does, caches repeated
prompts, and on any failure leaves no hashes and a note that makes tier 1 decide, saying why."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace
from typing import Any

import trio

from llmgw.daemon.net.httpserver import Request, Response, serve_tcp
from llmgw.daemon.net.upstream import UpstreamPool
from llmgw.daemon.router.tokenize import Tokenizer
from llmgw.kv.hashing import HashContext, event_hash
from llmgw.route.kv_scorer import KvCacheScorer
from llmgw.route.scheduler import Scheduler
from llmgw.route.strategies import PRESETS
from llmgw.route.tier2 import Tier2
from llmgw.route.types import EndpointView, RequestInfo

TOKENS = list(range(100, 140))  # 40 tokens: 2 full blocks of 16


class Tier2Run(Tier2):
    """The core's tier 2 step with the shell's tokenizer, as the router runs them: the core asks
    (``step``), the shell makes the call, the core takes the answer, until the step is over."""

    def __init__(self, cfg: Any, pool: UpstreamPool, *, timeout: float) -> None:
        super().__init__(cfg, timeout=timeout)
        self.shell = Tokenizer(pool)

    async def annotate(self, plan: Any) -> None:
        plan.tier2 = True  # as RouterCore.plan sets it when wants(plan)
        while plan.tier2 and (ask := self.step(plan, trio.current_time())) is not None:
            a = await self.shell.ask(ask)
            self.answer(plan, ask, a.status, a.body, a.error, trio.current_time())


class Engine:
    def __init__(self, version: bytes = b'{"version":"0.33.0"}') -> None:
        self.mode = "ok"
        self.calls = 0
        self.version = version
        self.version_calls = 0
        self.tokens = TOKENS
        self.bodies: list[dict[str, Any]] = []

    async def handle(self, req: Request) -> Response:
        if req.path == "/version":
            self.version_calls += 1
            if self.version == b"hang":
                await trio.sleep_forever()
            return Response(200, [("content-type", "application/json")], self.version)
        self.calls += 1
        self.bodies.append(json.loads(req.body))
        if self.mode == "hang":
            await trio.sleep_forever()
        if self.mode == "error":
            return Response(500, [("content-type", "application/json")], b'{"error": "boom"}')
        if self.mode == "garbage":
            return Response(200, [("content-type", "application/json")], b'{"tokens": ["x", -1]}')
        return Response(200, [("content-type", "application/json")],
                        json.dumps({"count": len(self.tokens), "tokens": self.tokens}).encode())


def _plan(port: int, content: str, salt: str | None = None, adapter: str | None = None) -> Any:
    rep = SimpleNamespace(id="m/0", view=SimpleNamespace(available=True, url=f"http://127.0.0.1:{port}"),
                          last_scrape=SimpleNamespace(block_size=16))
    return SimpleNamespace(entry=SimpleNamespace(name="m", replicas=[rep]), strategy=PRESETS["chat"],
                           info=RequestInfo("r", adapter or "m", "m", adapter=adapter, cache_salt=salt),
                           body={"model": adapter or "m", "messages": [{"role": "user", "content": content}],
                                 "max_tokens": 3})


def _cfg() -> Any:
    return SimpleNamespace(models=[SimpleNamespace(name="m", deploy=SimpleNamespace(kv_events=True, env=()),
                                                   adapters=[SimpleNamespace(name="sql-lora", source="/adapters/sql-lora")]),
                                   SimpleNamespace(name="plain", deploy=None)])


def test_tokenize_hash_cache_and_every_failure_falls_back_to_tier_1() -> None:
    async def main() -> None:
        engine = Engine()
        async with trio.open_nursery() as nursery, UpstreamPool() as pool:
            port = await nursery.start(serve_tcp, engine.handle, "127.0.0.1", 0)
            t = Tier2Run(_cfg(), pool, timeout=0.3)
            assert not t.wants(SimpleNamespace(entry=SimpleNamespace(name="plain"), strategy=PRESETS["chat"]))
            # a strategy that does not weigh tier 2 does not pay for its hashes
            assert not t.wants(SimpleNamespace(entry=SimpleNamespace(name="m"), strategy=PRESETS["batch"]))

            p = _plan(port, "hello")
            assert t.wants(p)
            await t.annotate(p)
            want = HashContext.create("0.33.0", "sha256_cbor", 16, "0").hash_tokens(TOKENS)
            assert p.info.kv_hashes == tuple(event_hash(d) for d in want) and len(want) == 2
            assert engine.bodies[0] == {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
            again = _plan(port, "hello")
            await t.annotate(again)  # the same prompt: from the cache, no second round trip
            assert again.info.kv_hashes == p.info.kv_hashes and engine.calls == 1
            salted = _plan(port, "hello", salt="tenant-a")  # a salt changes every hash
            await t.annotate(salted)
            assert engine.calls == 2 and salted.info.kv_hashes is not None
            assert not set(salted.info.kv_hashes) & set(p.info.kv_hashes)
            assert len(t.cache) == 2 and t.cached_hashes == 4

            notes = {}
            for mode in ("hang", "error", "garbage"):
                engine.mode = mode
                q = _plan(port, f"prompt for {mode}")
                with trio.fail_after(5):
                    await t.annotate(q)
                assert q.info.kv_hashes is None
                notes[mode] = q.info.kv_note
            assert notes == {"hang": "tokenize on m/0 timed out after 0.3 s",
                             "error": "tokenize on m/0 answered 500",
                             "garbage": "tokenize on m/0 answered garbage"}
            assert {k: t.outcomes[k] for k in ("ok", "cached", "timeout", "error", "garbage")} == \
                {"ok": 2, "cached": 1, "timeout": 1, "error": 1, "garbage": 1}

            # the decision's note says tier 1 decided, and why
            eps = [EndpointView(id=f"m/{i}", model="m", url="", running=0.0, waiting=0.0, stale=False)
                   for i in range(2)]
            sched = Scheduler(scorers={"kv_cache": KvCacheScorer(lambda h: {"m/1": 2})})
            d = sched.decide(q.info, eps, PRESETS["chat"], now=0.0, wall=0.0, rng=random.Random(1))
            assert "tier 2 unavailable: tokenize on m/0 answered garbage; tier 1 decides" in d.note
            nursery.cancel_scope.cancel()

    trio.run(main)
