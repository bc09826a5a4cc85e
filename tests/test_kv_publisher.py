"""KVEventPublisher (vLLM ZmqEventPublisher wire compatibility) and the trio zmq adapter."""

from __future__ import annotations

import re

import pytest
import trio
import trio.testing
import zmq

from llmgw.daemon.sim.kv_publisher import (
    END_SEQ,
    KVEventPublisher,
    is_bind_endpoint,
    offset_endpoint_port,
)
from llmgw.daemon.net.zmqio import AsyncSocket

from .conftest import load_golden

TOPIC = "kv@test"
TIMEOUT = 10  # a hang guard only, never used for synchronisation


@pytest.fixture
def anyio_backend():
    return "trio"


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


@pytest.fixture
def ipc(tmp_path):
    return lambda name: f"ipc://{tmp_path}/{name}"


def seq8(n: int) -> bytes:
    return n.to_bytes(8, "big")


def golden_zmq(version: str) -> dict:
    return load_golden()["versions"][version]["zmq"]


def sub_socket(ctx, endpoint: str, prefix: bytes = b"", *, bind: bool = False) -> AsyncSocket:
    s = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.SUBSCRIBE, prefix)
    s.setsockopt(zmq.LINGER, 0)
    (s.bind if bind else s.connect)(endpoint)
    return AsyncSocket(s)


def dealer_socket(ctx, endpoint: str) -> AsyncSocket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    return AsyncSocket(s)


async def join_sub(pub: KVEventPublisher, sub: AsyncSocket, max_probes: int = 500) -> int:
    """Beat the PUB/SUB slow joiner: publish probes until the SUB gets one; return its seq.

    The per-probe wait only bounds how many probes go out; correctness does not depend on it."""
    for _ in range(max_probes):
        pub.publish(b"probe")
        with trio.move_on_after(0.02):
            frames = await sub.recv_multipart()
            assert len(frames) == 3 and frames[2] == b"probe"
            return int.from_bytes(frames[1], "big")
    raise AssertionError("subscriber never joined")


async def recv_contiguous(sub: AsyncSocket, first_seq: int, want: list[bytes]) -> list[list[bytes]]:
    """Receive from first_seq+1 on; skip trailing probes; check seqs are contiguous; return `want`'s."""
    got, expect = [], first_seq + 1
    with trio.fail_after(TIMEOUT):
        while len(got) < len(want):
            frames = await sub.recv_multipart()
            assert len(frames) == 3
            assert int.from_bytes(frames[1], "big") == expect
            expect += 1
            if frames[2] != b"probe":
                got.append(frames)
    assert [f[2] for f in got] == want
    return got


async def replay(dealer: AsyncSocket, start: int) -> list[list[bytes]]:
    """Send a replay request and collect messages up to and including the end marker."""
    await dealer.send_multipart([b"", seq8(start)])
    out = []
    with trio.fail_after(TIMEOUT):
        while True:
            msg = await dealer.recv_multipart()
            out.append(msg)
            if END_SEQ in msg:
                return out


# -- pure helpers -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "endpoint,rank,expected",
    [
        ("tcp://*:5557", 0, "tcp://*:5557"),
        ("tcp://*:5557", 3, "tcp://*:5560"),
        ("tcp://10.0.0.1:5557", 1, "tcp://10.0.0.1:5558"),
        ("tcp://*:0", 2, "tcp://*:0"),
        ("inproc://cache", 0, "inproc://cache"),
        ("inproc://cache", 2, "inproc://cache_dp2"),
        ("ipc:///tmp/x.sock", 0, "ipc:///tmp/x.sock"),
        (None, 4, None),
    ],
)
def test_offset_endpoint_port(endpoint, rank, expected):
    assert offset_endpoint_port(endpoint, rank) == expected


def test_offset_endpoint_port_rejects_ipc_with_rank():
    with pytest.raises(ValueError):
        offset_endpoint_port("ipc:///tmp/x.sock", 1)


@pytest.mark.parametrize(
    "endpoint,bind",
    [
        ("tcp://*:5557", True),
        ("tcp://[::]:5557", True),
        ("ipc:///tmp/kv.sock", True),
        ("inproc://kv", True),
        ("tcp://127.0.0.1:5557", False),
        ("tcp://router.example:5557", False),
    ],
)
def test_bind_rule(endpoint, bind):
    assert is_bind_endpoint(endpoint) is bind


def test_socket_options(ctx, ipc):
    pub = KVEventPublisher(ipc("p"), replay_endpoint=ipc("r"), buffer_steps=7, hwm=123, context=ctx)
    try:
        assert pub._pub.socket.getsockopt(zmq.SNDHWM) == 123
        assert pub._pub.socket.getsockopt(zmq.RCVHWM) == 123
        assert pub._replay.socket.getsockopt(zmq.SNDHWM) == 2 * (7 + 1)
        assert pub.endpoint == ipc("p") and pub.replay_endpoint == ipc("r")
    finally:
        pub.close()


def test_dp_rank_offsets_both_endpoints(ctx):
    pub = KVEventPublisher("inproc://kv", replay_endpoint="inproc://rp", data_parallel_rank=2, context=ctx)
    try:
        assert pub.endpoint == "inproc://kv_dp2" and pub.replay_endpoint == "inproc://rp_dp2"
    finally:
        pub.close()


# -- PUB side -------------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("prefix", [b"", TOPIC.encode()])
async def test_pub_frames_and_seq_ipc(ctx, ipc, prefix):
    pub = KVEventPublisher(ipc("pub"), topic=TOPIC, context=ctx)
    sub = sub_socket(ctx, pub.endpoint, prefix)
    async with trio.open_nursery() as nursery:
        await nursery.start(pub.run)
        first = await join_sub(pub, sub)
        seqs = [pub.publish(p) for p in (b"a", b"b", b"c")]
        got = await recv_contiguous(sub, first, [b"a", b"b", b"c"])
        for frames, seq in zip(got, seqs):
            assert frames[0] == TOPIC.encode()
            assert frames[1] == seq8(seq) and len(frames[1]) == 8
        # seq comes from a counter starting at 0, one per publish(), probes included
        assert seqs == [pub.next_seq - 3, pub.next_seq - 2, pub.next_seq - 1]
        await trio.testing.wait_all_tasks_blocked()
        assert [s for s, _ in pub.buffered()] == list(range(pub.next_seq))
        nursery.cancel_scope.cancel()
    sub.close(0)


@pytest.mark.anyio
async def test_default_topic_is_empty_frame_tcp_star_zero(ctx):
    pub = KVEventPublisher("tcp://*:0", replay_endpoint="tcp://*:0", context=ctx)
    m = re.fullmatch(r"tcp://0\.0\.0\.0:(\d+)", pub.endpoint)
    assert m and int(m.group(1)) > 0
    rm = re.fullmatch(r"tcp://0\.0\.0\.0:(\d+)", pub.replay_endpoint)
    assert rm and int(rm.group(1)) > 0 and rm.group(1) != m.group(1)
    sub = sub_socket(ctx, f"tcp://127.0.0.1:{m.group(1)}")
    dealer = dealer_socket(ctx, f"tcp://127.0.0.1:{rm.group(1)}")
    async with trio.open_nursery() as nursery:
        await nursery.start(pub.run)
        first = await join_sub(pub, sub)
        pub.publish(b"x")
        (frames,) = await recv_contiguous(sub, first, [b"x"])
        assert frames[0] == b""
        await trio.testing.wait_all_tasks_blocked()  # the drain task has buffered it too
        msgs = await replay(dealer, 0)
        assert [m[3] for m in msgs[:-1]][-1] == b"x"
        nursery.cancel_scope.cancel()
    sub.close(0)
    dealer.close(0)


@pytest.mark.anyio
async def test_connect_mode_dials_a_bound_subscriber(ctx):
    """A plain tcp://host:port endpoint makes the publisher connect (vLLM dials out)."""
    sub = sub_socket(ctx, "tcp://127.0.0.1:0", bind=True)
    port = sub.socket.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
    pub = KVEventPublisher(f"tcp://127.0.0.1:{port}", topic=TOPIC, context=ctx)
    assert pub.endpoint == f"tcp://127.0.0.1:{port}"
    async with trio.open_nursery() as nursery:
        await nursery.start(pub.run)
        first = await join_sub(pub, sub)
        pub.publish(b"hello")
        (frames,) = await recv_contiguous(sub, first, [b"hello"])
        assert frames[0] == TOPIC.encode()
        nursery.cancel_scope.cancel()
    sub.close(0)


# -- replay ---------------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("version,with_topic", [("0.33.0", True), ("0.23.0", False), ("0.11.0", False)])
async def test_replay_layout_matches_golden(ctx, ipc, version, with_topic):
    g = golden_zmq(version)
    payloads = [bytes.fromhex(h) for h in g["pub_payloads_hex"]]
    pub = KVEventPublisher(
        ipc("pub"), replay_endpoint=ipc("rep"), topic=TOPIC, replay_with_topic=with_topic, context=ctx
    )
    dealer = dealer_socket(ctx, pub.replay_endpoint)
    async with trio.open_nursery() as nursery:
        await nursery.start(pub.run)
        assert [pub.publish(p) for p in payloads] == [0, 1, 2]
        await trio.testing.wait_all_tasks_blocked()
        assert pub.sent == 3
        msgs = await replay(dealer, 1)  # the golden request: DEALER sends [b"", (1).to_bytes(8)]
        nursery.cancel_scope.cancel()
    dealer.close(0)

    expected = g["replay_messages_seen_by_dealer"]
    assert len(msgs) == len(expected)
    for msg, exp, payload in zip(msgs, expected, payloads[1:] + [b""]):
        assert len(msg) == exp["n_frames"]
        for frame, want in zip(msg, exp["frames_hex_or_len"]):
            if want.startswith("<"):
                assert frame == payload and f"<{len(frame)} bytes payload>" == want
            else:
                assert frame.hex() == want
    if with_topic:
        assert msgs[-1] == [b"", b"", END_SEQ, b""]
    else:
        assert msgs[-1] == [b"", END_SEQ, b""]


@pytest.mark.anyio
async def test_malformed_replay_requests_are_ignored(ctx, ipc):
    pub = KVEventPublisher(ipc("pub"), replay_endpoint=ipc("rep"), topic=TOPIC, context=ctx)
    dealer = dealer_socket(ctx, pub.replay_endpoint)
    async with trio.open_nursery() as nursery:
        await nursery.start(pub.run)
        for p in (b"p0", b"p1", b"p2"):
            pub.publish(p)
        await trio.testing.wait_all_tasks_blocked()  # all three sent and buffered
        await dealer.send_multipart([seq8(0)])  # no delimiter: 2 frames at the ROUTER
        await dealer.send_multipart([b"", seq8(0), b"extra"])  # 4 frames
        await dealer.send_multipart([b"", b"", seq8(0), b""])  # 5 frames
        # If any of those had been answered, its replies would arrive before these (ROUTER is FIFO).
        msgs = await replay(dealer, 2)
        assert msgs == [[b"", TOPIC.encode(), seq8(2), b"p2"], [b"", b"", END_SEQ, b""]]
        # ... and the socket keeps working
        msgs = await replay(dealer, 0)
        assert [m[2] for m in msgs] == [seq8(0), seq8(1), seq8(2), END_SEQ]
        nursery.cancel_scope.cancel()
    dealer.close(0)


@pytest.mark.anyio
async def test_req_socket_is_a_valid_three_frame_request(ctx, ipc):
    """REQ sends [id, b"", start]: valid. It gets the first reply only (vLLM's behaviour, spec §1.2)."""
    pub = KVEventPublisher(ipc("pub"), replay_endpoint=ipc("rep"), replay_with_topic=False, context=ctx)
    req = ctx.socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(pub.replay_endpoint)
    areq = AsyncSocket(req)
    async with trio.open_nursery() as nursery:
        await nursery.start(pub.run)
        pub.publish(b"only")
        pub.publish(b"second")
        await trio.testing.wait_all_tasks_blocked()
        await areq.send_multipart([seq8(0)])
        with trio.fail_after(TIMEOUT):
            assert await areq.recv_multipart() == [seq8(0), b"only"]
        nursery.cancel_scope.cancel()
    areq.close(0)


@pytest.mark.anyio
async def test_ring_buffer_keeps_last_buffer_steps_and_seq_increases(ctx, ipc):
    pub = KVEventPublisher(ipc("pub"), replay_endpoint=ipc("rep"), buffer_steps=3, context=ctx)
    dealer = dealer_socket(ctx, pub.replay_endpoint)
    async with trio.open_nursery() as nursery:
        await nursery.start(pub.run)
        seqs = [pub.publish(b"m%d" % i) for i in range(10)]
        assert seqs == list(range(10))
        await trio.testing.wait_all_tasks_blocked()
        msgs = await replay(dealer, 0)
        assert [(m[2], m[3]) for m in msgs[:-1]] == [(seq8(i), b"m%d" % i) for i in (7, 8, 9)]
        assert [m[2] for m in await replay(dealer, 9)] == [seq8(9), END_SEQ]
        assert [m[2] for m in await replay(dealer, 10)] == [END_SEQ]  # nothing newer: just the marker
        assert [pub.publish(b"more") for _ in range(2)] == [10, 11]
        await trio.testing.wait_all_tasks_blocked()
        msgs = await replay(dealer, 0)
        assert [m[2] for m in msgs] == [seq8(9), seq8(10), seq8(11), END_SEQ]
        nursery.cancel_scope.cancel()
    dealer.close(0)


@pytest.mark.anyio
async def test_full_queue_drops_with_count_and_leaves_a_gap(ctx, ipc):
    pub = KVEventPublisher(ipc("pub"), replay_endpoint=ipc("rep"), max_queue_size=2, context=ctx)
    dealer = dealer_socket(ctx, pub.replay_endpoint)
    # run() not started yet: the queue fills up and publish() must not block
    assert [pub.publish(b"q%d" % i) for i in range(5)] == [0, 1, None, None, None]
    assert pub.dropped == 3 and pub.queue_size == 2
    async with trio.open_nursery() as nursery:
        await nursery.start(pub.run)
        await trio.testing.wait_all_tasks_blocked()  # the drain task emptied the queue
        assert pub.publish(b"after") == 5
        await trio.testing.wait_all_tasks_blocked()
        msgs = await replay(dealer, 0)
        assert [m[2] for m in msgs] == [seq8(0), seq8(1), seq8(5), END_SEQ]
        nursery.cancel_scope.cancel()
    dealer.close(0)


@pytest.mark.anyio
@pytest.mark.parametrize("lost", [False, True])
async def test_dropped_batches_leave_a_gap_and_stay_replayable_unless_lost(ctx, ipc, lost):
    """--sim-kv-drop-every / --sim-kv-drop-seqs: the batch never reaches the SUB; without
    --sim-kv-drop-lost a replay still has it, with it the replay buffer has the gap too."""
    pub = KVEventPublisher(ipc("pub"), replay_endpoint=ipc("rep"), context=ctx, drop_every=4,
                           drop_seqs=frozenset({5}), drop_lost=lost)
    sub = sub_socket(ctx, pub.endpoint)
    dealer = dealer_socket(ctx, pub.replay_endpoint)
    async with trio.open_nursery() as nursery:
        await nursery.start(pub.run)
        await join_sub(pub, sub)  # probes, some of them dropped on purpose too
        start, end = pub.next_seq, pub.next_seq + 12
        for i in range(start, end):
            pub.publish(b"m%d" % i)
        dropped = {s for s in range(end) if s == 5 or s % 4 == 3}
        seen = []
        with trio.fail_after(TIMEOUT):
            while not seen or seen[-1] < max(set(range(end)) - dropped):
                seen.append(int.from_bytes((await sub.recv_multipart())[1], "big"))
        assert [s for s in seen if s >= start] == [s for s in range(start, end) if s not in dropped]
        assert pub.skipped == len(dropped)
        msgs = await replay(dealer, 0)
        replayed = [int.from_bytes(m[2], "big") for m in msgs[:-1]]
        assert replayed == [s for s in range(end) if not (lost and s in dropped)]
        nursery.cancel_scope.cancel()
    sub.close(0)
    dealer.close(0)


@pytest.mark.anyio
async def test_delayed_batches_arrive_in_order_no_sooner_than_the_delay(ctx, ipc):
    """--sim-kv-events-delay-ms: every batch reaches the PUB socket that long after publish()."""
    pub = KVEventPublisher(ipc("pub"), context=ctx, delay_s=0.2)
    sub = sub_socket(ctx, pub.endpoint)
    async with trio.open_nursery() as nursery:
        await nursery.start(pub.run)
        first = await join_sub(pub, sub)
        t0 = trio.current_time()
        want = [b"a", b"b", b"c"]
        for payload in want:
            pub.publish(payload)
        got = await recv_contiguous(sub, first, want)  # in order, trailing probes skipped
        assert [f[2] for f in got] == want
        assert trio.current_time() - t0 >= 0.2
        nursery.cancel_scope.cancel()
    sub.close(0)
    with pytest.raises(ValueError):
        KVEventPublisher(ipc("pub2"), context=ctx, delay_s=-1.0)


# -- lifecycle ------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_graceful_stop_drains_then_closes(ctx, ipc):
    pub = KVEventPublisher(ipc("pub"), replay_endpoint=ipc("rep"), context=ctx)
    async with trio.open_nursery() as nursery:
        await nursery.start(pub.run)
        for i in range(100):
            pub.publish(b"%d" % i)
        assert pub.sent < 100  # nothing has been drained yet: stop() has to do it
        assert await pub.stop() is True
        assert pub.sent == 100 and pub.queue_size == 0
    assert pub._pub.socket.closed and pub._replay.socket.closed
    with pytest.raises(RuntimeError):
        pub.publish(b"late")
    # the ipc endpoint can be bound again right away
    KVEventPublisher(ipc("pub"), replay_endpoint=ipc("rep"), context=ctx).close()


@pytest.mark.anyio
async def test_stop_before_run_reports_undrained(ctx, ipc):
    pub = KVEventPublisher(ipc("pub"), context=ctx)
    assert pub.publish(b"x") == 0
    assert await pub.stop() is False  # never run: nothing could be sent
    assert pub._pub.socket.closed


@pytest.mark.anyio
async def test_cancellation_closes_sockets_and_owned_context(tmp_path):
    pub = KVEventPublisher(f"ipc://{tmp_path}/p", replay_endpoint=f"ipc://{tmp_path}/r")
    async with trio.open_nursery() as nursery:
        await nursery.start(pub.run)
        pub.publish(b"x")
        nursery.cancel_scope.cancel()
    assert pub._pub.socket.closed and pub._replay.socket.closed and pub._ctx.closed
    with pytest.raises(RuntimeError):
        await pub.run()


@pytest.mark.anyio
async def test_close_while_running_ends_run_quietly(ctx, ipc):
    pub = KVEventPublisher(ipc("pub"), replay_endpoint=ipc("rep"), context=ctx)
    async with trio.open_nursery() as nursery:
        await nursery.start(pub.run)
        await trio.testing.wait_all_tasks_blocked()  # both tasks parked on their sockets
        pub.close()
    assert pub._pub.socket.closed


# -- zmqio adapter --------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_zmqio_pub_never_blocks_at_hwm(ctx, ipc):
    pub_s = ctx.socket(zmq.PUB)
    pub_s.set_hwm(1)
    pub_s.bind(ipc("hwm"))
    sub = sub_socket(ctx, ipc("hwm"))  # connected, never reads
    pub = AsyncSocket(pub_s)
    with trio.fail_after(TIMEOUT):
        for i in range(10_000):
            await pub.send_multipart([b"", seq8(i), b"x" * 100])
    pub.close(0)
    sub.close(0)


@pytest.mark.anyio
async def test_zmqio_dealer_waits_for_pollout_and_recv_roundtrip(ctx, ipc):
    """A DEALER with no peer has no POLLOUT: send waits until a peer binds, then goes through."""
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.setsockopt(zmq.IMMEDIATE, 1)  # no pipe (no POLLOUT) until connected
    d.connect(ipc("late"))
    dealer = AsyncSocket(d)
    sent = trio.Event()

    async def sender():
        await dealer.send_multipart([b"hi"])
        sent.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sender)
        await trio.testing.wait_all_tasks_blocked()
        assert not sent.is_set()
        r = ctx.socket(zmq.ROUTER)
        r.setsockopt(zmq.LINGER, 0)
        r.bind(ipc("late"))
        router = AsyncSocket(r)
        with trio.fail_after(TIMEOUT):
            ident, body = await router.recv_multipart()
            assert body == b"hi"
            await router.send_multipart([ident, b"back"])
            await sent.wait()
            assert await dealer.recv_multipart() == [b"back"]
    router.close(0)
    dealer.close(0)


@pytest.mark.anyio
async def test_zmqio_two_waiters_busy_and_close_wakes_waiter(ctx, ipc):
    s = ctx.socket(zmq.PULL)
    s.bind(ipc("busy"))
    sock = AsyncSocket(s)
    results = []

    async def waiter():
        try:
            await sock.recv_multipart()
        except (trio.BusyResourceError, trio.ClosedResourceError) as exc:
            results.append(type(exc))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        assert results == [trio.BusyResourceError]
        sock.close(0)  # wakes the parked owner
    assert results == [trio.BusyResourceError, trio.ClosedResourceError]
    with pytest.raises(trio.ClosedResourceError):
        await sock.recv_multipart()


@pytest.mark.anyio
async def test_zmqio_cancel_does_not_lose_messages(ctx, ipc):
    push_s, pull_s = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    pull_s.bind(ipc("c"))
    push_s.connect(ipc("c"))
    push, pull = AsyncSocket(push_s), AsyncSocket(pull_s)
    with trio.move_on_after(0.01):
        await pull.recv_multipart()  # cancelled while parked: nothing consumed
    for i in range(200):
        await push.send_multipart([b"%d" % i])
    got = []
    with trio.fail_after(TIMEOUT):
        while len(got) < 200:
            got.append((await pull.recv_multipart())[0])
    assert got == [b"%d" % i for i in range(200)]
    push.close(0)
    pull.close(0)
