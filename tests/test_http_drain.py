"""The HTTP server's graceful stop (llmgw.daemon.net.http_drain), in one process over loopback:
new connections refused, idle keep-alive connections closed, busy ones finished and closed after
their response — a streamed one included — and wait() returning once all are closed."""

from __future__ import annotations

from collections.abc import AsyncIterator
from functools import partial

import pytest
import trio
import trio.testing

from llmgw.daemon.net.httpserver import Drain, Request, Response, ServerStats, json_response, serve_tcp


@pytest.fixture
def anyio_backend() -> str:
    return "trio"


pytestmark = pytest.mark.anyio


async def _read_until(stream: trio.SocketStream, end: bytes) -> bytes:
    out = b""
    with trio.fail_after(5):
        while end not in out:
            chunk = await stream.receive_some(65536)
            assert chunk, out
            out += chunk
    return out


async def _eof(stream: trio.SocketStream) -> bytes:
    """What is left until the server closes (fails if it does not within 5 s)."""
    out = b""
    with trio.fail_after(5):
        while chunk := await stream.receive_some(65536):
            out += chunk
    return out


async def test_drain_refuses_new_closes_idle_and_finishes_busy() -> None:
    release = trio.Event()

    async def tokens() -> AsyncIterator[bytes]:
        yield b"first "
        await release.wait()
        yield b"last"

    async def handler(req: Request) -> Response:
        if req.path == "/slow":
            await release.wait()
        if req.path == "/stream":
            return Response(200, [("content-type", "text/plain")], tokens())
        return json_response(200, {"path": req.path})

    drain = Drain()
    stats = ServerStats()
    async with trio.open_nursery() as nursery:
        port = await nursery.start(partial(serve_tcp, handler, "127.0.0.1", 0, stats=stats, drain=drain))
        idle = await trio.open_tcp_stream("127.0.0.1", port)
        await idle.send_all(b"GET /x HTTP/1.1\r\nhost: a\r\n\r\n")
        assert b'{"path":"/x"}' in await _read_until(idle, b"}")
        slow = await trio.open_tcp_stream("127.0.0.1", port)
        await slow.send_all(b"GET /slow HTTP/1.1\r\nhost: a\r\n\r\n")
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(b"GET /stream HTTP/1.1\r\nhost: a\r\n\r\n")
        head = await _read_until(stream, b"first ")  # its head is out: it cannot say "connection: close"
        assert b"transfer-encoding: chunked" in head.lower()
        await trio.testing.wait_all_tasks_blocked()
        assert drain.start() == 2 and drain.connections == 3
        with pytest.raises(OSError):
            await trio.open_tcp_stream("127.0.0.1", port)  # the listener is closed: refused
        assert await _eof(idle) == b""  # the idle keep-alive connection is closed at once
        assert stats.connections_idle_closed == 1
        release.set()
        rest = await _eof(slow)
        assert rest.startswith(b"HTTP/1.1 200") and b"connection: close" in rest.lower()
        tail = await _eof(stream)  # the whole body, its last chunk, then the close
        assert tail.endswith(b"4\r\nlast\r\n0\r\n\r\n")
        with trio.fail_after(5):
            await drain.wait()
        assert drain.connections == 0 and drain.in_flight == 0
        nursery.cancel_scope.cancel()
    for s in (idle, slow, stream):
        await s.aclose()


async def test_a_connection_without_its_request_yet_gets_a_moment_to_send_it() -> None:
    drain = Drain()

    async def handler(req: Request) -> Response:
        return json_response(200, {"path": req.path})

    async with trio.open_nursery() as nursery:
        port = await nursery.start(partial(serve_tcp, handler, "127.0.0.1", 0, drain=drain))
        fresh = await trio.open_tcp_stream("127.0.0.1", port)
        await trio.testing.wait_all_tasks_blocked()
        assert drain.start() == 0 and drain.connections == 1
        await fresh.send_all(b"GET /late HTTP/1.1\r\nhost: a\r\n\r\n")
        out = await _eof(fresh)
        assert out.startswith(b"HTTP/1.1 200") and b"connection: close" in out.lower() and b"/late" in out
        with trio.fail_after(5):
            await drain.wait()
        nursery.cancel_scope.cancel()
    await fresh.aclose()
