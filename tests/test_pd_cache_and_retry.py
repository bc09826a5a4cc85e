"""Disaggregation's threshold on the part of the prompt the decoder would compute (a prompt mostly
cached on the decoder it goes to is not split), and a prefiller that cannot be reached replaced
by another — in the router's pure core."""

from __future__ import annotations

import json

from llmgw.route.attempt import Attempt
from llmgw.route.breaker import FailureKind
from llmgw.route.dispatch import RouterCore

from tests.test_pd_core import CFG, LONG, PARAMS, answer, core

TWO_PREFILLERS = CFG + """[[models.replicas]]
url = "http://127.0.0.1:9004"
role = "prefill"
"""  # m/0 and m/3 prefill, m/1 and m/2 decode


def chat(*turns: str) -> bytes:
    roles = ["user", "assistant"]
    msgs = [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]
    return json.dumps({"model": "m", "messages": msgs, "max_tokens": 20}).encode()


def split_turn(c: RouterCore, rid: str, *turns: str) -> Attempt:
    """One request split and served: its decode attempt (ended ok)."""
    p = c.plan("chat", chat(*turns), rid, strategy=None, session=None, now=0.0)
    a = c.next(p, 0.0, 0.0)
    assert isinstance(a, Attempt) and a.phase == "prefill", rid
    a.sent_at = 0.0
    c.prefilled(p, a, 0.1, None, status=200, data=answer(PARAMS))
    d = c.next(p, 0.1, 0.0)
    assert isinstance(d, Attempt) and d.phase == "decode", rid
    d.sent_at = 0.1
    c.finish(p, d, 0.3, None, first_byte_at=0.2, status=200)
    return d


def test_a_next_turn_cached_on_its_decoder_is_not_split() -> None:
    c = core()
    first = split_turn(c, "t1", LONG)
    holder = first.replica.id
    # the next turn: the first one's prompt (cached where it was decoded) and a few new tokens
    p = c.plan("chat", chat(LONG, "an answer", "and one more question"), "t2", strategy=None, session=None,
               now=1.0)
    assert p.pd == "prefill"  # long as a whole ...
    a = c.next(p, 1.0, 0.0)
    # ... but short where it goes: the decoder holding it computes the rest itself
    assert isinstance(a, Attempt) and a.phase == "" and a.replica.id == holder
    assert "kv_transfer_params" not in json.loads(a.body if a.body is not None else p.raw)
    d = c.decisions[-1]
    assert d.chosen == holder and d.strategy == "chat" and "cached on " + holder in d.note and "tier 1" in d.note
    assert sum(1 for x in c.decisions if x.request_id == "t2") == 1  # decided once, not twice
    s = c.pd_stats
    assert s.paths[("m", "cached")][0] == 1 and s.paths[("m", "split")][0] == 1
    assert any("not split" in m[3] for m in p.trace.marks)  # type: ignore[union-attr]


def test_a_cached_decoder_that_load_passes_over_leaves_the_request_split() -> None:
    c = core()
    holder = split_turn(c, "t1", LONG).replica.id
    c.table.replicas[holder].view.inflight = 60  # far over the other decoder: the prefix spills
    p = c.plan("chat", chat(LONG, "an answer", "more"), "t2", strategy=None, session=None, now=1.0)
    a = c.next(p, 1.0, 0.0)
    assert isinstance(a, Attempt) and a.phase == "prefill"  # the other decoder would compute it all
    assert ("m", "cached") not in c.pd_stats.paths


def test_a_long_new_part_is_split_even_with_the_head_cached() -> None:
    c = core()
    split_turn(c, "t1", LONG)
    p = c.plan("chat", chat(LONG, "an answer", LONG), "t2", strategy=None, session=None, now=1.0)
    a = c.next(p, 1.0, 0.0)
    assert isinstance(a, Attempt) and a.phase == "prefill"  # ~200 new tokens: over the threshold of 50


def test_an_unreachable_prefiller_is_replaced_by_another() -> None:
    c = core(TWO_PREFILLERS)
    p = c.plan("chat", chat(LONG), "r", strategy=None, session=None, now=0.0)
    a = c.next(p, 0.0, 0.0)
    assert isinstance(a, Attempt) and a.phase == "prefill"
    first = a.replica.id
    a.sent_at = 0.0
    c.prefilled(p, a, 0.01, FailureKind.CONNECT, status=None, detail="connection refused")
    b = c.next(p, 0.01, 0.0)
    assert isinstance(b, Attempt) and b.phase == "prefill" and b.replica.id != first
    assert not c.pd_stats.fallbacks  # not a fallback: split still
    assert any("another prefiller" in m[3] for m in p.trace.marks)  # type: ignore[union-attr]
    b.sent_at = 0.01
    c.prefilled(p, b, 0.1, None, status=200, data=answer(PARAMS))
    d = c.next(p, 0.1, 0.0)
    assert isinstance(d, Attempt) and d.phase == "decode" and d.replica.view.role == "decode"
    c.finish(p, d, 0.3, None, first_byte_at=0.2, status=200)
    tr = p.trace.to_dict()  # type: ignore[union-attr]
    assert [x["phase"] for x in tr["attempts"]] == ["prefill", "prefill", "decode"]
    assert tr["outcome"] == "ok"
    assert c.table.replicas[first].breaker.snapshot()["failures_total"] == 1
    assert c.pd_stats.paths == {("m", "split"): c.pd_stats.paths[("m", "split")]}
    assert c.pd_stats.paths[("m", "split")][0] == 1  # one request, split once


def test_with_no_other_prefiller_to_ask_the_decoder_prefills() -> None:
    c = core(TWO_PREFILLERS)
    p = c.plan("chat", chat(LONG), "r", strategy=None, session=None, now=0.0)
    for _ in range(2):
        a = c.next(p, 0.0, 0.0)
        assert isinstance(a, Attempt) and a.phase == "prefill"
        a.sent_at = 0.0
        c.prefilled(p, a, 0.01, FailureKind.CONNECT, status=None)
    d = c.next(p, 0.01, 0.0)
    assert isinstance(d, Attempt) and d.phase == "" and d.replica.view.role == "decode"
    assert c.pd_stats.fallbacks[("m", "connect")][0] == 1  # once, for the request
    assert c.pd_stats.paths[("m", "split")][0] == 1 and ("m", "no_prefiller") not in c.pd_stats.paths
    # a timeout is not retried on another prefiller: it may still be working; the decoder prefills
    p = c.plan("chat", chat("z " * 400), "s", strategy=None, session=None, now=1.0)
    a = c.next(p, 1.0, 0.0)
    assert isinstance(a, Attempt) and a.phase == "prefill"
    a.sent_at = 1.0
    c.prefilled(p, a, 2.0, FailureKind.TIMEOUT, status=None)
    d = c.next(p, 2.0, 0.0)
    assert isinstance(d, Attempt) and d.phase == "" and c.pd_stats.fallbacks[("m", "timeout")][0] == 1


def test_the_engines_own_blocks_say_what_is_cached_where_they_are_published() -> None:
    c = core()
    # tier 2: m/2's engine reports holding 11 of the prompt's 12 blocks; tier 1 never saw it
    c.kv_cache.lookup = lambda hashes: {"m/1": 0, "m/2": 11}
    p = c.plan("chat", chat("w " * 400), "k", strategy=None, session=None, now=0.0)
    p.info.kv_hashes, p.info.kv_blocks = tuple(range(12)), 12
    a = c.next(p, 0.0, 0.0)
    assert isinstance(a, Attempt) and a.phase == "" and a.replica.id == "m/2"
    assert "tier 2" in c.decisions[-1].note and c.pd_stats.paths[("m", "cached")][0] == 1
    # half of it held: ~100 tokens to compute, over the threshold — split
    c.kv_cache.lookup = lambda hashes: {"m/1": 0, "m/2": 6}
    p = c.plan("chat", chat("v " * 400), "h", strategy=None, session=None, now=1.0)
    p.info.kv_hashes, p.info.kv_blocks = tuple(range(100, 112)), 12
    a = c.next(p, 1.0, 0.0)
    assert isinstance(a, Attempt) and a.phase == "prefill"


def test_skip_cached_false_counts_the_whole_prompt() -> None:
    c = core(CFG.replace("min_prompt_tokens = 50", "min_prompt_tokens = 50\nskip_cached = false"))
    split_turn(c, "t1", LONG)
    p = c.plan("chat", chat(LONG, "an answer", "more"), "t2", strategy=None, session=None, now=1.0)
    a = c.next(p, 1.0, 0.0)
    assert isinstance(a, Attempt) and a.phase == "prefill" and ("m", "cached") not in c.pd_stats.paths


def test_routing_as_one_a_turn_served_through_another_router_is_seen_cached() -> None:
    """Several routers × the cache check: tier 1's inserts are shared (routing as one), so the
    router that gets a conversation's next turn knows which decoder the other one sent the last to."""
    a, b = core(), core()
    share_a, share_b = a.prefix_share(), b.prefix_share()
    holder = split_turn(a, "t1", LONG).replica.id
    for ins in share_a.take():
        share_b.apply(ins, 0.5)
    p = b.plan("chat", chat(LONG, "an answer", "more"), "t2", strategy=None, session=None, now=1.0)
    d = b.next(p, 1.0, 0.0)
    assert isinstance(d, Attempt) and d.phase == "" and d.replica.id == holder
    assert b.pd_stats.paths[("m", "cached")][0] == 1
