"""The agent's KV subscribers (llmgw.daemon.agent.kv_subscriber): which engines they follow, what
bad frames and gaps do to the mirror, and the bounded kv_events messages the session sends."""

from __future__ import annotations

import pytest
import trio
import zmq

from llmgw.daemon.agent.kv_subscriber import MAX_BLOCKS_PER_MESSAGE, KvSubscribers
from llmgw.fleet.types import EngineReport
from llmgw.kv.events import (
    BlockRemoved,
    BlockStored,
    EventBatch,
    encode_batch,
    pub_frames,
)

pytestmark = pytest.mark.anyio
VERSION = "0.11.0"


def stored(*hashes: int) -> bytes:
    ev = BlockStored(list(hashes), None, list(range(16 * len(hashes))), 16, None, "GPU", None)
    return encode_batch(EventBatch(1.0, [ev]), VERSION)


def removed(*hashes: int) -> bytes:
    return encode_batch(EventBatch(1.0, [BlockRemoved(list(hashes), "GPU")]), VERSION)


def report(replica: str = "m/1", pid: int | None = 100, state: str = "ready", endpoint: str | None = None,
           tmp: str = "/nonexistent") -> EngineReport:
    return EngineReport(replica=replica, model="m", state=state, pid=pid,
                        kv_endpoint=endpoint if endpoint is not None else f"ipc://{tmp}/{replica[-1]}.pub")


async def test_follows_running_engines_and_restarts_with_a_reset(tmp_path) -> None:
    kv = KvSubscribers(max_blocks=100)
    async with trio.open_nursery() as n:
        await n.start(kv.run)
        kv.on_report(report(tmp=str(tmp_path)))
        kv.on_report(EngineReport(replica="m/2", model="m", state="ready", pid=5))  # no kv_endpoint: not followed
        assert list(kv.mirrors()) == ["m/1"]
        first = kv.mirrors()["m/1"]
        sub = kv._subs["m/1"]
        kv.feed(sub, pub_frames("kv", 0, stored(1, 2)))
        [msg] = kv.take()
        assert msg.reset and sorted(h for _, h in msg.added) == [1, 2] and msg.event_seq == 0
        kv.on_report(report(pid=101, tmp=str(tmp_path)))  # the engine restarted: a fresh mirror, reset first
        assert kv.mirrors()["m/1"] is not first
        [msg] = kv.take()
        assert msg.reset and msg.added == ()
        kv.on_report(report(state="crashed", pid=None, tmp=str(tmp_path)))
        assert kv.mirrors() == {}
        n.cancel_scope.cancel()


async def test_bad_frames_and_gaps_reset_the_mirror_and_never_raise(tmp_path) -> None:
    kv = KvSubscribers(max_blocks=100)
    async with trio.open_nursery() as n:
        await n.start(kv.run)
        kv.on_report(report(tmp=str(tmp_path)))
        sub = kv._subs["m/1"]
        kv.feed(sub, pub_frames("kv", 5, stored(1, 2, 3)))
        kv.take()
        for garbage in ([b"kv"], [b"kv", b"\x00" * 8, b"\xc1garbage"], [b"\xff\xfe", b"\x00" * 8, stored(4)],
                        [b"kv", b"\x00" * 3, stored(4)], [b"kv", b"\x00" * 8, b"\x92\x01"]):
            kv.feed(sub, garbage)
        assert sub.stats.bad_frames == 5 and kv.totals.bad_frames == 5
        assert len(sub.mirror) == 0
        [msg] = kv.take()
        assert msg.reset and msg.added == ()
        kv.feed(sub, pub_frames("kv", 10, stored(7)))  # after a reset: any seq is the start
        kv.feed(sub, pub_frames("kv", 11, removed(7)))
        kv.feed(sub, pub_frames("kv", 14, stored(8, 9)))  # 12, 13 lost: a gap
        assert sub.stats.gaps == 1
        [msg] = kv.take()
        assert msg.reset and sorted(h for _, h in msg.added) == [8, 9] and msg.removed == ()
        assert msg.event_seq == 14
        kv.feed(sub, pub_frames("kv", 15, stored(*range(100, 300))))  # over max_blocks: reset, not growth
        assert sub.stats.overflows == 1 and len(sub.mirror) <= 100
        n.cancel_scope.cancel()


async def test_messages_are_bounded_and_a_new_session_gets_a_full_copy(tmp_path) -> None:
    kv = KvSubscribers(max_blocks=1 << 16)
    async with trio.open_nursery() as n:
        await n.start(kv.run)
        kv.on_report(report(tmp=str(tmp_path)))
        sub = kv._subs["m/1"]
        total = 3 * MAX_BLOCKS_PER_MESSAGE + 5
        kv.feed(sub, pub_frames("kv", 1, stored(*range(total))))
        msgs = kv.take(max_messages=2)
        assert [len(m.added) for m in msgs] == [MAX_BLOCKS_PER_MESSAGE] * 2
        rest = kv.take()
        assert sum(len(m.added) for m in msgs + rest) == total and kv.take() == []
        kv.resend_all()
        again = kv.take(max_messages=100)
        assert again[0].reset and sum(len(m.added) for m in again) == total
        n.cancel_scope.cancel()


async def test_events_from_a_real_publisher_reach_the_mirror(tmp_path) -> None:
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    endpoint = f"ipc://{tmp_path}/e.pub"
    pub.bind(endpoint)
    kv = KvSubscribers(max_blocks=100, context=ctx)
    try:
        async with trio.open_nursery() as n:
            await n.start(kv.run)
            kv.on_report(report(endpoint=endpoint))
            with trio.fail_after(10):
                seq = 0
                while not kv.mirrors()["m/1"].holds(42, "GPU"):  # a SUB misses what precedes its join
                    pub.send_multipart(pub_frames("kv", seq, stored(42)))
                    seq += 1
                    await trio.sleep(0.02)
            kv.on_report(report(state="stopping", endpoint=endpoint))
            assert kv.mirrors() == {}
            n.cancel_scope.cancel()
    finally:
        pub.close()
        ctx.term()


async def test_one_busy_engine_does_not_starve_the_others(tmp_path) -> None:
    kv = KvSubscribers(max_blocks=1 << 16)
    async with trio.open_nursery() as n:
        await n.start(kv.run)
        for rid in ("m/1", "m/2"):
            kv.on_report(report(rid, tmp=str(tmp_path)))
            kv.feed(kv._subs[rid], pub_frames("kv", 1, stored(*range(5 * MAX_BLOCKS_PER_MESSAGE))))
        firsts = [kv.take(max_messages=1)[0].replica for _ in range(4)]
        assert sorted(firsts) == ["m/1", "m/1", "m/2", "m/2"]
        n.cancel_scope.cancel()


async def test_counts_survive_an_engine_restart_or_stop_and_are_sent_once(tmp_path) -> None:
    kv = KvSubscribers(max_blocks=100)
    async with trio.open_nursery() as n:
        await n.start(kv.run)
        kv.on_report(report(tmp=str(tmp_path)))
        sub = kv._subs["m/1"]
        kv.feed(sub, [b"garbage"])
        kv.on_report(report(pid=101, tmp=str(tmp_path)))  # restarted before the flush
        kv.feed(kv._subs["m/1"], [b"more garbage"])
        kv.on_report(report(state="stopped", pid=None, tmp=str(tmp_path)))  # and stopped
        [msg] = kv.take()
        assert msg.replica == "m/1" and dict(msg.counts) == {"bad_frames": 2} and not msg.added and not msg.reset
        assert kv.take() == []
        n.cancel_scope.cancel()
