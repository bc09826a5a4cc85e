"""Tier 2's tokenize step follows each engine's vLLM release (GET /version once per replica) and
hashes LoRA requests with that release's adapter key; a release it cannot hash for, a /version
that fails, and an adapter it cannot know the key of each fall back to tier 1 with a reason. A
conversation's next turn is tokenized again but hashes only its new blocks."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from llmgw.daemon.net.httpserver import serve_tcp
from llmgw.daemon.net.upstream import UpstreamPool
from llmgw.kv.hashing import HashContext, LoRA, event_hash

from .test_kv_tokenize import TOKENS, Engine, Tier2Run, _cfg, _plan

LORA = LoRA("sql-lora", None, "/adapters/sql-lora")


def _want(version: str, tokens: list[int], lora: LoRA | None = None, salt: str | None = None) -> tuple[int, ...]:
    ctx = HashContext.create(version, "sha256_cbor", 16, "0")
    return tuple(event_hash(d) for d in ctx.hash_tokens(tokens, lora, salt))  # type: ignore[misc]


async def _annotate(engine: Engine, plans: list[Any]) -> Tier2Run:
    async with trio.open_nursery() as nursery, UpstreamPool() as pool:
        port = await nursery.start(serve_tcp, engine.handle, "127.0.0.1", 0)
        t = Tier2Run(_cfg(), pool, timeout=0.3)
        for make in plans:
            p = make(port)
            with trio.fail_after(5):
                await t.annotate(p)
            make.done = p  # type: ignore[attr-defined]
        nursery.cancel_scope.cancel()
    return t


def _run(engine: Engine, *plans: Any) -> tuple[Tier2Run, list[Any]]:
    makers = [lambda port, a=a: _plan(port, *a[0], **a[1]) for a in plans]
    t = trio.run(_annotate, engine, makers)
    return t, [m.done for m in makers]  # type: ignore[attr-defined]


@pytest.mark.parametrize("version", ["0.23.0", "0.33.0", "0.33.2+cu128"])
def test_hashes_follow_the_engines_release_and_version_is_asked_once(version: str) -> None:
    engine = Engine(b'{"version":"%s"}' % version.encode())
    _, (a, b) = _run(engine, (("x",), {"salt": "tenant-a"}), (("y",), {"salt": "tenant-a"}))
    # the salt's key changed shape at 0.31: the chain is that release's
    want = _want(version.split("+")[0], TOKENS, salt="tenant-a")
    assert a.info.kv_hashes == want and b.info.kv_hashes == want
    assert engine.version_calls == 1


@pytest.mark.parametrize("answer,why", [
    (b'{"version":"0.10.1"}', "vLLM 0.10.1 hashes blocks as ints (tier 2 needs 0.10.2 or later)"),
    (b'{"version":"0.34.0"}', "vLLM 0.34.0 is newer than the hashing this llmgw knows (up to 0.33)"),
    (b'{"version":7}', "no vLLM version from m/0 (/version answered garbage)"),
    (b'<html>', "no vLLM version from m/0 (/version answered garbage)"),
    (b"hang", "no vLLM version from m/0 (/version timed out after 0.3 s)"),
])
def test_an_unknown_or_unsupported_release_falls_back_to_tier_1(answer: bytes, why: str) -> None:
    engine = Engine(answer)
    t, (p,) = _run(engine, (("x",), {}))
    assert p.info.kv_hashes is None and p.info.kv_note == why
    assert t.outcomes["version"] == 1 and engine.calls == 0  # never tokenized for nothing


@pytest.mark.parametrize("version,lora", [("0.23.0", LoRA("sql-lora")), ("0.33.0", LORA)])
def test_a_lora_request_is_hashed_with_its_releases_adapter_key(version: str, lora: LoRA) -> None:
    engine = Engine(b'{"version":"%s"}' % version.encode())
    t, (p, base) = _run(engine, (("x",), {"adapter": "sql-lora"}), (("x",), {}))
    assert p.info.kv_hashes == _want(version, TOKENS, lora)
    assert base.info.kv_hashes == _want(version, TOKENS) != p.info.kv_hashes  # not the base model's cache
    assert engine.bodies[0]["model"] == "m"  # tokenized as the base model: the adapter shares its template
    assert t.outcomes["ok"] == 2


@pytest.mark.parametrize("version,adapter,why", [
    ("0.11.0", "sql-lora", "vLLM 0.11.0 hashes an adapter by the id the engine assigned it"),
    ("0.33.0", "other", "adapter other is not in the model's [[models.adapters]]: its LoRA path is unknown"),
])
def test_an_adapter_whose_key_the_router_cannot_know_falls_back(version: str, adapter: str, why: str) -> None:
    engine = Engine(b'{"version":"%s"}' % version.encode())
    t, (p,) = _run(engine, (("x",), {"adapter": adapter}))
    assert p.info.kv_hashes is None and p.info.kv_note == why and t.outcomes["unsupported"] == 1


def test_the_next_turn_is_tokenized_again_and_hashes_only_its_new_blocks() -> None:
    engine = Engine()
    first = list(range(1000, 1000 + 16 * 40 + 5))
    nxt = first + list(range(5000, 5000 + 16 * 3))

    async def main() -> None:
        async with trio.open_nursery() as nursery, UpstreamPool() as pool:
            port = await nursery.start(serve_tcp, engine.handle, "127.0.0.1", 0)
            t = Tier2Run(_cfg(), pool, timeout=0.3)
            engine.tokens = first
            p = _plan(port, "turn 1")
            await t.annotate(p)
            assert p.info.kv_hashes == _want("0.33.0", first) and t.chains.hashed_blocks == 40
            engine.tokens = nxt
            q = _plan(port, "turn 1 + answer + turn 2")
            await t.annotate(q)
            assert engine.calls == 2  # a new head is always tokenized by the engine
            assert q.info.kv_hashes == _want("0.33.0", nxt) and len(q.info.kv_hashes) == 43
            assert (t.chains.reused_blocks, t.chains.hashed_blocks) == (40, 43)  # 40 reused, 3 new
            engine.tokens = [7] + nxt[1:]  # the template rendered the first token otherwise: nothing reused
            r = _plan(port, "another conversation")
            await t.annotate(r)
            assert r.info.kv_hashes == _want("0.33.0", engine.tokens) and t.chains.reused_blocks == 40
            nursery.cancel_scope.cancel()

    trio.run(main)


@pytest.mark.parametrize("tokens", [[True] + TOKENS, TOKENS + [False], TOKENS + [1.0], TOKENS + [-1],
                                    TOKENS + [1 << 32], TOKENS + ["7"], TOKENS + [[1]], TOKENS + [None]])
def test_a_token_list_with_anything_but_token_ids_is_garbage(tokens: list[Any]) -> None:
    engine = Engine()
    engine.tokens = tokens
    t, (p,) = _run(engine, (("x",), {}))
    assert p.info.kv_hashes is None and p.info.kv_note == "tokenize on m/0 answered garbage"
    assert t.outcomes["garbage"] == 1


def test_token_ids_0_and_1_are_ids() -> None:
    engine = Engine()
    engine.tokens = [0, 1] * 16
    _, (p,) = _run(engine, (("x",), {}))
    assert p.info.kv_hashes == _want("0.33.0", [0, 1] * 16)
