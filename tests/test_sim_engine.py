"""The simulator's pure core: prefix cache, eviction, events, batching, queueing, cancellation."""

from __future__ import annotations

from typing import Any

import pytest

from llmgw.kv.hashing import HashContext
from llmgw.sim.blockpool import BlockPool, Cleared, Removed, Stored
from llmgw.sim.engine import EngineConfig, EngineCore, SimRequest
from llmgw.sim.textstream import TextStream
from llmgw.sim.tokenizer import Tokenizer

CTX = HashContext.create("0.33.0", "sha256_cbor", 16, "0")


def make_req(rid: str, prompt: list[int], max_tokens: int = 4, **kw: Any) -> SimRequest:
    bh = CTX.hasher(None, kw.pop("cache_salt", None))

    def hasher(tokens: Any, hashes: list[bytes], n_blocks: int) -> None:
        if bh.num_tokens < n_blocks * 16:
            bh.extend(tokens[bh.num_tokens:n_blocks * 16])

    r = SimRequest(req_id=rid, prompt=prompt, max_tokens=max_tokens, arrival=0.0, ignore_eos=True,
                   hasher=hasher, **kw)
    r.hashes = bh.block_hashes
    return r


def run_to_end(core: EngineCore, now: float = 0.0, max_steps: int = 10_000) -> float:
    for _ in range(max_steps):
        plan = core.schedule(now)
        if plan is None:
            return now
        now += plan.duration
        core.complete(plan, now)
    raise AssertionError("engine did not drain")


def core(**kw: Any) -> EngineCore:
    return EngineCore(EngineConfig(**kw), Tokenizer())


def test_shared_prefix_hits_and_counters_match_vllm() -> None:
    c = core(num_blocks=64)
    prompt = list(range(1, 49))  # 3 full blocks
    c.add_request(make_req("a", prompt), 0)
    run_to_end(c)
    assert (c.prefix_queries, c.prefix_hits) == (48, 0)
    # Same 48-token prompt: vLLM caps a hit at num_tokens - 1, so only 2 blocks (32 tokens) hit.
    c.add_request(make_req("b", prompt), 0)
    run_to_end(c)
    assert (c.prefix_queries, c.prefix_hits) == (96, 32)
    # A longer prompt sharing the first 48 tokens hits all 3 blocks.
    c.add_request(make_req("c", prompt + [7] * 20), 0)
    run_to_end(c)
    assert c.prefix_hits == 32 + 48


def test_hash_chain_of_events_is_vllms() -> None:
    c = core(num_blocks=64)
    c.add_request(make_req("a", list(range(1, 49)), max_tokens=1), 0)
    run_to_end(c)
    stored = [e for e in c.take_kv_events() if isinstance(e, Stored)]
    assert stored[0].hashes[0].hex().startswith("202da172")  # golden block 0 of range(1, 49)
    assert [h.hex()[:8] for h in stored[0].hashes] == ["202da172", "4a0a3938", "7db7c865"]
    assert stored[0].parent is None and stored[0].token_ids == tuple(range(1, 49))


def test_lru_eviction_order_and_every_event_published() -> None:
    # 4 usable blocks (one is the null block). Fill them with two 2-block prompts, then a third.
    c = core(num_blocks=5, max_model_len=64)
    a, b = list(range(100, 132)), list(range(200, 232))
    for rid, p in (("a", a), ("b", b)):
        c.add_request(make_req(rid, p, max_tokens=1), 0)
        run_to_end(c)
    events = c.take_kv_events()
    stored_hashes = [h for e in events if isinstance(e, Stored) for h in e.hashes]
    assert len(stored_hashes) == 4
    # A third request needs 3 blocks: the least recently freed go first, tail block first.
    c.add_request(make_req("c", list(range(300, 340)), max_tokens=1), 0)
    run_to_end(c)
    events = c.take_kv_events()
    removed = [e.block_hash for e in events if isinstance(e, Removed)]
    a_hashes, b_hashes = stored_hashes[:2], stored_hashes[2:]
    assert removed[:2] == [a_hashes[1], a_hashes[0]]  # all of a (freed first), its tail first
    assert removed[2] == b_hashes[1]  # then b's tail; b's prefix block survives
    assert c.pool.contains(b_hashes[0])


def test_queueing_beyond_max_num_seqs_and_fifo() -> None:
    c = core(max_num_seqs=2, num_blocks=64)
    for i in range(5):
        c.add_request(make_req(f"r{i}", [i + 1] * 10, max_tokens=3), 0)
    plan = c.schedule(0)
    assert plan is not None and c.num_running == 2 and c.num_waiting == 3
    assert [s.req.req_id for s in plan.scheduled] == ["r0", "r1"]
    run_to_end(c)
    assert c.num_running == 0 and c.num_waiting == 0


def test_abort_frees_blocks_and_slot_at_once() -> None:
    c = core(max_num_seqs=1, num_blocks=64)
    c.add_request(make_req("a", [1] * 40, max_tokens=100), 0)
    c.add_request(make_req("b", [2] * 40, max_tokens=1), 0)
    plan = c.schedule(0)
    assert plan and c.num_running == 1 and c.kv_usage() > 0
    assert c.abort("a", 0)
    assert c.num_running == 0 and c.kv_usage() == 0
    c.complete(plan, 0)  # the in-flight step's output for "a" is dropped
    plan2 = c.schedule(0)
    assert plan2 and [s.req.req_id for s in plan2.scheduled] == ["b"]


def test_time_model_prefill_cost_only_for_uncached_tokens() -> None:
    c = core(num_blocks=64, prefill_s_per_token=0.001, decode_s_per_step=0.01)
    prompt = list(range(1, 65))
    c.add_request(make_req("a", prompt, max_tokens=1), 0)
    p1 = c.schedule(0)
    assert p1 and p1.prefill_tokens == 64 and p1.duration == pytest.approx(0.064)
    c.complete(p1, 0.064)
    c.add_request(make_req("b", prompt, max_tokens=2), 0)
    p2 = c.schedule(1)
    assert p2 and p2.prefill_tokens == 64 - 48  # 3 of 4 blocks hit (the last token is recomputed)
    c.complete(p2, 1)
    p3 = c.schedule(2)
    assert p3 and p3.decode_seqs == 1 and p3.prefill_tokens == 0 and p3.duration == pytest.approx(0.01)


def test_chunked_prefill_respects_token_budget() -> None:
    c = core(num_blocks=256, max_num_batched_tokens=100, max_model_len=1024)
    c.add_request(make_req("a", [5] * 250, max_tokens=1), 0)
    chunks = []
    for _ in range(3):
        plan = c.schedule(0)
        assert plan
        chunks.append(plan.prefill_tokens)
        outs = c.complete(plan, 0)
    assert chunks == [100, 100, 50] and outs and outs[0].finished


def test_preemption_when_blocks_run_out() -> None:
    # 6 usable blocks; two requests each growing past 3 blocks must preempt one.
    c = core(num_blocks=7, max_model_len=112)
    c.add_request(make_req("a", [1] * 40, max_tokens=40), 0)
    c.add_request(make_req("b", [2] * 40, max_tokens=40), 0)
    run_to_end(c)
    assert c.num_preemptions >= 1
    assert c.num_running == 0 and c.kv_usage() == 0


def test_stop_string_cut_and_reported() -> None:
    c = core(num_blocks=64)
    r = make_req("a", [1] * 8, max_tokens=50)
    r.ignore_eos = False
    r.text = TextStream(("o",))
    c.add_request(r, 0)
    outs = []
    while (plan := c.schedule(0)) is not None:
        outs += c.complete(plan, 0)
    text = "".join(o.text for o in outs)
    assert r.finish_reason == "stop"
    if r.stop_reason == "o":
        assert "o" not in text


def test_max_loras_defers_a_third_adapter() -> None:
    from llmgw.sim.engine import LoraRef

    c = core(num_blocks=64, max_loras=1)
    c.add_request(make_req("a", [1] * 8, max_tokens=5, lora=LoraRef("x", 1, "/x")), 0)
    c.add_request(make_req("b", [1] * 8, max_tokens=5, lora=LoraRef("y", 2, "/y")), 0)
    c.add_request(make_req("c", [1] * 8, max_tokens=5), 0)
    plan = c.schedule(0)
    assert plan and sorted(s.req.req_id for s in plan.scheduled) == ["a", "c"]
    assert c.deferred_lora == 1 and c.waiting_loras() == {"y"}


def test_block_pool_reset_only_when_idle() -> None:
    pool = BlockPool(4, 16)
    from llmgw.sim.blockpool import ReqBlocks

    rb = ReqBlocks(pool.allocate(1) or [])
    assert not pool.reset()
    pool.free(rb)
    assert pool.reset() and isinstance(pool.take_events()[-1], Cleared)
