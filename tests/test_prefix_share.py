"""Routing as one, the core's half (llmgw.route.prefix_share): a decision's prefix insert handed
out by one router's core and applied on another's makes the second find the replica the first
chose, exactly as if it had decided that turn itself."""

from __future__ import annotations

import json
import random

import pytest

from llmgw.config import parse_config
from llmgw.route.attempt import Attempt
from llmgw.route.cache_stats import CacheStats
from llmgw.route.dispatch import RouterCore
from llmgw.route.prefix_share import PrefixInsert, PrefixOutbox
from llmgw.route.replicas import ReplicaTable
from llmgw.route.types import Decision

CFG = """
[[models]]
name = "m"
engine = "vllm"
[[models.replicas]]
url = "http://127.0.0.1:1"
[[models.replicas]]
url = "http://127.0.0.1:2"
[[models.replicas]]
url = "http://127.0.0.1:3"
[[models]]
name = "other"
engine = "vllm"
[[models.replicas]]
url = "http://127.0.0.1:4"
"""
SYSTEM = "You are a careful assistant for the accounts team. Answer briefly, cite the policy. " * 3


def core(seed: int) -> RouterCore:
    cfg = parse_config(CFG)
    return RouterCore(cfg, ReplicaTable(cfg), cache_stats=CacheStats(), wall=lambda: 0.0,
                      rng=random.Random(seed))


def turn(conv: int, n: int) -> bytes:
    """The body of conversation `conv`'s turn `n` (its history so far, then a new question)."""
    msgs = [{"role": "system", "content": SYSTEM}]
    for k in range(n):
        msgs.append({"role": "user", "content": f"conversation {conv}: question {k} about invoice {conv * 7 + k}"})
        if k < n - 1:
            msgs.append({"role": "assistant", "content": f"answer {k} for conversation {conv}, at some length"})
    return json.dumps({"model": "m", "messages": msgs}).encode()


def decide(c: RouterCore, body: bytes, rid: str, now: float) -> Decision:
    """One request through the core to its attempt's end; the decision it was sent by."""
    plan = c.plan("chat", body, rid, strategy=None, session=None, now=now)
    a = c.next(plan, now, 0.0)
    assert isinstance(a, Attempt)
    c.finish(plan, a, now + 0.01, None, first_byte_at=now + 0.005, status=200)
    return a.decision


def test_a_turn_on_another_router_finds_the_replica_the_first_chose() -> None:
    a, b = core(1), core(2)
    share_a, share_b = a.prefix_share(), b.prefix_share()
    now = 0.0
    for conv in range(8):
        first = decide(a, turn(conv, 1), f"a{conv}", now)
        inserts = share_a.take()
        assert len(inserts) == 1
        ins = inserts[0]
        assert (ins.model, ins.adapter, ins.salt, ins.replica, ins.count) == ("m", None, None, first.chosen, 1)
        assert share_b.apply(ins, now) == "applied"
        now += 1.0
        second = decide(b, turn(conv, 2), f"b{conv}", now)
        assert second.chosen == first.chosen, (conv, second.note)
        assert second.prefix == "hit"
        assert "prefix hit " in second.note and f"on {first.chosen}" in second.note
        # the candidates' rationale shows the holder and its count, as for a local insert
        held = [c for c in second.candidates if c.endpoint_id == first.chosen][0]
        assert any("B held, sent 1×" in f for f in held.flags), held.flags
        share_b.take()  # b's own insert of that turn (not a's again)
    assert share_b.counts()["applied"] == 8


def test_a_burst_through_several_routers_follows_the_first_while_its_events_are_due() -> None:
    """Routing as one × tier 2's events' lag: router a sends a new prompt to X; its repeat reaches
    router b before X's KV events reach b's index. a's insert carries the prompt's first block, so
    b knows X's events about it are due: X's silence sets nothing aside, the repeat follows the
    first. Without it (a peer that predates the field) b places the repeat by load."""
    held = {"m/0": 0, "m/1": 0, "m/2": 0}  # every engine publishes events; none has reported this prompt

    def send(c: RouterCore, rid: str, now: float) -> Decision:
        plan = c.plan("chat", turn(0, 1), rid, strategy=None, session=None, now=now)
        plan.info.kv_hashes, plan.info.kv_blocks = tuple(range(1000, 1020)), 20  # as tier 2's step sets them
        a = c.next(plan, now, 0.0)
        assert isinstance(a, Attempt)
        c.finish(plan, a, now + 0.01, None, first_byte_at=now + 0.005, status=200)
        return a.decision

    for carried in (True, False):
        a, b = core(1), core(2)
        for c in (a, b):
            c.kv_cache.lookup = lambda hashes: held
            c.kv_cache.alarmed = lambda replica: False
        share_a, share_b = a.prefix_share(), b.prefix_share()
        first = send(a, "a", 0.0)
        [ins] = share_a.take()
        assert ins.first_block == 1000
        share_b.apply(ins if carried else ins._replace(first_block=None), 0.05)
        second = send(b, "b", 0.1)
        if carried:
            assert second.chosen == first.chosen and "set aside" not in second.note, second.note
            assert b.kv_cache.awaited == 1
            later = send(b, "b2", 5.0)  # due since 2.11 and still silent: the engine dropped it
            assert f"tier 1 set aside on {first.chosen}" in later.note, later.note
        else:
            assert f"tier 1 set aside on {first.chosen}" in second.note, second.note


def test_without_the_peer_insert_the_second_router_sees_a_cold_head() -> None:
    a, b = core(1), core(2)
    a.prefix_share()
    decide(a, turn(0, 1), "a", 0.0)
    second = decide(b, turn(0, 2), "b", 1.0)
    assert second.prefix == "miss" and "cold" in second.note


def test_a_peer_insert_is_not_shared_again() -> None:
    a, b = core(1), core(2)
    decide(a, turn(0, 1), "a0", 0.0)  # before prefix_share: nothing kept
    share_a, share_b = a.prefix_share(), b.prefix_share()
    assert share_a.take() == []
    decide(a, turn(1, 1), "a1", 0.0)
    (ins,) = share_a.take()
    share_b.apply(ins, 0.0)
    assert share_b.take() == [] and share_b.pending() == 0
    assert a.prefix_share() is share_a


def test_unknown_replicas_and_other_models_are_counted_not_applied() -> None:
    b = core(2)
    share = b.prefix_share()
    before = b.prefix_metrics()["tree"]["records"]
    head = turn(0, 1)
    assert share.apply(PrefixInsert("m", None, None, "elsewhere-0", head, 1), 0.0) == "unknown_replica"
    other = next(r.id for r in b.all_replicas() if r.view.model == "other")
    assert share.apply(PrefixInsert("m", None, None, other, head, 1), 0.0) == "other_model"
    assert b.prefix_metrics()["tree"]["records"] == before
    c = share.counts()
    assert (c["applied"], c["unknown_replica"], c["other_model"]) == (0, 1, 1)


def test_a_peer_count_is_clamped_to_the_count_cap() -> None:
    b = core(2)
    share = b.prefix_share()
    rid = next(r.id for r in b.all_replicas() if r.view.model == "m")
    head = b"x" * 512
    share.apply(PrefixInsert("m", None, None, rid, head, 10**12), 0.0)
    share.apply(PrefixInsert("m", None, None, rid, head, -5), 0.0)
    m = b.prefix.index.match(("m", None, None), head, 0.0)
    assert 1 <= m.holders[rid][1] <= b.prefix.index.config.max_count


def test_the_outbox_keeps_the_newest_within_its_limit() -> None:
    box = PrefixOutbox(2)
    ins = [PrefixInsert("m", None, None, "r", bytes([65 + k]) * 80, 1) for k in range(3)]
    for i in ins:
        box.offer(i)
    assert (len(box), box.offered, box.dropped) == (2, 3, 1)
    assert box.take(1) == [ins[1]] and box.take() == [ins[2]] and box.take() == []
    with pytest.raises(ValueError):
        PrefixOutbox(0)


def test_the_shared_head_is_cut_where_the_tree_cuts_it() -> None:
    a = core(1)
    share = a.prefix_share()
    big = json.dumps({"model": "m", "messages": [{"role": "user", "content": "y" * 300_000}]}).encode()
    decide(a, big, "a", 0.0)
    (ins,) = share.take()
    assert len(ins.head) == a.prefix.index.config.max_head_bytes


# -- the feed's message (llmgw.route.prefix_wire) ---------------------------------------------------
KEY = b"k" * 32


def test_a_message_round_trips() -> None:
    from llmgw.route.prefix_wire import FeedMessage, decode, encode

    batch = [PrefixInsert("m", None, "salt", "m/0", b"abc" * 30, 3), PrefixInsert("m", "sql", None, "m/1", b"\x00\xff", 1)]
    frame = encode(KEY, "router-a", 12345, 7, batch)
    assert decode(KEY, frame) == FeedMessage("router-a", 12345, 7, batch)
    # tier 2's first blocks travel beside the inserts ("f"), for those that have one
    batch2 = [batch[0]._replace(first_block=(1 << 64) - 1), batch[1], batch[0]._replace(first_block=0)]
    assert decode(KEY, encode(KEY, "router-a", 12345, 8, batch2)) == FeedMessage("router-a", 12345, 8, batch2)
    assert decode(b"j" * 32, frame) == "bad_mac"
    assert decode(KEY, frame, max_bytes=len(frame) - 1) == "oversize"
    assert decode(KEY, b"\x02" + frame[1:]) == "version"
    assert decode(KEY, frame[:20]) == "malformed"
    flipped = bytearray(frame)
    flipped[-1] ^= 1
    assert decode(KEY, bytes(flipped)) == "bad_mac"


@pytest.mark.parametrize("t", [
    ["m", None, None, "r", b"h", True],  # a bool is not a count
    ["m", None, None, "r", b"h", 0],
    ["m", None, None, "r", "h", 1],  # a str head
    ["m", None, None, "r", b"", 1],
    ["", None, None, "r", b"h", 1],
    ["m", 5, None, "r", b"h", 1],
    ["m", None, None, None, b"h", 1],
    ["m", None, None, "r", b"h"],
    "not a list",
])
def test_a_badly_shaped_insert_drops_the_message(t: object) -> None:
    import hmac

    import msgpack

    from llmgw.route.prefix_wire import decode

    body = msgpack.packb({"s": "a", "i": 1, "n": 1, "t": [["m", None, None, "r", b"ok", 1], t]}, use_bin_type=True)
    frame = b"\x01" + hmac.digest(KEY, b"\x01" + body, "sha256") + body
    assert decode(KEY, frame) == "malformed"


@pytest.mark.parametrize("f", [
    "not a list", [[1, 5]], [[-1, 5]], [[0, -1]], [[0, 1.5]], [[0, "x"]], [[0, True]], [[0]], [0], [[True, 5]],
])
def test_a_badly_shaped_first_block_drops_the_message(f: object) -> None:
    import hmac

    import msgpack

    from llmgw.route.prefix_wire import decode

    body = msgpack.packb({"s": "a", "i": 1, "n": 1, "t": [["m", None, None, "r", b"ok", 1]], "f": f},
                         use_bin_type=True)
    frame = b"\x01" + hmac.digest(KEY, b"\x01" + body, "sha256") + body
    assert decode(KEY, frame) == "malformed"


def test_any_body_with_a_good_mac_decodes_without_raising() -> None:
    import hmac

    from hypothesis import given, settings
    from hypothesis import strategies as st

    from llmgw.route.prefix_wire import FeedMessage, decode

    @settings(max_examples=300, deadline=None)
    @given(st.binary(max_size=200) | st.builds(lambda d: __import__("msgpack").packb(d, use_bin_type=True),
                                                st.recursive(st.none() | st.integers(-2**63, 2**64 - 1) | st.text(max_size=5)
                                                             | st.binary(max_size=5),
                                                             lambda c: st.lists(c, max_size=6)
                                                             | st.dictionaries(st.sampled_from("sintxf"), c),
                                                             max_leaves=20)))
    def check(body: bytes) -> None:
        frame = b"\x01" + hmac.digest(KEY, b"\x01" + body, "sha256") + body
        assert isinstance(decode(KEY, frame), (str, FeedMessage))

    check()
