"""Tier 2's step as the core runs it, without sockets: RouterCore.next asks for the engine's
release, then the prompt's tokens (a Tokenize each), takes the answers (tokenized), hashes, and
decides; a repeated head asks nothing; a failure leaves a note and tier 1 decides; a release is
remembered (a failure for RETRY_S)."""

from __future__ import annotations

import json
import random

from llmgw.config import parse_config
from llmgw.kv.hashing import HashContext, event_hash
from llmgw.route.attempt import Attempt
from llmgw.route.cache_stats import CacheStats
from llmgw.route.dispatch import RouterCore
from llmgw.route.engine_releases import RETRY_S, TTL_S
from llmgw.route.replicas import ReplicaTable
from llmgw.route.tier2 import Tokenize

CFG = """
[[models]]
name = "m"
engine = "vllm"
[models.deploy]
kv_events = true
[[models.replicas]]
url = "http://127.0.0.1:1"
[[models.replicas]]
url = "http://127.0.0.1:2"
[[models]]
name = "plain"
engine = "vllm"
[[models.replicas]]
url = "http://127.0.0.1:3"
"""
TOKENS = list(range(100, 140))  # 2 full blocks of 16
VERSION = b'{"version": "0.33.0"}'


def _core() -> RouterCore:
    cfg = parse_config(CFG)
    table = ReplicaTable(cfg)
    return RouterCore(cfg, table, cache_stats=CacheStats(), wall=lambda: 0.0, rng=random.Random(1))


def _body(model: str = "m", text: str = "hello") -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": text}]}).encode()


def _tokens(tokens: list[int]) -> bytes:
    return json.dumps({"count": len(tokens), "tokens": tokens}).encode()


def test_next_asks_for_the_release_then_the_tokens_then_decides_and_a_repeat_asks_nothing() -> None:
    core = _core()
    plan = core.plan("chat", _body(), "r1", strategy=None, session=None, now=0.0)
    assert plan.tier2
    ask = core.next(plan, 0.0, 0.0)
    assert isinstance(ask, Tokenize) and ask.path == "/version" and ask.body is None
    core.tokenized(plan, ask, 0.0, 200, VERSION)
    ask = core.next(plan, 0.0, 0.0)
    assert isinstance(ask, Tokenize) and ask.path == "/tokenize" and ask.url == "http://127.0.0.1:1"
    assert json.loads(ask.body or b"") == {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
    core.tokenized(plan, ask, 0.0, 200, _tokens(TOKENS))
    step = core.next(plan, 0.0, 0.0)
    assert isinstance(step, Attempt) and not plan.tier2
    want = HashContext.create("0.33.0", "sha256_cbor", 16, "0").hash_tokens(TOKENS)
    assert plan.info.kv_hashes == tuple(event_hash(d) for d in want)
    # the same head again: the release and the hashes are known, next decides at once
    again = core.plan("chat", _body(), "r2", strategy=None, session=None, now=1.0)
    assert isinstance(core.next(again, 1.0, 0.0), Attempt)
    assert again.info.kv_hashes == plan.info.kv_hashes
    t = core.tier2_state()
    assert (t.outcomes["ok"], t.outcomes["cached"]) == (1, 1)


def test_a_model_without_kv_events_or_a_strategy_without_kv_cache_has_no_step() -> None:
    core = _core()
    plain = core.plan("chat", _body("plain"), "r1", strategy=None, session=None, now=0.0)
    assert not plain.tier2 and isinstance(core.next(plain, 0.0, 0.0), Attempt)
    batch = core.plan("chat", _body(), "r2", strategy="batch", session=None, now=0.0)
    assert not batch.tier2 and isinstance(core.next(batch, 0.0, 0.0), Attempt)


def test_a_failed_call_leaves_a_note_and_tier_1_decides() -> None:
    core = _core()
    plan = core.plan("chat", _body(), "r1", strategy=None, session=None, now=0.0)
    ask = core.next(plan, 0.0, 0.0)
    core.tokenized(plan, ask, 0.0, 200, VERSION)  # type: ignore[arg-type]
    ask = core.next(plan, 0.0, 0.0)
    core.tokenized(plan, ask, 0.0, None, error="timeout")  # type: ignore[arg-type]
    assert isinstance(core.next(plan, 0.0, 0.0), Attempt)
    assert plan.info.kv_hashes is None and plan.info.kv_note == "tokenize on m/0 timed out after 0.5 s"
    for answer, why in (((500, b""), "tokenize on m/0 answered 500"),
                        ((200, b'{"tokens": [true]}'), "tokenize on m/0 answered garbage"),
                        ((None, b""), "tokenize on m/0 failed (UpstreamConnectError)")):
        p = core.plan("chat", _body(text=why), "r", strategy=None, session=None, now=0.0)
        ask = core.next(p, 0.0, 0.0)
        core.tokenized(p, ask, 0.0, answer[0], answer[1], "UpstreamConnectError")  # type: ignore[arg-type]
        assert isinstance(core.next(p, 0.0, 0.0), Attempt) and p.info.kv_note == why


def test_a_release_is_remembered_and_a_failure_asked_again_after_its_retry_time() -> None:
    core = _core()
    plan = core.plan("chat", _body(), "r1", strategy=None, session=None, now=0.0)
    ask = core.next(plan, 0.0, 0.0)
    core.tokenized(plan, ask, 0.0, 200, b"<html>")  # type: ignore[arg-type]
    assert isinstance(core.next(plan, 0.0, 0.0), Attempt)
    assert plan.info.kv_note == "no vLLM version from m/0 (/version answered garbage)"
    soon = core.plan("chat", _body(), "r2", strategy=None, session=None, now=RETRY_S - 1)
    assert isinstance(core.next(soon, RETRY_S - 1, 0.0), Attempt)  # not asked again yet
    later = core.plan("chat", _body(), "r3", strategy=None, session=None, now=RETRY_S + 1)
    ask = core.next(later, RETRY_S + 1, 0.0)
    assert isinstance(ask, Tokenize) and ask.path == "/version"
    core.tokenized(later, ask, RETRY_S + 1, 200, VERSION)
    assert isinstance(core.next(later, RETRY_S + 1, 0.0), Tokenize)  # now its tokens
    assert core.tier2_state().releases.get("http://127.0.0.1:1", RETRY_S + TTL_S) is not None
