"""llmgw.daemon.net.upstream against tiny raw trio servers that misbehave on purpose,
and against the real simulator."""

from __future__ import annotations

import functools
import json
import re
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing

from llmgw.daemon.net.upstream import (UpstreamClosed, UpstreamConnectError, UpstreamError, UpstreamPool,
                                   UpstreamProtocolError, UpstreamTimeout)

TIMEOUT = 10


# ------------------------------------------------------------------------------ raw servers
class Peer:
    """The server side of one connection: read requests, write raw bytes."""

    def __init__(self, stream: trio.SocketStream, index: int) -> None:
        self.stream, self.index, self.buf = stream, index, b""

    async def read_request(self) -> tuple[bytes, bytes] | None:
        """(head, body) of the next request, or None at EOF."""
        while b"\r\n\r\n" not in self.buf:
            data = await self.receive()
            if not data:
                return None
            self.buf += data
        head, _, rest = self.buf.partition(b"\r\n\r\n")
        m = re.search(rb"(?i)\r\ncontent-length: *([0-9]+)", head)
        n = int(m[1]) if m else 0
        while len(rest) < n:
            data = await self.receive()
            if not data:
                return None
            rest += data
        self.buf = rest[n:]
        return head, rest[:n]

    async def receive(self) -> bytes:
        try:
            return await self.stream.receive_some(65536)
        except trio.BrokenResourceError:
            return b""

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def wait_eof(self) -> None:
        """Until the client closes (any unread input is dropped)."""
        while await self.receive():
            pass

    async def reset(self) -> None:
        """Close with RST (SO_LINGER 0)."""
        self.stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        await self.stream.aclose()


Handler = Callable[[Peer], Awaitable[None]]


class Server:
    def __init__(self, port: int) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.connections = 0


@asynccontextmanager
async def raw_server(handler: Handler) -> AsyncIterator[Server]:
    server: Server

    async def serve(stream: trio.SocketStream) -> None:
        server.connections += 1
        peer = Peer(stream, server.connections - 1)
        try:
            await handler(peer)
        finally:
            await stream.aclose()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(functools.partial(trio.serve_tcp, serve, 0, host="127.0.0.1"))
        server = Server(listeners[0].socket.getsockname()[1])
        yield server
        nursery.cancel_scope.cancel()


def ok(body: bytes = b"ok", extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n%b\r\n%b" % (len(body), extra, body)


CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


async def serve_keepalive(peer: Peer) -> None:
    """Answer every request with its body echoed back, on one connection."""
    while (req := await peer.read_request()) is not None:
        await peer.send(ok(b"echo:" + req[1]))


pytestmark = pytest.mark.anyio


# ------------------------------------------------------------------------------ keep-alive
async def test_keepalive_reuse_one_connection_for_sequential_requests() -> None:
    async with raw_server(serve_keepalive) as srv, UpstreamPool() as pool:
        with trio.fail_after(TIMEOUT):
            for i in range(5):
                r = await pool.request(srv.url, "POST", "/x", [("content-type", "text/plain")], b"%d" % i)
                assert (r.status, r.body, r.header("Content-Length")) == (200, b"echo:%d" % i, str(len(r.body)))
        assert srv.connections == 1
        assert (pool.stats.connects, pool.stats.reused, pool.stats.aborted) == (1, 4, 0)
        assert pool.idle_count() == pool.idle_count(srv.url) == 1


async def test_request_bytes_on_the_wire_and_tcp_nodelay() -> None:
    seen: list[tuple[bytes, bytes]] = []

    async def handler(peer: Peer) -> None:
        req = await peer.read_request()
        assert req is not None
        seen.append(req)
        await peer.send(ok())

    async with raw_server(handler) as srv, UpstreamPool() as pool:
        with trio.fail_after(TIMEOUT):
            await pool.request(srv.url + "/prefix/", "POST", "/v1/completions",
                               [("content-type", "application/json"), ("x-request-id", "r1")], b"{}")
        [conn] = pool._idle[("127.0.0.1", srv.port)]
        assert conn.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    assert seen == [(b"POST /prefix/v1/completions HTTP/1.1\r\ncontent-type: application/json\r\n"
                     b"x-request-id: r1\r\nhost: 127.0.0.1:%d\r\ncontent-length: 2" % srv.port, b"{}")]


async def test_idle_connections_are_bounded_per_host_and_lifo() -> None:
    gate = trio.Event()

    async def handler(peer: Peer) -> None:
        while await peer.read_request() is not None:
            await gate.wait()
            await peer.send(ok())

    async with raw_server(handler) as srv, UpstreamPool(max_idle_per_host=2) as pool:
        with trio.fail_after(TIMEOUT):
            async with trio.open_nursery() as nursery:
                for _ in range(4):
                    nursery.start_soon(pool.request, srv.url, "GET", "/")
                await trio.testing.wait_all_tasks_blocked()
                gate.set()
            assert srv.connections == 4 and pool.idle_count(srv.url) == 2
            key = ("127.0.0.1", srv.port)
            older, newest = pool._idle[key]
            assert pool._checkout(key) is newest  # LIFO: the most recently used goes out first
            assert list(pool._idle[key]) == [older]


async def test_connection_close_and_http10_are_not_pooled() -> None:
    responses = [ok(extra=b"connection: close\r\n"), b"HTTP/1.0 200 OK\r\n\r\nuntil close"]

    async def handler(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(responses[peer.index])
        if peer.index == 1:
            await peer.stream.aclose()

    async with raw_server(handler) as srv, UpstreamPool() as pool:
        with trio.fail_after(TIMEOUT):
            assert (await pool.request(srv.url, "GET", "/")).body == b"ok"
            assert pool.idle_count() == 0
            assert (await pool.request(srv.url, "GET", "/")).body == b"until close"
            assert pool.idle_count() == 0
        assert pool.stats.aborted == 0


async def test_request_connection_close_header_is_honoured() -> None:
    async with raw_server(serve_keepalive) as srv, UpstreamPool() as pool:
        with trio.fail_after(TIMEOUT):
            await pool.request(srv.url, "GET", "/", [("Connection", "close")])
        assert pool.idle_count() == 0


async def test_head_request_and_interim_response() -> None:
    async def handler(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(b"HTTP/1.1 200 OK\r\ncontent-length: 1234\r\n\r\n")  # HEAD: no body follows
        await peer.read_request()
        await peer.send(b"HTTP/1.1 100 Continue\r\n\r\n" + ok(b"after 100"))

    async with raw_server(handler) as srv, UpstreamPool() as pool:
        with trio.fail_after(TIMEOUT):
            r = await pool.request(srv.url, "HEAD", "/")
            assert (r.status, r.body, r.header("content-length")) == (200, b"", "1234")
            assert (await pool.request(srv.url, "GET", "/")).body == b"after 100"
        assert srv.connections == 1


async def test_large_request_body_waits_for_a_slow_reader() -> None:
    body = bytes(range(256)) * 16384  # 4 MiB: more than the socket buffers hold

    async def handler(peer: Peer) -> None:
        await trio.sleep(0.05)  # the client fills the buffers and has to wait for writability
        req = await peer.read_request()
        assert req is not None
        await peer.send(ok(b"%d %d" % (len(req[1]), hash(req[1]) == hash(body))))

    async with raw_server(handler) as srv, UpstreamPool() as pool:
        with trio.fail_after(TIMEOUT):
            r = await pool.request(srv.url, "POST", "/big", [], body)
        assert r.body == b"%d 1" % len(body)


# ------------------------------------------------------------------------------ streaming
async def test_chunked_pieces_arrive_as_sent() -> None:
    got_first = trio.Event()
    sent_second = trio.Event()

    async def handler(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(CHUNKED_HEAD + chunk(b"data: one\n\n"))
        await got_first.wait()  # the client must have the first piece before the second exists
        await peer.send(chunk(b"data: two\n\n") + chunk(b"data: three\n\n"))
        sent_second.set()
        await peer.send(b"0\r\n\r\n")
        await peer.read_request()  # keep-alive: the next request on this connection
        await peer.send(ok())

    async with raw_server(handler) as srv, UpstreamPool() as pool:
        with trio.fail_after(TIMEOUT):
            pieces = []
            async with pool.stream(srv.url, "POST", "/v1/completions", [], b"{}") as resp:
                assert resp.status == 200 and resp.header("Content-Type") == "text/event-stream"
                async for piece in resp.iter_body():
                    if not pieces:
                        assert not sent_second.is_set()
                        got_first.set()
                    pieces.append(piece)
            assert pieces[0] == b"data: one\n\n"
            assert b"".join(pieces) == b"data: one\n\ndata: two\n\ndata: three\n\n"
            assert resp.complete and pool.idle_count() == 1  # read to the end: back in the pool
            assert (await pool.request(srv.url, "GET", "/")).body == b"ok"
        assert srv.connections == 1


async def test_leaving_early_closes_the_connection() -> None:
    eof = trio.Event()

    async def handler(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(CHUNKED_HEAD + chunk(b"data: one\n\n"))
        await peer.wait_eof()
        eof.set()

    async with raw_server(handler) as srv, UpstreamPool() as pool:
        with trio.fail_after(TIMEOUT):
            async with pool.stream(srv.url, "POST", "/", [], b"{}") as resp:
                async for _ in resp.iter_body():
                    break
            assert not resp.complete
            await eof.wait()
        assert pool.idle_count() == 0 and pool.stats.aborted == 1


async def test_cancelling_the_consumer_closes_the_upstream_connection() -> None:
    eof = trio.Event()
    streaming = trio.Event()

    async def handler(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(CHUNKED_HEAD + chunk(b"data: one\n\n"))
        streaming.set()
        await peer.wait_eof()  # the engine notices its client left
        eof.set()

    async def consumer(pool: UpstreamPool, url: str, pieces: list[bytes]) -> None:
        async with pool.stream(url, "POST", "/", [], b"{}") as resp:
            async for piece in resp.iter_body():
                pieces.append(piece)  # then parks in the next read until cancelled

    async with raw_server(handler) as srv, UpstreamPool() as pool:
        with trio.fail_after(TIMEOUT):
            pieces: list[bytes] = []
            async with trio.open_nursery() as nursery:
                nursery.start_soon(consumer, pool, srv.url, pieces)
                await streaming.wait()
                await trio.testing.wait_all_tasks_blocked()
                nursery.cancel_scope.cancel()  # the router's client disconnected
            await eof.wait()
        assert pieces == [b"data: one\n\n"]
        assert pool.idle_count() == 0 and pool.stats.aborted == 1 and not pool._active


async def test_cancelled_while_waiting_for_the_head_closes_too() -> None:
    eof = trio.Event()

    async def handler(peer: Peer) -> None:
        await peer.read_request()
        await peer.wait_eof()
        eof.set()

    async with raw_server(handler) as srv, UpstreamPool() as pool:
        with trio.fail_after(TIMEOUT):
            with trio.move_on_after(0.05):
                async with pool.stream(srv.url, "POST", "/", [], b"{}"):
                    raise AssertionError("no head was sent")  # pragma: no cover
            await eof.wait()
        assert pool.idle_count() == 0 and not pool._active


# ------------------------------------------------------------------------------ stale connections
def test_idle_connection_closed_by_server_is_detected_or_retried() -> None:
    async def main() -> None:
        closed = [trio.Event() for _ in range(3)]

        async def handler(peer: Peer) -> None:
            await peer.read_request()
            await peer.send(ok())
            await peer.stream.aclose()  # the server's keep-alive timeout, right after responding
            closed[peer.index].set()

        async with raw_server(handler) as srv, UpstreamPool() as pool:
            await pool.request(srv.url, "GET", "/")
            await closed[0].wait()
            await trio.sleep(2)  # idle long enough to be checked (a peek) before reuse
            assert (await pool.request(srv.url, "GET", "/")).body == b"ok"
            assert srv.connections == 2
            assert (pool.stats.stale_dropped, pool.stats.stale_retries) == (1, 0)
            # Reused at once: not checked, so the dead connection is found by the
            # request itself, which is resent on a fresh connection.
            await closed[1].wait()
            assert (await pool.request(srv.url, "GET", "/")).body == b"ok"
            assert srv.connections == 3
            assert (pool.stats.stale_dropped, pool.stats.stale_retries) == (1, 1)

    run_mock(main)


@pytest.mark.parametrize("how", ["eof", "reset"])
async def test_stale_reused_connection_is_retried_once_transparently(how: str) -> None:
    async def handler(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(ok())
        if peer.index == 0:
            # The race the peek can't see: the server closes the idle connection
            # just as the next request arrives, without answering it.
            await peer.read_request()
            if how == "reset":
                await peer.reset()
            return
        await serve_keepalive(peer)

    async with raw_server(handler) as srv, UpstreamPool() as pool:
        with trio.fail_after(TIMEOUT):
            await pool.request(srv.url, "POST", "/", [], b"a")
            r = await pool.request(srv.url, "POST", "/", [], b"b")
            assert (r.status, r.body) == (200, b"ok")
        assert srv.connections == 2
        assert pool.stats.stale_retries == 1 and pool.stats.aborted == 0


async def test_stale_retry_happens_only_once() -> None:
    async def handler(peer: Peer) -> None:
        if peer.index == 0:
            await peer.read_request()
            await peer.send(ok())
        await peer.read_request()  # every later request: closed unanswered

    async with raw_server(handler) as srv, UpstreamPool() as pool:
        with trio.fail_after(TIMEOUT):
            await pool.request(srv.url, "GET", "/")
            with pytest.raises(UpstreamClosed) as ei:
                await pool.request(srv.url, "GET", "/")
        assert ei.value.received is False
        assert srv.connections == 2 and pool.stats.stale_retries == 1


async def test_fresh_connection_closed_before_response_is_not_retried() -> None:
    async def handler(peer: Peer) -> None:
        await peer.read_request()

    async with raw_server(handler) as srv, UpstreamPool() as pool:
        with trio.fail_after(TIMEOUT):
            with pytest.raises(UpstreamClosed) as ei:
                await pool.request(srv.url, "GET", "/")
        assert ei.value.received is False and ei.value.url == srv.url
        assert srv.connections == 1 and pool.stats.stale_retries == 0


async def test_no_retry_once_a_response_byte_arrived() -> None:
    async def handler(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(ok())
        await peer.read_request()
        await peer.send(b"HTTP/1.1 200 O")  # a partial head, then gone

    async with raw_server(handler) as srv, UpstreamPool() as pool:
        with trio.fail_after(TIMEOUT):
            await pool.request(srv.url, "GET", "/")
            with pytest.raises(UpstreamClosed) as ei:
                await pool.request(srv.url, "GET", "/")
        assert ei.value.received is True
        assert srv.connections == 1 and pool.stats.stale_retries == 0


# ------------------------------------------------------------------------------ broken upstreams
@pytest.mark.parametrize("how", ["reset", "eof"])
async def test_upstream_gone_mid_stream_is_upstream_closed_received(how: str) -> None:
    async def handler(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(CHUNKED_HEAD + chunk(b"data: one\n\n"))
        await trio.testing.wait_all_tasks_blocked()
        if how == "reset":
            await peer.reset()

    async with raw_server(handler) as srv, UpstreamPool() as pool:
        with trio.fail_after(TIMEOUT):
            pieces = []
            with pytest.raises(UpstreamClosed) as ei:
                async with pool.stream(srv.url, "POST", "/", [], b"{}") as resp:
                    async for piece in resp.iter_body():
                        pieces.append(piece)
        assert pieces == [b"data: one\n\n"]
        assert ei.value.received is True
        assert pool.idle_count() == 0 and pool.stats.aborted == 1


async def test_truncated_content_length_body() -> None:
    async def handler(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc")

    async with raw_server(handler) as srv, UpstreamPool() as pool:
        with trio.fail_after(TIMEOUT), pytest.raises(UpstreamClosed, match="mid-response") as ei:
            await pool.request(srv.url, "GET", "/")
        assert ei.value.received


@pytest.mark.parametrize("reply", [
    b"garbage garbage\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nbad header line\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",  # a TLS server
])
async def test_garbage_head_is_a_protocol_error(reply: bytes) -> None:
    async def handler(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(reply)
        await peer.wait_eof()

    async with raw_server(handler) as srv, UpstreamPool() as pool:
        with trio.fail_after(TIMEOUT), pytest.raises(UpstreamProtocolError) as ei:
            await pool.request(srv.url, "GET", "/")
        assert ei.value.received is True
        assert pool.idle_count() == 0


async def test_garbage_mid_body_is_a_protocol_error() -> None:
    async def handler(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(CHUNKED_HEAD + chunk(b"fine"))
        await trio.testing.wait_all_tasks_blocked()
        await peer.send(b"zz\r\nnot a chunk")
        await peer.wait_eof()

    async with raw_server(handler) as srv, UpstreamPool() as pool:
        with trio.fail_after(TIMEOUT):
            pieces = []
            async with pool.stream(srv.url, "GET", "/") as resp:
                with pytest.raises(UpstreamProtocolError):
                    async for piece in resp.iter_body():
                        pieces.append(piece)
                with pytest.raises(UpstreamProtocolError):  # stays failed
                    await resp.read()
        assert pieces == [b"fine"] and pool.stats.aborted == 1


async def test_request_max_body_bytes() -> None:
    async def handler(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(ok(b"x" * 1000))  # complete with the head: the connection stays usable
        await peer.read_request()
        await peer.send(CHUNKED_HEAD + chunk(b"x" * 80))
        await trio.testing.wait_all_tasks_blocked()
        await peer.send(chunk(b"x" * 80))  # over the limit before the body ended
        await peer.wait_eof()

    async with raw_server(handler) as srv, UpstreamPool() as pool:
        with trio.fail_after(TIMEOUT):
            with pytest.raises(UpstreamProtocolError, match="exceeds"):
                await pool.request(srv.url, "GET", "/", max_body_bytes=100)
            assert pool.idle_count() == 1
            with pytest.raises(UpstreamProtocolError, match="exceeds"):
                await pool.request(srv.url, "GET", "/", max_body_bytes=100)
            assert pool.idle_count() == 0


async def test_connect_refused() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    async with UpstreamPool() as pool:
        with trio.fail_after(TIMEOUT), pytest.raises(UpstreamConnectError) as ei:
            await pool.request(f"http://127.0.0.1:{port}", "GET", "/")
    assert ei.value.received is False and isinstance(ei.value, UpstreamError)
    assert pool.stats.connect_errors == 1


async def test_bad_requests_raise_value_error_before_connecting() -> None:
    async with UpstreamPool() as pool:
        with pytest.raises(ValueError):
            await pool.request("http://127.0.0.1:1", "GET", "/", [("x", "a\r\nb: c")])
    assert pool.stats.connects == 0
    with pytest.raises(RuntimeError, match="async with"):
        pool.stream("http://127.0.0.1:1", "GET", "/")


@pytest.mark.parametrize("url", ["https://127.0.0.1:1", "ftp://x", "http://[::1", "http://", "http://h:99999"])
async def test_an_unusable_url_is_a_connect_error(url: str) -> None:
    # An engine's URL comes from outside (an agent's report): one that cannot be dialled fails
    # like a refused connection, which the router's retry and breaker handle, not as a bug.
    async with UpstreamPool() as pool:
        with pytest.raises(UpstreamConnectError, match="unusable upstream URL") as ei:
            await pool.request(url, "GET", "/")
        with pytest.raises(UpstreamConnectError):
            async with pool.stream(url, "POST", "/v1/completions", body=b"{}"):
                pass
    assert ei.value.received is False and ei.value.url == url and ei.value.public == "connection failed"
    assert pool.stats.connects == 0 and pool.stats.connect_errors == 2


# ------------------------------------------------------------------------------ timeouts (MockClock)
def run_mock(fn: Callable[[], Awaitable[Any]]) -> Any:
    return trio.run(fn, clock=trio.testing.MockClock(autojump_threshold=0))


def test_first_byte_timeout() -> None:
    async def main() -> None:
        eof = trio.Event()

        async def handler(peer: Peer) -> None:
            await peer.read_request()
            await peer.wait_eof()  # a prefill that never ends
            eof.set()

        async with raw_server(handler) as srv, UpstreamPool(timer_resolution=0.1) as pool:
            t0 = trio.current_time()
            with pytest.raises(UpstreamTimeout) as ei:
                await pool.request(srv.url, "POST", "/", [], b"{}", first_byte_timeout=30, idle_timeout=1)
            assert 30 <= trio.current_time() - t0 <= 30.2
            assert (ei.value.phase, ei.value.received) == ("first_byte", False)
            with trio.fail_after(1):
                await eof.wait()  # the engine sees the request abandoned
            assert pool.stats.timeouts == 1 and not pool._active

    run_mock(main)


def test_long_prefill_within_first_byte_deadline_then_idle_timeout() -> None:
    async def main() -> None:
        eof = trio.Event()

        async def handler(peer: Peer) -> None:
            await peer.read_request()
            await trio.sleep(50)  # prefill: longer than the idle timeout, shorter than first-byte
            await peer.send(CHUNKED_HEAD)
            await trio.sleep(3)
            await peer.send(chunk(b"data: one\n\n"))
            await trio.sleep(3)
            await peer.send(chunk(b"data: two\n\n"))
            await peer.wait_eof()  # then stalls
            eof.set()

        async with raw_server(handler) as srv, UpstreamPool() as pool:
            pieces = []
            with pytest.raises(UpstreamTimeout) as ei:
                async with pool.stream(srv.url, "POST", "/", [], b"{}", first_byte_timeout=60,
                                       idle_timeout=5) as resp:
                    t0 = trio.current_time()
                    async for piece in resp.iter_body():
                        pieces.append(piece)
            assert 5 + 6 <= trio.current_time() - t0 <= 5 + 6 + 0.2
            assert pieces == [b"data: one\n\n", b"data: two\n\n"]
            assert (ei.value.phase, ei.value.received) == ("idle", True)
            with trio.fail_after(1):
                await eof.wait()

    run_mock(main)


def test_idle_timeout_inside_the_head() -> None:
    async def main() -> None:
        async def handler(peer: Peer) -> None:
            await peer.read_request()
            await peer.send(b"HTTP/1.1 200 OK\r\n")
            await peer.wait_eof()

        async with raw_server(handler) as srv, UpstreamPool() as pool:
            with pytest.raises(UpstreamTimeout) as ei:
                await pool.request(srv.url, "GET", "/", first_byte_timeout=100, idle_timeout=2)
            assert (ei.value.phase, ei.value.received) == ("idle", True)

    run_mock(main)


def test_idle_connections_expire() -> None:
    async def handler(peer: Peer) -> None:
        while (req := await peer.read_request()) is not None:
            if b" /slow " in req[0]:
                await trio.sleep(1)  # both requests in flight at once: two connections
            await peer.send(ok())

    async def main() -> None:
        async with raw_server(handler) as srv, UpstreamPool(keepalive_expiry=4) as pool:
            await pool.request(srv.url, "GET", "/")
            await trio.sleep(3)
            await pool.request(srv.url, "GET", "/")
            assert pool.stats.connects == 1
            await trio.sleep(5)
            await pool.request(srv.url, "GET", "/")
            assert pool.stats.connects == 2 and pool.stats.expired == 1

            # Light traffic reuses the top of the stack: the bottom expires on release.
            async with trio.open_nursery() as nursery:
                nursery.start_soon(pool.request, srv.url, "GET", "/slow")
                nursery.start_soon(pool.request, srv.url, "GET", "/slow")
            assert pool.idle_count() == 2 and srv.connections == 3
            for _ in range(3):
                await trio.sleep(3)
                await pool.request(srv.url, "GET", "/")
            assert pool.idle_count() == 1 and pool.stats.expired == 2

    run_mock(main)


async def test_connect_timeout() -> None:
    # A listener whose accept queue is full drops SYNs, so connect() hangs.
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(0)
    port = lsock.getsockname()[1]
    fillers = []
    try:
        for _ in range(8):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            fillers.append(s)
        async with UpstreamPool() as pool:
            with trio.fail_after(TIMEOUT), pytest.raises(UpstreamTimeout) as ei:
                await pool.request(f"http://127.0.0.1:{port}", "GET", "/", connect_timeout=0.2,
                                   first_byte_timeout=0.2)
        if ei.value.phase != "connect":  # pragma: no cover - a kernel that completed the handshake anyway
            pytest.skip("the kernel accepted the connection despite the full backlog")
        assert ei.value.received is False and pool.stats.connect_errors == 1
    finally:
        for s in fillers:
            s.close()
        lsock.close()


# ------------------------------------------------------------------------------ the simulator
async def test_against_the_simulator(vllm_sim: Any) -> None:
    body = json.dumps({"model": "sim-model", "prompt": "x", "max_tokens": 5, "ignore_eos": True,
                       "stream": True}).encode()
    async with UpstreamPool() as pool:
        with trio.fail_after(TIMEOUT):
            for _ in range(3):
                async with pool.stream(vllm_sim.url, "POST", "/v1/completions",
                                       [("content-type", "application/json")], body,
                                       first_byte_timeout=30, idle_timeout=10) as resp:
                    assert resp.status == 200
                    assert (resp.header("content-type") or "").startswith("text/event-stream")
                    text = (await resp.read()).decode()
                events = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
                assert events[-1] == "[DONE]"
                assert len(events) >= 6
                assert "".join(c["text"] for e in events[:-1] for c in json.loads(e)["choices"])
            r = await pool.request(vllm_sim.url, "POST", "/v1/completions", [("content-type", "application/json")],
                                   json.dumps({"model": "sim-model", "prompt": "x", "max_tokens": 3}).encode())
            assert r.status == 200 and r.json()["usage"]["completion_tokens"] == 3
            m = await pool.request(vllm_sim.url, "GET", "/metrics")
            assert m.status == 200 and b"vllm:num_requests_running" in m.body
        assert pool.stats.connects == 1 and pool.stats.aborted == 0


# ------------------------------------------------------------------------------ lifecycle
async def test_pool_lifecycle_and_unwrapped_errors() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # The caller's exceptions leave `async with pool` as themselves (no ExceptionGroup).
    with pytest.raises(UpstreamConnectError):
        async with UpstreamPool() as pool:
            await pool.request(f"http://127.0.0.1:{port}", "GET", "/")
    assert pool._sweeper is None
    with pytest.raises(RuntimeError, match="async with"):
        pool.stream(f"http://127.0.0.1:{port}", "GET", "/")

    async with raw_server(serve_keepalive) as srv:
        pool = UpstreamPool()
        async with pool:
            with trio.fail_after(TIMEOUT):
                async with pool.stream(srv.url, "GET", "/") as resp:
                    assert resp.status == 200
                    await pool.aclose()  # closes idle connections; this response keeps its own
                    assert await resp.read() == b"echo:"
        assert pool.idle_count() == 0  # released after close: closed instead of pooled
        async with pool:  # can be opened again
            with trio.fail_after(TIMEOUT):
                r = await pool.request(srv.url, "POST", "/", [], b'"x"')
                assert r.body == b'echo:"x"'


# ------------------------------------------------------------------------------ relay(sink)
class ListSink:
    """A BodySink that keeps what it gets; ``refuse`` pieces are reported as not taken
    (the relay must then wait in drain() before reading on)."""

    def __init__(self, refuse: int = 0, on_piece: Callable[[bytes], None] | None = None) -> None:
        self.pieces: list[bytes] = []
        self.refuse, self.on_piece = refuse, on_piece
        self.drains = self.flushes = self.refused = 0
        self.draining = self.owed = self.ended = False

    def send_nowait(self, data: bytes, end: bool = False) -> bool:
        assert (data or end) and not self.draining and not self.ended
        assert not self.owed, "sent on after a refusal without waiting in drain()"
        self.ended = end
        if data:
            self.pieces.append(data)
            if self.on_piece is not None:
                self.on_piece(data)
        if self.refuse:
            self.refuse -= 1
            self.refused += 1
            self.owed = True
            return False
        return True

    def flush_nowait(self) -> None:
        self.flushes += 1

    async def drain(self) -> None:
        self.drains += 1
        self.draining = True
        await trio.sleep(0.01)  # a slow client
        self.draining = self.owed = False


async def test_relay_writes_each_read_to_the_sink_and_keeps_the_connection() -> None:
    got_first = trio.Event()
    sent_second = trio.Event()

    async def handler(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(CHUNKED_HEAD + chunk(b"data: one\n\n"))
        await got_first.wait()  # the sink must have the first piece before the second exists
        await peer.send(chunk(b"data: two\n\n") + chunk(b"data: three\n\n"))
        sent_second.set()
        await trio.sleep(0.01)
        await peer.send(b"0\r\n\r\n")
        await peer.read_request()  # keep-alive: the next request on this connection
        await peer.send(ok())

    def on_piece(data: bytes) -> None:
        if not got_first.is_set():
            assert not sent_second.is_set()
            got_first.set()

    async with raw_server(handler) as srv, UpstreamPool() as pool:
        with trio.fail_after(TIMEOUT):
            sink = ListSink(on_piece=on_piece)
            async with pool.stream(srv.url, "POST", "/v1/completions", [], b"{}") as resp:
                assert resp.first_byte_at is None
                await resp.relay(sink)
                assert resp.first_byte_at is not None
            assert b"".join(sink.pieces) == b"data: one\n\ndata: two\n\ndata: three\n\n"
            assert sink.ended  # the end of the body went with its last bytes
            assert sink.flushes >= 1  # the head went before the body had to wait
            assert resp.complete and pool.idle_count() == 1 and not pool._active
            assert (await pool.request(srv.url, "GET", "/")).body == b"ok"
        assert srv.connections == 1 and pool.stats.aborted == 0


async def test_relay_waits_for_a_slow_sink_and_loses_nothing() -> None:
    pieces = [b"data: %d\n\n" % i for i in range(50)]

    async def handler(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(CHUNKED_HEAD)
        for p in pieces:
            await peer.send(chunk(p))
            await trio.sleep(0.001)
        await peer.send(b"0\r\n\r\n")
        await peer.wait_eof()

    async with raw_server(handler) as srv, UpstreamPool() as pool:
        with trio.fail_after(TIMEOUT):
            sink = ListSink(refuse=5)
            async with pool.stream(srv.url, "POST", "/", [], b"{}") as resp:
                await resp.relay(sink)
            assert b"".join(sink.pieces) == b"".join(pieces)
            assert sink.refused >= 1 and sink.drains >= sink.refused and resp.complete


async def test_relay_cancelled_closes_the_upstream_connection() -> None:
    eof = trio.Event()
    streaming = trio.Event()

    async def handler(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(CHUNKED_HEAD + chunk(b"data: one\n\n"))
        streaming.set()
        await peer.wait_eof()  # the engine notices its client left
        eof.set()

    async def consumer(pool: UpstreamPool, url: str, sink: ListSink) -> None:
        async with pool.stream(url, "POST", "/", [], b"{}") as resp:
            await resp.relay(sink)  # parked until cancelled

    async with raw_server(handler) as srv, UpstreamPool() as pool:
        with trio.fail_after(TIMEOUT):
            sink = ListSink()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(consumer, pool, srv.url, sink)
                await streaming.wait()
                await trio.testing.wait_all_tasks_blocked()
                nursery.cancel_scope.cancel()  # the router's client disconnected
            await eof.wait()
        assert sink.pieces == [b"data: one\n\n"]
        assert pool.idle_count() == 0 and pool.stats.aborted == 1 and not pool._active
        assert pool._reactor is not None and not pool._reactor.pumps


@pytest.mark.parametrize("how", ["eof", "reset", "garbage"])
async def test_relay_upstream_failure_mid_body(how: str) -> None:
    async def handler(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(CHUNKED_HEAD + chunk(b"data: one\n\n"))
        await trio.sleep(0.01)
        if how == "reset":
            await peer.reset()
        elif how == "garbage":
            await peer.send(b"zz\r\n")
            await peer.wait_eof()

    async with raw_server(handler) as srv, UpstreamPool() as pool:
        with trio.fail_after(TIMEOUT):
            sink = ListSink()
            expected = UpstreamProtocolError if how == "garbage" else UpstreamClosed
            with pytest.raises(expected) as ei:
                async with pool.stream(srv.url, "POST", "/", [], b"{}") as resp:
                    await resp.relay(sink)
            assert ei.value.received is True
            assert sink.pieces == [b"data: one\n\n"]
            assert pool.idle_count() == 0 and pool.stats.aborted == 1 and not pool._active


async def test_relay_sink_failure_propagates_and_closes_upstream() -> None:
    eof = trio.Event()

    async def handler(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(CHUNKED_HEAD)
        await trio.sleep(0.01)
        await peer.send(chunk(b"data: one\n\n"))
        await peer.wait_eof()
        eof.set()

    class GoneSink(ListSink):
        def send_nowait(self, data: bytes, end: bool = False) -> bool:
            raise trio.BrokenResourceError("the client left")

    async with raw_server(handler) as srv, UpstreamPool() as pool:
        with trio.fail_after(TIMEOUT):
            with pytest.raises(trio.BrokenResourceError):
                async with pool.stream(srv.url, "POST", "/", [], b"{}") as resp:
                    await resp.relay(GoneSink())
            await eof.wait()
        assert pool.idle_count() == 0 and not pool._active


async def test_relay_of_a_body_delimited_by_close() -> None:
    async def handler(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(b"HTTP/1.0 200 OK\r\n\r\npart one, ")
        await trio.sleep(0.01)
        await peer.send(b"part two")

    async with raw_server(handler) as srv, UpstreamPool() as pool:
        with trio.fail_after(TIMEOUT):
            sink = ListSink()
            async with pool.stream(srv.url, "GET", "/") as resp:
                await resp.relay(sink)
            assert b"".join(sink.pieces) == b"part one, part two" and resp.complete
            assert pool.idle_count() == 0 and pool.stats.aborted == 0


async def test_relay_goes_on_without_the_relay_task_when_the_pool_closes() -> None:
    go = trio.Event()

    async def handler(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(CHUNKED_HEAD + chunk(b"data: one\n\n"))
        await go.wait()
        await peer.send(chunk(b"data: two\n\n") + b"0\r\n\r\n")
        await peer.wait_eof()

    async with raw_server(handler) as srv:
        pool = UpstreamPool()
        async with pool:
            with trio.fail_after(TIMEOUT):
                sink = ListSink(on_piece=lambda _: go.set())
                async with pool.stream(srv.url, "POST", "/", [], b"{}") as resp, trio.open_nursery() as nursery:
                    nursery.start_soon(resp.relay, sink)
                    await go.wait()
                    await pool.aclose()  # the relay task stops; the consumer reads the rest itself
                assert b"".join(sink.pieces) == b"data: one\n\ndata: two\n\n" and resp.complete
        assert pool._reactor is not None and not pool._reactor.running and pool.idle_count() == 0


def test_relay_idle_timeout() -> None:
    async def main() -> None:
        eof = trio.Event()

        async def handler(peer: Peer) -> None:
            await peer.read_request()
            await peer.send(CHUNKED_HEAD)
            await trio.sleep(3)
            await peer.send(chunk(b"data: one\n\n"))
            await trio.sleep(3)
            await peer.send(chunk(b"data: two\n\n"))
            await peer.wait_eof()  # then stalls
            eof.set()

        async with raw_server(handler) as srv, UpstreamPool() as pool:
            sink = ListSink()
            with pytest.raises(UpstreamTimeout) as ei:
                async with pool.stream(srv.url, "POST", "/", [], b"{}", first_byte_timeout=60,
                                       idle_timeout=5) as resp:
                    t0 = trio.current_time()
                    await resp.relay(sink)
            assert 5 + 6 <= trio.current_time() - t0 <= 5 + 6 + 0.2
            assert sink.pieces == [b"data: one\n\n", b"data: two\n\n"]
            assert (ei.value.phase, ei.value.received) == ("idle", True)
            with trio.fail_after(1):
                await eof.wait()
            assert pool.stats.timeouts == 1 and not pool._active

    run_mock(main)


async def test_a_declared_length_over_the_limit_is_refused_before_reading() -> None:
    sent = trio.Event()

    async def handler(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(b"HTTP/1.1 200 OK\r\ncontent-length: 1000000\r\n\r\n" + b"x" * 100)
        sent.set()
        await peer.wait_eof()  # nothing more is asked of it: the pool closes at once

    async with raw_server(handler) as srv, UpstreamPool() as pool:
        with trio.fail_after(TIMEOUT):
            with pytest.raises(UpstreamProtocolError, match="of 1000000 bytes exceeds 1000"):
                await pool.request(srv.url, "GET", "/", max_body_bytes=1000)
    assert pool.stats.aborted == 1 and pool.idle_count() == 0
