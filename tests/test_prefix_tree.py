"""The prefix index: an approximate radix tree of what each replica's prefix cache holds."""

from __future__ import annotations

import gc
import os
import random
import tracemalloc

import pytest
from hypothesis import given, settings, strategies as st

from llmgw.route.prefix_capacity import Capacity, PrefixConfig, partition_key
from llmgw.route.prefix_tree import HOLDER_COST, NODE_COST, REPLICA_COST, PrefixIndex
from llmgw.route.request_head import request_head

P = partition_key("m")
BIG = Capacity(bytes=1 << 40)


def index(**kw) -> PrefixIndex:
    kw.setdefault("default_capacity", BIG)
    kw.setdefault("budget_bytes", 1 << 40)
    return PrefixIndex(PrefixConfig(**kw))


def lcp(a: bytes, b: bytes) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


SYS = b"system\0You are a helpful assistant. Answer briefly and cite sources." * 4


# --------------------------------------------------------------------------- partial labels

def test_a_partial_label_match_counts():
    """The first request's whole head is one label; the second, same system prompt, diverges
    inside it. The shared bytes count (a whole-label rule would see 0)."""
    t = index()
    a = SYS + b"\x1euser\0What is the capital of France?"
    b = SYS + b"\x1euser\0How tall is Mont Blanc?"
    t.record(P, a, "r1", 0.0)
    assert t.stats()["nodes"] == 1  # one label holding all of a
    m = t.match(P, b, 1.0)
    shared = lcp(a, b)
    assert shared == len(SYS) + len(b"\x1euser\0")
    assert m.matched_bytes == shared and m.head_bytes == len(b)
    assert m.holders == {"r1": (shared, 1)}
    t.check()


def test_insert_splits_at_the_divergence_and_both_keep_their_holders():
    t = index()
    a = SYS + b"\x1euser\0alpha"
    b = SYS + b"\x1euser\0beta"
    t.record(P, a, "r1", 0.0)
    t.record(P, b, "r2", 0.0)
    t.check()
    assert t.stats()["nodes"] == 3 and t.stats()["splits"] == 1
    shared = lcp(a, b)
    assert t.match(P, a, 0.0).holders == {"r1": (len(a), 1), "r2": (shared, 1)}
    assert t.match(P, b, 0.0).holders == {"r2": (len(b), 1), "r1": (shared, 1)}
    # a third head sharing only part of the shared label splits it again
    c = SYS[:50] + b"zzz"
    t.record(P, c, "r3", 0.0)
    t.check()
    assert t.match(P, a, 0.0).holders == {"r1": (len(a), 1), "r2": (shared, 1), "r3": (50, 1)}


def test_a_head_that_is_a_prefix_of_a_label_splits_at_its_end():
    t = index()
    t.record(P, SYS + b"tail", "r1", 0.0)
    t.record(P, SYS, "r2", 0.0)
    t.check()
    assert t.match(P, SYS, 0.0).holders == {"r1": (len(SYS), 1), "r2": (len(SYS), 1)}
    assert t.match(P, SYS + b"tail", 0.0).holders == {"r1": (len(SYS) + 4, 1),
                                                      "r2": (len(SYS), 1)}


def test_match_is_read_only():
    t = index()
    t.record(P, SYS + b"x", "r1", 0.0)
    before = (t.stats(), [(n.label, dict(n.holders)) for _, n in t.iter_nodes()])
    for _ in range(5):
        t.match(P, SYS + b"y", 1.0)
    after = (t.stats(), [(n.label, dict(n.holders)) for _, n in t.iter_nodes()])
    assert before[1] == after[1]
    assert {k: v for k, v in before[0].items() if k != "lookups"} == \
        {k: v for k, v in after[0].items() if k != "lookups"}


def test_partitions_never_share():
    t = index()
    t.record(partition_key("m"), SYS, "r1", 0.0)
    for other in (partition_key("m", "lora-a"), partition_key("m", None, "salt"),
                  partition_key("m2")):
        assert t.match(other, SYS, 0.0).holders == {}
    assert t.match(partition_key("m"), SYS, 0.0).holders == {"r1": (len(SYS), 1)}


def test_empty_head_and_long_head_cut():
    t = index(max_head_bytes=100)
    t.record(P, b"", "r1", 0.0)
    assert t.stats()["nodes"] == 0
    long = os.urandom(500)
    t.record(P, long, "r1", 0.0)
    assert t.stats()["label_bytes"] == 100
    m = t.match(P, long, 0.0)
    assert m.head_bytes == 100 and m.holders == {"r1": (100, 1)}


# --------------------------------------------------------------------------- counts

def test_the_node_prefers_the_replica_seen_most_often_not_the_latest():
    t = index()
    for _ in range(10):
        t.record(P, SYS + b"q", "often", 0.0)
    t.record(P, SYS + b"q", "latest", 1.0)
    m = t.match(P, SYS + b"q", 2.0)
    assert m.holders["often"] == (len(SYS) + 1, 10)
    assert m.holders["latest"] == (len(SYS) + 1, 1)
    assert m.best() == "often"


def test_counts_are_bounded_by_halving_and_keep_their_order():
    t = index(max_count=8)
    for _ in range(100):
        t.record(P, SYS, "a", 0.0)
    for _ in range(3):
        t.record(P, SYS, "b", 0.0)
    h = t.match(P, SYS, 0.0).holders
    assert h["a"][1] < 8 and h["b"][1] >= 1
    assert h["a"][1] > h["b"][1]


def test_record_with_a_count_boost():
    t = index()
    t.record(P, SYS, "a", 0.0, count=7)
    assert t.match(P, SYS, 0.0).holders["a"] == (len(SYS), 7)


# --------------------------------------------------------------------------- capacity models

def test_vllm_capacity_from_cache_config_info():
    cap = Capacity.vllm(num_gpu_blocks=4, block_size=16)  # 64 tokens ≈ 256 bytes
    assert cap.bytes == 256
    assert Capacity.vllm(1000, 16, fraction=0.5).bytes == 32000
    assert Capacity.tokens(100).bytes == 400
    with pytest.raises(ValueError):
        Capacity()
    with pytest.raises(ValueError):
        Capacity(bytes=1, slots=1)
    with pytest.raises(ValueError):
        Capacity(bytes=10, ram_bytes=5)


def test_a_vllm_replica_sent_more_than_it_holds_just_overwrites():
    t = index()
    t.set_capacity("r", Capacity.vllm(num_gpu_blocks=4, block_size=16))  # 256 B
    heads = [bytes([65 + i]) * 200 for i in range(3)]
    for h in heads:
        t.record(P, h, "r", 0.0)
    t.check()
    assert t.match(P, heads[0], 0.0).holders == {}
    assert t.match(P, heads[1], 0.0).holders == {}
    assert t.match(P, heads[2], 0.0).holders == {"r": (200, 1)}
    assert t.stats()["nodes"] == 1  # nodes nobody holds are pruned
    assert t.stats()["released_capacity"] == 2


def test_vllm_evicts_tails_before_the_prefix_they_extend():
    t = index()
    t.set_capacity("r", Capacity(bytes=300))
    sys = b"S" * 100
    tails = [sys + bytes([97 + i]) * 100 for i in range(3)]
    for h in tails:
        t.record(P, h, "r", 0.0)
    t.check()
    assert t.match(P, tails[0], 0.0).holders == {"r": (100, 1 + 2)}  # the prefix stays (count 3)
    assert t.match(P, tails[1], 0.0).holders["r"][0] == 200
    assert t.match(P, tails[2], 0.0).holders["r"][0] == 200
    assert t.stats(per_replica=True)["held"]["r"]["held_bytes"] == 300


def test_recently_sent_prefixes_survive_in_vllm_lru():
    t = index()
    t.set_capacity("r", Capacity(bytes=250))
    a, b, c = b"A" * 100, b"B" * 100, b"C" * 100
    t.record(P, a, "r", 0.0)
    t.record(P, b, "r", 1.0)
    t.record(P, a, "r", 2.0)  # a is fresh again
    t.record(P, c, "r", 3.0)  # b goes
    assert set(t.match(P, a, 4.0).holders) == {"r"}
    assert t.match(P, b, 4.0).holders == {}
    assert set(t.match(P, c, 4.0).holders) == {"r"}


def test_llamacpp_slots_hold_only_their_last_prompts():
    t = index()
    t.set_capacity("l", Capacity.llamacpp(slots=2))
    heads = [bytes([65 + i]) * 80 for i in range(3)]
    for h in heads:
        t.record(P, h, "l", 0.0)
    t.check()
    assert t.match(P, heads[0], 0.0).holders == {}  # the least recently used slot was reused
    assert "l" in t.match(P, heads[1], 0.0).holders
    assert "l" in t.match(P, heads[2], 0.0).holders


def test_llamacpp_reuses_the_slot_sharing_the_longest_prefix():
    t = index()
    t.set_capacity("l", Capacity.llamacpp(slots=2))
    sys = b"S" * 100
    p1, p2, p1b = sys + b"one", b"X" * 50, sys + b"two"
    t.record(P, p1, "l", 0.0)
    t.record(P, p2, "l", 1.0)
    t.record(P, p1b, "l", 2.0)  # shares 100/103 with p1's slot: that slot, not p2's (the LRU)
    t.check()
    assert t.match(P, p2, 3.0).holders == {"l": (50, 1)}
    assert t.match(P, p1b, 3.0).holders == {"l": (103, 1)}
    assert t.match(P, p1, 3.0).holders == {"l": (100, 2)}  # p1's tail is gone, sys stays


@pytest.mark.parametrize("similarity, survivor", [(0.9, "p1"), (0.05, "p2")])
def test_llamacpp_slot_similarity_threshold(similarity, survivor):
    """p3 shares 10 % with p1. At or above the threshold it takes p1's slot; below it, the
    least recently used slot (p2's)."""
    t = index()
    t.set_capacity("l", Capacity.llamacpp(slots=2, similarity=similarity))
    sys = b"S" * 10
    p = {"p2": b"X" * 50, "p1": sys + b"a" * 90, "p3": sys + b"b" * 90}
    for k, name in enumerate(("p2", "p1", "p3")):
        t.record(P, p[name], "l", float(k))
    t.check()
    gone = "p2" if survivor == "p1" else "p1"
    assert t.match(P, p[survivor], 9.0).holders["l"][0] == len(p[survivor])
    assert t.match(P, p[gone], 9.0).holders.get("l", (0, 0))[0] < len(p[gone])


def test_llamacpp_host_ram_cache_keeps_prompts_pushed_out_of_slots():
    t = index()
    t.set_capacity("l", Capacity.llamacpp(slots=1, ram_tokens=60))  # 240 bytes of RAM
    heads = [bytes([65 + i]) * 100 for i in range(4)]
    for h in heads:
        t.record(P, h, "l", 0.0)
    t.check()
    # slot: heads[3]; RAM (LRU, 240 B): heads[2], heads[1]; heads[0] fell out of RAM
    assert t.match(P, heads[0], 0.0).holders == {}
    for h in heads[1:]:
        assert t.match(P, h, 0.0).holders == {"l": (100, 1)}


def test_set_capacity_shrinks_holdings():
    t = index()
    for i in range(5):
        t.record(P, bytes([65 + i]) * 100, "r", float(i))
    t.set_capacity("r", Capacity(bytes=200))
    t.check()
    held = [i for i in range(5) if t.match(P, bytes([65 + i]) * 100, 9.0).holders]
    assert held == [3, 4]
    t.set_capacity("l", Capacity.llamacpp(slots=3))
    for i in range(3):
        t.record(P, bytes([75 + i]) * 10, "l", 10.0 + i)
    t.set_capacity("l", Capacity.llamacpp(slots=1))
    t.check()
    assert [i for i in range(3) if t.match(P, bytes([75 + i]) * 10, 20.0).holders] == [2]
    t.set_capacity("l", Capacity(bytes=1000))  # another kind: forgotten
    t.check()
    assert t.holders_of("l") == 0


def test_default_capacity_is_finite():
    assert PrefixConfig().default_capacity.bytes is not None
    t = PrefixIndex(PrefixConfig(default_capacity=Capacity(bytes=100)))
    t.record(P, b"a" * 80, "r", 0.0)
    t.record(P, b"b" * 80, "r", 0.0)
    assert t.match(P, b"a" * 80, 0.0).holders == {}


# --------------------------------------------------------------------------- removal, budget, ttl

def test_remove_replica_purges_it_at_once():
    t = index()
    t.record(P, SYS + b"a", "gone", 0.0)
    t.record(P, SYS + b"b", "stays", 0.0)
    t.record(P, b"only-gone" * 10, "gone", 0.0)
    t.remove_replica("gone")
    t.check()
    assert t.holders_of("gone") == 0
    assert t.match(P, b"only-gone" * 10, 0.0).matched_bytes == 0  # its own nodes are pruned
    assert t.match(P, SYS + b"b", 0.0).holders == {"stays": (len(SYS) + 1, 1)}
    assert "gone" not in t.replicas()
    t.remove_replica("never-seen")


def test_clear_replica_keeps_its_capacity():
    t = index()
    t.set_capacity("r", Capacity.llamacpp(slots=1))
    t.record(P, SYS, "r", 0.0)
    t.clear_replica("r")
    t.check()
    assert t.holders_of("r") == 0 and t.match(P, SYS, 0.0).matched_bytes == 0
    assert t.capacity("r") == Capacity.llamacpp(slots=1)
    t.record(P, SYS, "r", 1.0)
    t.record(P, SYS + b"more", "r", 2.0)
    assert t.stats(per_replica=True)["held"]["r"]["kind"] == "slots"


def test_budget_evicts_least_recently_recorded_leaves():
    t = index(budget_bytes=64 << 10)
    rng = random.Random(1)
    heads = [SYS[:64] + rng.randbytes(64) for _ in range(2000)]
    for k, h in enumerate(heads):
        t.record(P, h, f"r{k % 7}", float(k))
        assert t.accounted_bytes <= t.config.budget_bytes
    t.check()
    st_ = t.stats()
    assert st_["evicted_budget"] > 0
    assert t.match(P, heads[-1], 0.0).holders  # the newest are kept
    # the oldest tail is gone (at most the shared 64-byte start may survive)
    assert t.match(P, heads[0], 0.0).holders.get("r0", (0, 0))[0] <= 64


def test_ttl_forgets_stale_prefixes():
    t = index(ttl_s=10.0)
    t.record(P, b"old" * 30, "r", 0.0)
    t.record(P, b"new" * 30, "r", 8.0)
    assert t.match(P, b"old" * 30, 9.0).holders
    assert t.match(P, b"old" * 30, 11.0).holders == {}
    assert t.match(P, b"new" * 30, 11.0).holders
    assert t.stats()["evicted_ttl"] >= 1
    t.check()


def test_accounting_costs_cover_measured_memory():
    """The per-node and per-holding costs the budget uses are at least what tracemalloc sees."""
    rng = random.Random(3)
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        t = index(default_capacity=Capacity(bytes=1 << 30))
        for k in range(4000):
            h = b"S%02d" % rng.randrange(50) + rng.randbytes(40)
            for j in range(3):
                t.record(P, h, f"r{(k + j) % 16}", 0.0)
        used = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    st_ = t.stats()
    holdings = sum(len(n.holders) for _, n in t.iter_nodes())
    assert st_["bytes"] == NODE_COST * st_["nodes"] + HOLDER_COST * holdings \
        + st_["label_bytes"] + 1024 + REPLICA_COST * st_["replicas"]
    assert used <= st_["bytes"], (used, st_)
    assert used >= 0.5 * st_["bytes"], "the accounting is far too pessimistic"


def test_measured_memory_stays_within_budget_after_many_distinct_inserts():
    budget = 2 << 20
    rng = random.Random(4)
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        t = index(budget_bytes=budget, default_capacity=Capacity(bytes=256 << 10))
        for k in range(20_000):
            t.record(P, b"sys-%03d|" % rng.randrange(300) + rng.randbytes(rng.randrange(8, 200)),
                     f"r{k % 24}", float(k))
        used = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert t.stats()["evicted_budget"] > 0
    assert t.accounted_bytes <= budget
    assert used <= budget, f"measured {used} B > budget {budget} B"
    t.check()


# --------------------------------------------------------------------------- properties

heads_st = st.binary(min_size=0, max_size=40, ).map(lambda b: bytes(x % 3 + 97 for x in b))
ops_st = st.lists(st.tuples(st.sampled_from(["r0", "r1", "r2"]), heads_st), max_size=40)


@settings(max_examples=200, deadline=None)
@given(ops=ops_st, probes=st.lists(heads_st, max_size=8))
def test_match_never_exceeds_the_head_or_what_was_inserted(ops, probes):
    t = index()
    sent: dict[str, list[bytes]] = {}
    for r, h in ops:
        t.record(P, h, r, 0.0)
        sent.setdefault(r, []).append(h)
    t.check()
    inserted = [h for hs in sent.values() for h in hs]
    for q in probes + [h for _, h in ops]:
        m = t.match(P, q, 0.0)
        best = max((lcp(q, h) for h in inserted), default=0)
        assert m.matched_bytes <= len(q)
        assert m.matched_bytes == best  # nothing evicted: exactly the longest shared prefix
        for r, (mb, c) in m.holders.items():
            assert 0 < mb <= len(q) and c >= 1
            assert mb == max(lcp(q, h) for h in sent[r])


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["v0", "v1", "l0", "l1"]), heads_st), max_size=60),
       probes=st.lists(heads_st, max_size=6))
def test_holdings_under_capacity_never_claim_more_than_was_sent(ops, probes):
    t = index()
    t.set_capacity("v0", Capacity(bytes=30))
    t.set_capacity("v1", Capacity(bytes=7))
    t.set_capacity("l0", Capacity.llamacpp(slots=2))
    t.set_capacity("l1", Capacity(slots=1, ram_bytes=40))
    sent: dict[str, list[bytes]] = {}
    for r, h in ops:
        t.record(P, h, r, 0.0)
        sent.setdefault(r, []).append(h)
        t.check()
    for q in probes + [h for _, h in ops]:
        m = t.match(P, q, 0.0)
        assert m.matched_bytes <= len(q)
        for r, (mb, _c) in m.holders.items():
            assert mb <= max(lcp(q, h) for h in sent[r])
    held = t.stats(per_replica=True)["held"]
    assert held.get("v0", {"held_bytes": 0})["held_bytes"] <= 30
    assert held.get("v1", {"held_bytes": 0})["held_bytes"] <= 7


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(50, 600),
       budget=st.integers(4096, 40_000))
def test_memory_stays_within_budget_after_many_distinct_inserts(seed, n, budget):
    rng = random.Random(seed)
    t = index(budget_bytes=budget)
    for k in range(n):
        t.record(P if k % 3 else partition_key("m", None, "s"),
                 rng.choice([b"", b"sys"]) + rng.randbytes(rng.randrange(1, 120)),
                 f"r{rng.randrange(5)}", float(k))
        assert t.accounted_bytes <= budget
    t.check()


@settings(max_examples=150, deadline=None)
@given(ops=ops_st, gone=st.sampled_from(["r0", "r1", "r2"]), cap=st.integers(5, 200))
def test_removing_a_replica_leaves_no_holder_anywhere(ops, gone, cap):
    t = index(default_capacity=Capacity(bytes=cap))
    t.set_capacity("r1", Capacity.llamacpp(slots=2, ram_tokens=10))
    for r, h in ops:
        t.record(P, h, r, 0.0)
    t.remove_replica(gone)
    t.check()
    assert t.holders_of(gone) == 0
    for _, h in ops:
        assert gone not in t.match(P, h, 0.0).holders


# --------------------------------------------------------------------------- request heads

def chat(*msgs, **kw):
    return {"model": "m", "messages": [{"role": r, "content": c} for r, c in msgs], **kw}


def test_chat_head_is_role_nul_content_in_order():
    h = request_head(chat(("system", "Be brief."), ("user", "Hi")), "chat")
    assert h == b"system\0Be brief.\x1euser\0Hi"
    assert request_head(chat(("system", "Be brief."), ("user", "Hi")), "chat") == h


def test_a_conversation_turn_extends_the_previous_head():
    turns = [("system", "S" * 50), ("user", "q1"), ("assistant", "a1"), ("user", "q2")]
    prev = b""
    for k in range(1, len(turns) + 1):
        h = request_head(chat(*turns[:k]), "chat")
        assert h.startswith(prev)
        prev = h


def test_chat_head_renders_tools_parts_and_extra_fields_deterministically():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"b": 1, "a": 2}}}]
    body = chat(("system", "S"), ("user", "u"), tools=tools)
    h = request_head(body, "chat")
    assert h.startswith(b"system\0S\x1etools\0")
    assert b'"a":2,"b":1' in h  # canonical JSON
    parts = {"role": "user", "content": [{"type": "text", "text": "look"},
                                         {"type": "image_url", "image_url": {"url": "u1"}}]}
    h2 = request_head({"messages": [parts]}, "chat")
    assert h2.startswith(b"user\0look\x1f") and b"u1" in h2
    call = {"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]}
    assert b"c1" in request_head({"messages": [call]}, "chat")
    assert request_head({"messages": "nope"}, "chat") == b""
    assert request_head({"messages": [{"role": "user", "content": "é\ud800"}]}, "chat")


def test_completion_heads():
    assert request_head({"prompt": "hello"}, "completions") == b"hello"
    toks = request_head({"prompt": [1, 2, 300]}, "completions")
    assert len(toks) == 12 and toks[:4] == (1).to_bytes(4, "little")
    assert request_head({"prompt": ["a", "b"]}, "completions") == b"a"
    assert request_head({"prompt": [[5, 6], [7]]}, "completions") == request_head(
        {"prompt": [5, 6]}, "completions")
    assert request_head({"prompt": [-1]}, "completions") == b"[-1]"
    assert request_head({"input": "e"}, "embeddings") == b"e"
    assert request_head({}, "completions") == b""
    assert request_head({}, "other") == b""


op_st = st.one_of(
    st.tuples(st.just("record"), st.sampled_from(["v0", "v1", "l0", "l1", "d"]), heads_st,
              st.integers(1, 3)),
    st.tuples(st.just("remove"), st.sampled_from(["v0", "l0", "d"])),
    st.tuples(st.just("cap"), st.sampled_from(["v0", "l0", "l1"]),
              st.sampled_from([Capacity(bytes=12), Capacity(bytes=60), Capacity.llamacpp(1),
                               Capacity(slots=3, ram_bytes=30)])),
    st.tuples(st.just("match"), heads_st),
)


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(op_st, max_size=50), budget=st.integers(4096, 12_000),
       ttl=st.none() | st.floats(1.0, 20.0))
def test_invariants_hold_under_any_mix_of_operations(ops, budget, ttl):
    """Splits, capacity releases (LRU, slots, host RAM), budget and TTL evictions, removals
    and capacity changes, interleaved: the structure, the accounting and every replica's
    holdings stay consistent, and the budget holds after every record."""
    t = index(budget_bytes=budget, ttl_s=ttl, default_capacity=Capacity(bytes=80))
    t.set_capacity("v0", Capacity(bytes=25))
    t.set_capacity("l0", Capacity.llamacpp(slots=2, ram_tokens=8))
    t.set_capacity("l1", Capacity.llamacpp(slots=1))
    now = 0.0
    for op in ops:
        now += 1.0
        if op[0] == "record":
            _, r, h, c = op
            t.record(P, h * 40 if len(h) < 3 else h, r, now, count=c)
            assert t.accounted_bytes <= budget
        elif op[0] == "remove":
            t.remove_replica(op[1])
            assert t.holders_of(op[1]) == 0
        elif op[0] == "cap":
            t.set_capacity(op[1], op[2])
        else:
            m = t.match(P, op[1], now)
            assert m.matched_bytes <= len(op[1])
            assert all(0 < mb <= m.matched_bytes for mb, _ in m.holders.values())
        t.check()
