"""The agent's KV event replay (llmgw.daemon.agent.kv_subscriber, kv_replay): a sequence gap is
filled from the engine's replay ROUTER through a DEALER, or the mirror resets when the engine no
longer has the batches, the replay times out or is garbage; a new subscription catches up from the
replay buffer; everything is counted once in the kv_events messages."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable

import pytest
import trio
import zmq

from llmgw.daemon.agent import kv_subscriber
from llmgw.daemon.agent.kv_subscriber import KvSubscribers
from llmgw.daemon.sim.kv_publisher import KVEventPublisher
from llmgw.fleet.types import EngineReport
from llmgw.fleet.wire import KvEvents
from llmgw.kv.events import (
    BlockStored,
    EventBatch,
    encode_batch,
    pub_frames,
    replay_end_frames,
    replay_reply_frames,
)

pytestmark = pytest.mark.anyio
VERSION = "0.33.0"
TIMEOUT = 10  # a hang guard, never synchronisation


@pytest.fixture
def anyio_backend():
    return "trio"


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def stored(*hashes: int) -> bytes:
    ev = BlockStored(list(hashes), None, list(range(16 * len(hashes))), 16, None, "GPU", None)
    return encode_batch(EventBatch(1.0, [ev]), VERSION)


def report(pub: str, replay: str | None, state: str = "ready", pid: int = 100) -> EngineReport:
    return EngineReport(replica="m/1", model="m", state=state, pid=pid, kv_endpoint=pub, kv_replay=replay)


async def until(cond: Callable[[], bool], what: str) -> None:
    """Wait for a condition the agent's tasks reach (bounded; polls, never a fixed sleep)."""
    with trio.fail_after(TIMEOUT):
        while not cond():
            await trio.sleep(0.005)
    assert cond(), what


def counts(msgs: list[KvEvents]) -> Counter[str]:
    c: Counter[str] = Counter()
    for m in msgs:
        c.update(dict(m.counts))
    return c


async def joined(kv: KvSubscribers, pub: KVEventPublisher, block: int = 1000) -> None:
    """Beat PUB/SUB's slow joiner: publish probes until the SUB got one and the mirror is up to date
    (the 20 ms per probe only bounds how many go out)."""
    sub = kv._subs["m/1"]
    for i in range(500):
        pub.publish(stored(block + i))
        with trio.move_on_after(0.02):
            await until(lambda: sub.received > 0, "joined")
            break
    await until(lambda: sub.replaying is None and sub.mirror.last_seq == pub.next_seq - 1, "caught up")


async def test_a_gap_is_replayed_and_the_mirror_equals_the_engines(ctx, tmp_path) -> None:
    pub = KVEventPublisher(f"ipc://{tmp_path}/e.pub", replay_endpoint=f"ipc://{tmp_path}/e.replay", topic="kv",
                           context=ctx)
    kv = KvSubscribers(max_blocks=1000, context=ctx, replay_min_interval_s=0.0)
    async with trio.open_nursery() as n:
        await n.start(pub.run)
        await n.start(kv.run)
        kv.on_report(report(pub.endpoint, pub.replay_endpoint))
        await joined(kv, pub)
        sub = kv._subs["m/1"]
        first = pub.next_seq
        pub.drop_seqs = frozenset({first + 1, first + 4, first + 5})  # off the PUB, kept in the replay buffer
        for h in range(8):
            pub.publish(stored(h))
        await until(lambda: sub.mirror.last_seq == first + 7 and sub.replaying is None, "replayed")
        assert set(range(8)) <= sub.mirror.blocks()["GPU"]
        assert sub.mirror.stats.resets == 1  # only the first one, before anything arrived
        ok = sub.stats.replays["replay_gap_ok"]
        assert ok == sub.stats.gaps >= 1 and sum(sub.stats.replays.values()) == ok + 1  # + the start replay
        msgs = kv.take(max_messages=100)
        c = counts(msgs)
        assert c["gaps"] == sub.stats.gaps and c["replay_gap_ok"] == ok and c["replay_start_ok"] == 1
        assert not any(m.reset for m in msgs[1:])
        assert kv.take() == []  # each increment is sent once
        n.cancel_scope.cancel()


async def test_a_replay_that_cannot_cover_the_gap_resets(ctx, tmp_path) -> None:
    pub = KVEventPublisher(f"ipc://{tmp_path}/e.pub", replay_endpoint=f"ipc://{tmp_path}/e.replay", topic="kv",
                           context=ctx, drop_lost=True)
    kv = KvSubscribers(max_blocks=1000, context=ctx, replay_min_interval_s=0.0)
    async with trio.open_nursery() as n:
        await n.start(pub.run)
        await n.start(kv.run)
        kv.on_report(report(pub.endpoint, pub.replay_endpoint))
        await joined(kv, pub)
        sub = kv._subs["m/1"]
        kv.take(max_messages=100)
        first = pub.next_seq
        pub.drop_seqs = frozenset({first + 1})  # lost: not in the replay buffer either
        for h in range(4):
            pub.publish(stored(h))
        await until(lambda: sub.mirror.last_seq == first + 3 and sub.replaying is None, "reset")
        assert sub.stats.replays["replay_gap_missed"] == 1 and sub.mirror.stats.resets == 2
        assert sub.mirror.blocks()["GPU"] == {2, 3}  # what came after the gap; the router clears the rest
        msgs = kv.take(max_messages=100)
        assert msgs[0].reset and counts(msgs) == Counter({"gaps": 1, "replay_gap_missed": 1})
        n.cancel_scope.cancel()


async def test_a_second_gap_too_soon_resets_without_asking(ctx, tmp_path) -> None:
    pub = KVEventPublisher(f"ipc://{tmp_path}/e.pub", replay_endpoint=f"ipc://{tmp_path}/e.replay", topic="kv",
                           context=ctx)
    kv = KvSubscribers(max_blocks=1000, context=ctx, replay_min_interval_s=3600.0)
    async with trio.open_nursery() as n:
        await n.start(pub.run)
        await n.start(kv.run)
        kv.on_report(report(pub.endpoint, pub.replay_endpoint))
        await joined(kv, pub)
        sub = kv._subs["m/1"]
        sub.next_gap_replay = -math.inf  # a late SUB's gap may have used the interval: start afresh
        before = Counter(sub.stats.replays)
        first = pub.next_seq
        pub.drop_seqs = frozenset({first + 1, first + 4})
        for h in range(3):
            pub.publish(stored(h))
        await until(lambda: sub.mirror.last_seq == first + 2 and sub.replaying is None, "replayed")
        for h in range(3, 6):
            pub.publish(stored(h))
        await until(lambda: sub.mirror.last_seq == first + 5 and sub.replaying is None, "reset")
        assert sub.stats.replays - before == Counter({"replay_gap_ok": 1, "replay_gap_throttled": 1})
        assert sub.mirror.blocks()["GPU"] == {5}  # reset at the second gap
        n.cancel_scope.cancel()


async def test_a_new_subscriber_catches_up_from_the_replay_buffer(ctx, tmp_path) -> None:
    """An agent that restarts finds its engines idle: the replay brings their blocks, no request needed."""
    pub = KVEventPublisher(f"ipc://{tmp_path}/e.pub", replay_endpoint=f"ipc://{tmp_path}/e.replay", topic="kv",
                           context=ctx)
    kv = KvSubscribers(max_blocks=1000, context=ctx)
    async with trio.open_nursery() as n:
        await n.start(pub.run)
        for h in range(5):
            pub.publish(stored(h))
        await until(lambda: pub.sent == 5, "published")
        await n.start(kv.run)
        kv.on_report(report(pub.endpoint, pub.replay_endpoint, state="starting"))
        sub = kv._subs["m/1"]
        assert sub.replaying is None  # not before the engine serves
        kv.on_report(report(pub.endpoint, pub.replay_endpoint))
        await until(lambda: sub.replaying is None and sub.mirror.last_seq == 4, "caught up")
        [msg] = kv.take()
        assert msg.reset and sorted(h for _, h in msg.added) == [0, 1, 2, 3, 4]
        assert dict(msg.counts) == {"replay_start_ok": 1}
        await joined(kv, pub, block=5)  # the SUB follows from there
        assert sub.mirror.holds(5, "GPU")
        n.cancel_scope.cancel()


class FakeEngine:
    """A PUB and a replay ROUTER the test drives by hand."""

    def __init__(self, ctx: zmq.Context, tmp: str) -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(f"ipc://{tmp}/f.pub")
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(f"ipc://{tmp}/f.replay")
        self.endpoints = (f"ipc://{tmp}/f.pub", f"ipc://{tmp}/f.replay")

    def send(self, seq: int, *hashes: int) -> None:
        self.pub.send_multipart(pub_frames("kv", seq, stored(*hashes)))

    async def request(self) -> tuple[bytes, int]:
        from llmgw.daemon.net.zmqio import AsyncSocket
        frames = await AsyncSocket(self.router).recv_multipart()
        assert len(frames) == 3 and frames[1] == b""
        return frames[0], int.from_bytes(frames[2], "big")

    def close(self) -> None:
        self.pub.close()
        self.router.close()


async def start_fake(kv: KvSubscribers, eng: FakeEngine) -> kv_subscriber._Sub:
    kv.on_report(report(*eng.endpoints, state="starting"))  # no start replay: the test answers the gap's
    sub = kv._subs["m/1"]
    for _ in range(500):
        eng.send(0, 1)
        with trio.move_on_after(0.02):
            await until(lambda: sub.received > 0, "joined")
            break
    assert sub.mirror.last_seq == 0
    return sub


@pytest.mark.parametrize("layout", ["0.25.0", "0.33.0"])
async def test_both_replay_layouts_are_read(ctx, tmp_path, layout) -> None:
    eng = FakeEngine(ctx, str(tmp_path))
    kv = KvSubscribers(max_blocks=1000, context=ctx)
    try:
        async with trio.open_nursery() as n:
            await n.start(kv.run)
            sub = await start_fake(kv, eng)
            eng.send(2, 3)  # seq 1 lost
            ident, start = await eng.request()
            assert start == 1 and sub.replaying == "gap"
            for seq, h in ((1, 2), (2, 3)):
                eng.router.send_multipart([ident, *replay_reply_frames("kv", seq, stored(h), layout)])
            eng.router.send_multipart([ident, *replay_end_frames(layout)])
            await until(lambda: sub.replaying is None, "replayed")
            assert sub.mirror.blocks()["GPU"] == {1, 2, 3} and sub.stats.replays == {"replay_gap_ok": 1}
            n.cancel_scope.cancel()
    finally:
        eng.close()


@pytest.mark.parametrize("answer", ["garbage", "later", "empty", "silence", "held_overflow"])
async def test_a_replay_that_fails_resets_and_applies_what_was_held(ctx, tmp_path, answer, monkeypatch) -> None:
    monkeypatch.setattr(kv_subscriber, "MAX_HELD", 3)
    eng = FakeEngine(ctx, str(tmp_path))
    kv = KvSubscribers(max_blocks=1000, context=ctx, replay_timeout_s=0.3 if answer == "silence" else TIMEOUT)
    try:
        async with trio.open_nursery() as n:
            await n.start(kv.run)
            sub = await start_fake(kv, eng)
            kv.take()
            eng.send(3, 4)  # 1, 2 lost
            ident, start = await eng.request()
            assert start == 1
            eng.send(4, 5)  # arrives during the replay: held, applied after
            await until(lambda: len(sub.held) == 2, "held")
            if answer == "garbage":
                eng.router.send_multipart([ident, b"", b"kv", b"\x00" * 8, b"\xc1not msgpack"])
            elif answer == "later":  # the engine's buffer starts after the first missing batch
                eng.router.send_multipart([ident, *replay_reply_frames("kv", 2, stored(2), VERSION)])
                eng.router.send_multipart([ident, *replay_end_frames(VERSION)])
            elif answer == "empty":
                eng.router.send_multipart([ident, *replay_end_frames(VERSION)])
            elif answer == "held_overflow":
                for seq in (5, 6):
                    eng.send(seq, seq + 1)
            await until(lambda: sub.replaying is None, "finished")
            outcome = {"garbage": "bad", "later": "missed", "empty": "missed", "silence": "timeout",
                       "held_overflow": "overflow"}[answer]
            assert sub.stats.replays == {f"replay_gap_{outcome}": 1}
            if answer == "held_overflow":
                assert sub.mirror.last_seq is None and len(sub.mirror) == 0  # what was held is gone too
            else:
                assert sub.mirror.blocks()["GPU"] == {4, 5} and sub.mirror.last_seq == 4
            [msg] = kv.take()
            assert msg.reset and dict(msg.counts) == {"gaps": 1, f"replay_gap_{outcome}": 1}
            n.cancel_scope.cancel()
    finally:
        eng.close()


async def test_without_a_replay_endpoint_a_gap_resets(ctx, tmp_path) -> None:
    eng = FakeEngine(ctx, str(tmp_path))
    kv = KvSubscribers(max_blocks=1000, context=ctx)
    try:
        async with trio.open_nursery() as n:
            await n.start(kv.run)
            kv.on_report(report(eng.endpoints[0], None))
            sub = kv._subs["m/1"]
            for _ in range(500):
                eng.send(0, 1)
                with trio.move_on_after(0.02):
                    await until(lambda: sub.received > 0, "joined")
                    break
            eng.send(2, 3)
            await until(lambda: sub.stats.gaps == 1, "gap")
            assert sub.stats.replays == {"replay_gap_unavailable": 1} and sub.mirror.blocks()["GPU"] == {3}
            n.cancel_scope.cancel()
    finally:
        eng.close()


async def test_a_start_replay_keeps_what_a_short_buffer_still_covers(ctx, tmp_path) -> None:
    pub = KVEventPublisher(f"ipc://{tmp_path}/e.pub", replay_endpoint=f"ipc://{tmp_path}/e.replay", topic="kv",
                           context=ctx, buffer_steps=3)
    kv = KvSubscribers(max_blocks=1000, context=ctx)
    async with trio.open_nursery() as n:
        await n.start(pub.run)
        for h in range(6):
            pub.publish(stored(h))
        await until(lambda: pub.sent == 6, "published")
        await n.start(kv.run)
        kv.on_report(report(pub.endpoint, pub.replay_endpoint))
        sub = kv._subs["m/1"]
        await until(lambda: sub.replaying is None and sub.mirror.last_seq == 5, "caught up")
        assert sub.stats.replays == {"replay_start_missed": 1}
        assert sub.mirror.blocks()["GPU"] == {3, 4, 5}  # a subset of the engine's blocks, never a wrong one
        n.cancel_scope.cancel()


async def test_a_replay_longer_than_the_cap_is_abandoned(ctx, tmp_path) -> None:
    from llmgw.daemon.agent.kv_replay import fetch_replay
    eng = FakeEngine(ctx, str(tmp_path))
    got: list[int] = []
    try:
        async with trio.open_nursery() as n:
            async def answer() -> None:
                ident, start = await eng.request()
                for seq in range(start, start + 5):
                    eng.router.send_multipart([ident, *replay_reply_frames("kv", seq, stored(seq), VERSION)])
                eng.router.send_multipart([ident, *replay_end_frames(VERSION)])
            n.start_soon(answer)
            with trio.fail_after(TIMEOUT):
                out = await fetch_replay(ctx, eng.endpoints[1], 7, need_start=True,
                                         apply=lambda seq, b: got.append(seq) or "applied", max_messages=3)
            assert out == ("overflow", 3) and got == [7, 8, 9]
    finally:
        eng.close()
