"""Routing as one, the shell's half (llmgw.daemon.router.peer_feed) over real ZeroMQ sockets on
127.0.0.1: two routers' feeds exchanging prefix-tree inserts; forged, oversize, malformed, own
and strangers' messages dropped and counted; a removed peer's messages no longer applied.

A SUB socket misses what was published before it joined (ZeroMQ's slow joiner), so the tests
publish until the condition they wait for holds, under a deadline."""

from __future__ import annotations

import hmac
import json
import random

import msgpack
import pytest
import trio
import zmq
from prometheus_client import CollectorRegistry, generate_latest

from llmgw.config import ConfigError, parse_config
from llmgw.daemon.router.peer_feed import PeerFeed, PeerFeedMetrics
from llmgw.route.attempt import Attempt
from llmgw.route.cache_stats import CacheStats
from llmgw.route.dispatch import RouterCore
from llmgw.route.prefix_share import PrefixInsert
from llmgw.route.prefix_wire import encode
from llmgw.route.replicas import ReplicaTable

pytestmark = pytest.mark.anyio
KEY = bytes(range(32))
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
"""
SYSTEM = "You answer questions about the warehouse's stock, briefly and with the item's code. " * 3


class FakeShare:
    """The core's share as the feed sees it: an outbox to fill, and what was applied."""

    def __init__(self, known: set[str] | None = None) -> None:
        self.out: list[PrefixInsert] = []
        self.applied: list[PrefixInsert] = []
        self.known = known

    def take(self, most: int | None = None) -> list[PrefixInsert]:
        out, self.out = self.out, []
        return out

    def apply(self, ins: PrefixInsert, now: float) -> str:
        if self.known is not None and ins.replica not in self.known:
            return "unknown_replica"
        self.applied.append(ins)
        return "applied"

    def counts(self) -> dict[str, int]:
        return {"outbox_dropped": 0}


def ins(k: int, replica: str = "m-0") -> PrefixInsert:
    return PrefixInsert("m", None, None, replica, b"head %d " % k + b"x" * 200, 1)


async def publish_until(feed: PeerFeed, share: FakeShare, done, *, make=ins) -> int:
    """Offer a new insert and flush every 10 ms until done(); the inserts offered."""
    k = 0
    with trio.fail_after(10):
        while not done():
            share.out.append(make(k))
            feed.flush()
            k += 1
            await trio.sleep(0.01)
    return k


def feed(rid: str, share, **kw) -> PeerFeed:
    return PeerFeed(rid, KEY, share, flush_s=3600, **kw)  # the tests flush themselves


async def test_two_feeds_exchange_inserts() -> None:
    sa, sb = FakeShare(), FakeShare()
    a, b = feed("ra", sa), feed("rb", sb)
    async with trio.open_nursery() as n:
        await n.start(a.run)
        await n.start(b.run)
        a.set_peers({"ra": a.address, "rb": b.address})  # its own id is left out
        b.set_peers({"ra": a.address, "rb": b.address})
        await publish_until(a, sa, lambda: sb.applied)
        await publish_until(b, sb, lambda: sa.applied, make=lambda k: ins(k, "m-2"))
        assert sb.applied[0].model == "m" and sb.applied[0].head.startswith(b"head ")
        assert all(i.replica == "m-2" for i in sa.applied)
        assert a.peers() == {"rb": b.address} and b.peer_count() == 1
        # a batch of many goes in several messages, in order, none lost
        before = len(sb.applied)
        sa.out.extend(ins(1000 + k) for k in range(600))
        assert a.flush() == 3  # 256 + 256 + 88
        with trio.fail_after(10):
            while len(sb.applied) < before + 600:
                await trio.sleep(0.005)
        assert [i.head for i in sb.applied[before:]] == [ins(1000 + k).head for k in range(600)]
        assert b.stats.dropped["gap"] == 0 and a.stats.sent_messages >= 3
        n.cancel_scope.cancel()


async def test_a_turn_routed_by_one_router_is_found_by_the_other() -> None:
    """Two routers' cores joined by their feeds: a conversation's first turn decided on one, its
    next turn on the other goes to the same replica, as a prefix hit."""
    cfg = parse_config(CFG)
    cores = [RouterCore(cfg, ReplicaTable(cfg), cache_stats=CacheStats(), wall=lambda: 0.0,
                        rng=random.Random(seed)) for seed in (1, 2)]
    a, b = feed("ra", cores[0].prefix_share()), feed("rb", cores[1].prefix_share())

    def body(conv: int, turns: int) -> bytes:
        msgs = [{"role": "system", "content": SYSTEM}]
        for k in range(turns):
            msgs += [{"role": "user", "content": f"conv {conv} question {k}"},
                     {"role": "assistant", "content": f"conv {conv} answer {k}"}]
        return json.dumps({"model": "m", "messages": msgs[:-1]}).encode()

    def decide(core: RouterCore, data: bytes, rid: str) -> str:
        now = trio.current_time()
        plan = core.plan("chat", data, rid, strategy=None, session=None, now=now)
        att = core.next(plan, now, 0.0)
        assert isinstance(att, Attempt)
        core.finish(plan, att, now, None, first_byte_at=now, status=200)
        return att.decision.chosen  # type: ignore[return-value]

    async with trio.open_nursery() as n:
        await n.start(a.run)
        await n.start(b.run)
        b.set_peers({"ra": a.address})
        chosen: dict[int, str] = {}
        conv = 0
        with trio.fail_after(10):
            while b.stats.received == 0:  # until b's SUB has joined
                chosen[conv] = decide(cores[0], body(conv, 1), f"a{conv}")
                a.flush()
                conv += 1
                await trio.sleep(0.01)
        for c in range(conv, conv + 5):  # now every first turn on a reaches b
            chosen[c] = decide(cores[0], body(c, 1), f"a{c}")
        a.flush()
        with trio.fail_after(10):
            while b.stats.received < 6:
                await trio.sleep(0.005)
        for c in range(conv, conv + 5):
            plan = cores[1].plan("chat", body(c, 2), f"b{c}", strategy=None, session=None,
                                 now=trio.current_time())
            att = cores[1].next(plan, trio.current_time(), 0.0)
            assert isinstance(att, Attempt)
            assert att.replica.id == chosen[c] and att.decision.prefix == "hit", att.decision.note
        n.cancel_scope.cancel()


def raw_pub() -> tuple[zmq.Socket, str]:
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind("tcp://127.0.0.1:*")
    return pub, pub.getsockopt_string(zmq.LAST_ENDPOINT).removeprefix("tcp://")


async def send_until(pub: zmq.Socket, frames, done) -> None:
    with trio.fail_after(10):
        while not done():
            for f in frames():
                pub.send(f)
            await trio.sleep(0.01)


async def test_forged_oversize_malformed_own_and_strangers_messages_are_dropped_and_counted() -> None:
    sb = FakeShare()
    b = feed("rb", sb, max_message_bytes=64 << 10, batch_bytes=32 << 10)
    pub, addr = raw_pub()
    seq = iter(range(1, 10**6))
    good = lambda: encode(KEY, "ra", 7, next(seq), [ins(1)])  # noqa: E731
    body = msgpack.packb([1, 2, 3])
    bad_shape = bytes([1]) + hmac.digest(KEY, bytes([1]) + body, "sha256") + body
    try:
        async with trio.open_nursery() as n:
            await n.start(b.run)
            b.set_peers({"ra": addr})
            d = b.stats.dropped
            await send_until(pub, lambda: [encode(b"\x00" * 32, "ra", 7, next(seq), [ins(0)])],
                             lambda: d["bad_mac"] > 0)
            await send_until(pub, lambda: [encode(KEY, "ra", 7, next(seq), [ins(2, "m-0")._replace(
                head=b"y" * (100 << 10))])], lambda: d["oversize"] > 0)
            await send_until(pub, lambda: [bad_shape, b"\x01short", b"\x02" + b"z" * 64],
                             lambda: d["malformed"] >= 2 and d["version"] > 0)
            await send_until(pub, lambda: [encode(KEY, "rb", 1, next(seq), [ins(3)])], lambda: d["own"] > 0)
            await send_until(pub, lambda: [encode(KEY, "rz", 1, next(seq), [ins(4)])],
                             lambda: d["unknown_peer"] > 0)
            assert sb.applied == [] and b.stats.received == 0
            await send_until(pub, lambda: [good()], lambda: sb.applied)  # the feed still works
            last = b.stats.received
            pub.send(encode(KEY, "ra", 7, 5, [ins(5)]))  # an old seq again: a replay
            await send_until(pub, lambda: [], lambda: d["replay"] > 0)
            assert b.stats.received == last
            top = b._last["ra"][1]
            pub.send(encode(KEY, "ra", 7, top + 10, [ins(6)]))  # 9 messages lost on the way
            await send_until(pub, lambda: [], lambda: b.stats.received > last)
            assert d["gap"] == 9
            # a restarted sender (a new incarnation) starts its sequence again
            await send_until(pub, lambda: [encode(KEY, "ra", 8, 1, [ins(7)])], lambda: b._last["ra"] == (8, 1))
            n.cancel_scope.cancel()
    finally:
        pub.close(0)


async def test_a_removed_peer_is_no_longer_heard() -> None:
    sa, sb = FakeShare(), FakeShare()
    a, b = feed("ra", sa), feed("rb", sb)
    async with trio.open_nursery() as n:
        await n.start(a.run)
        await n.start(b.run)
        b.set_peers({"ra": a.address})
        await publish_until(a, sa, lambda: sb.applied)
        b.set_peers({})
        heard = len(sb.applied)
        with trio.fail_after(10):
            while b.peer_count():
                await trio.sleep(0.005)
        for k in range(20):  # what a published now — and what was still queued — is not applied
            sa.out.append(ins(500 + k))
            a.flush()
            await trio.sleep(0.005)
        assert len(sb.applied) == heard
        b.set_peers({"ra": a.address})  # and heard again once named again
        await publish_until(a, sa, lambda: len(sb.applied) > heard)
        n.cancel_scope.cancel()


async def test_unknown_replicas_are_counted_and_metrics_exported() -> None:
    sa, sb = FakeShare(), FakeShare(known={"m-0"})
    a, b = feed("ra", sa), feed("rb", sb)
    reg = CollectorRegistry()
    reg.register(PeerFeedMetrics(b))
    async with trio.open_nursery() as n:
        await n.start(a.run)
        await n.start(b.run)
        b.set_peers({"ra": a.address})
        await publish_until(a, sa, lambda: b.stats.dropped["unknown_replica"] > 0,
                            make=lambda k: ins(k, "elsewhere-1"))
        n.cancel_scope.cancel()
    text = generate_latest(reg).decode()
    for line in ('llmgw_peer_feed_dropped_total{reason="unknown_replica"}', "llmgw_peer_feed_received_total",
                 "llmgw_peer_feed_sent_total", "llmgw_peer_feed_peers 1.0"):
        assert line in text, line
    assert sb.applied == []


def test_the_ha_section_is_checked() -> None:
    cfg = parse_config('[ha]\nfeed_listen = "0.0.0.0:7071"\nfeed_advertise = "10.0.0.5"\n')
    assert cfg.ha.feed_advertise == "10.0.0.5"
    with pytest.raises(ConfigError, match="feed_advertise"):
        parse_config('[ha]\nfeed_listen = "0.0.0.0:7071"\n')
    with pytest.raises(ConfigError, match="feed_advertise"):
        parse_config('[ha]\nfeed_advertise = "not a host"\n')
    with pytest.raises(ConfigError, match="feed_listen"):
        parse_config('[ha]\nfeed_listen = "7071"\n')


def test_the_advertised_address() -> None:
    f = PeerFeed("ra", KEY, FakeShare(), advertise="10.0.0.5")
    try:
        port = f.bound.rpartition(":")[2]
        assert f.bound.startswith("127.0.0.1:") and port != "0" and f.address == f"10.0.0.5:{port}"
    finally:
        f.close()
    with pytest.raises(ValueError):
        PeerFeed("ra", b"", FakeShare())


async def test_start_peer_feed_joins_two_routers() -> None:
    """What the daemon calls: the feed in the router's nursery, its core sharing, its metrics in
    the router's registry."""
    from llmgw.daemon.router.control_port import RouterAdapter
    from llmgw.daemon.router.peer_feed import start_peer_feed
    from llmgw.daemon.router.proxy import Router

    r1, r2 = (Router(parse_config(CFG), pool=None, seed=s) for s in (1, 2))  # type: ignore[arg-type]
    port1, port2 = RouterAdapter(r1), RouterAdapter(r2)
    assert port1.feed_address() is None
    port1.set_feed_peers({"r2": "127.0.0.1:1"})  # no feed: nothing to do
    async with trio.open_nursery() as n:
        f1 = start_peer_feed(r1, n, KEY, router_id="r1")
        f2 = start_peer_feed(r2, n, KEY, router_id="r2")
        with pytest.raises(RuntimeError):
            start_peer_feed(r2, n, KEY, router_id="r2")
        assert port1.feed_address() == f1.address
        port2.set_feed_peers({"r1": f1.address, "r2": f2.address})
        k = 0
        with trio.fail_after(10):
            while f2.stats.received == 0:  # r1's decisions reach r2 once its SUB has joined
                now = trio.current_time()
                data = json.dumps({"model": "m", "messages": [{"role": "user", "content": f"{SYSTEM} {k}"}]})
                plan = r1.core.plan("chat", data.encode(), f"q{k}", strategy=None, session=None, now=now)
                att = r1.core.next(plan, now, 0.0)
                assert isinstance(att, Attempt)
                r1.core.finish(plan, att, now, None, first_byte_at=now, status=200)
                k += 1
                await trio.sleep(0.01)
        text = generate_latest(r2.metrics.registry).decode()
        assert "llmgw_peer_feed_received_total" in text and "llmgw_peer_feed_peers 1.0" in text
        assert "llmgw_peer_feed_sent_total" in generate_latest(r1.metrics.registry).decode()
        n.cancel_scope.cancel()


def test_a_taken_address_is_a_clear_error() -> None:
    f = PeerFeed("ra", KEY, FakeShare())
    try:
        with pytest.raises(OSError, match=r"feed_listen = '127.0.0.1:\d+'"):
            PeerFeed("rb", KEY, FakeShare(), listen=f.bound)
    finally:
        f.close()


async def test_routers_sharing_an_address_share_a_connection() -> None:
    """A router restarted under a new id at the same address, its old row not yet gone: both ids
    are heard, over one connection (no message twice), and dropping the old id keeps it."""
    sa, sb = FakeShare(), FakeShare()
    a, b = feed("ra2", sa), feed("rb", sb)
    async with trio.open_nursery() as n:
        await n.start(a.run)
        await n.start(b.run)
        b.set_peers({"ra1": a.address, "ra2": a.address})
        await publish_until(a, sa, lambda: sb.applied)
        assert b.peer_count() == 1 and b.peers() == {"ra1": a.address, "ra2": a.address}
        b.set_peers({"ra2": a.address})
        heard = len(sb.applied)
        await publish_until(a, sa, lambda: len(sb.applied) > heard + 3)
        assert b.stats.dropped["replay"] == 0 and b.peers() == {"ra2": a.address}
        n.cancel_scope.cancel()
