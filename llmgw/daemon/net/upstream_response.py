"""An upstream response as the caller sees it: its head, and its body as it arrives.

:class:`UpstreamResponse` is what ``async with pool.stream(...) as resp`` gives: the
status and headers, then the body either iterated (``async for piece in resp``, one
piece per socket read, read on the caller's task) or relayed (``await resp.relay(sink)``,
read and written by the pool's relay, :mod:`llmgw.daemon.net.upstream_relay`).  A body
read to its end puts the connection back in the pool; anything else closes it.
:class:`Reply` is a whole response, from ``pool.request(...)``.  Both are re-exported by
:mod:`llmgw.daemon.net.upstream`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, NoReturn

import trio

from llmgw.daemon.net.upstream_errors import UpstreamClosed, UpstreamError, UpstreamProtocolError, UpstreamTimeout
from llmgw.daemon.net.upstream_relay import _FAIR, _ORPHANED, _PAUSED, _RECV, _Conn, _PoolSide, _Pump
from llmgw.http1.client import ResponseParser
from llmgw.http1.errors import RemoteProtocolError
from llmgw.http1.fields import first_header
from llmgw.http1.sinks import BodySink

__all__ = ["Reply", "UpstreamResponse"]

_INF = math.inf
_wait_readable = trio.lowlevel.wait_readable
_current_time = trio.current_time


@dataclass(slots=True)
class Reply:
    """A whole response from :meth:`UpstreamPool.request`."""
    status: int
    headers: list[tuple[str, str]]  # names lowercased
    body: bytes
    reason: str = ""

    def header(self, name: str) -> str | None:
        return first_header(self.headers, name.lower())

    def json(self) -> Any:
        return json.loads(self.body)


class UpstreamResponse:
    """The head of an upstream response and its body as it arrives."""

    __slots__ = (
        "_conn",
        "_error",
        "_fair",
        "_idle",
        "_keep",
        "_parser",
        "_pending",
        "_pool",
        "body_bytes",
        "connected_at",
        "first_byte_at",
        "head_at",
        "headers",
        "http_version",
        "last_byte_at",
        "reason",
        "reused",
        "status",
        "url",
    )

    def __init__(self, pool: _PoolSide, url: str) -> None:
        self._pool = pool
        self.url = url
        self.status = 0
        self.headers: list[tuple[str, str]] = []
        self.reason = ""
        self.http_version = "1.1"
        self.reused = False  # went out on a pooled connection
        self.first_byte_at: float | None = None  # trio time of the first body byte relay() sent on
        self.connected_at: float | None = None  # trio time the connection was there (pooled or new)
        self.head_at: float | None = None  # trio time the response head was parsed
        self.last_byte_at: float | None = None  # trio time the body's end was received (and relayed)
        self.body_bytes = 0  # body bytes relay() sent on (de-chunked)
        self._conn: _Conn | None = None  # None once the body ended (connection pooled or closed)
        self._parser: ResponseParser | None = None
        self._pending = b""  # body bytes that came with the head
        self._idle = _INF
        self._keep = True  # the request allows reuse (no "connection: close" from us)
        self._fair = 0
        self._error: UpstreamError | None = None

    def header(self, name: str) -> str | None:
        """First value of header ``name`` (case-insensitive), or None."""
        return first_header(self.headers, name.lower())

    @property
    def complete(self) -> bool:
        """The whole body has been received (the parser saw its end)."""
        return self._parser is not None and self._parser.done

    def iter_body(self) -> UpstreamResponse:
        """``async for piece in resp.iter_body()``: body bytes as they arrive, one piece per
        socket read (never empty).  Iterate to the end to keep the connection."""
        return self

    def __aiter__(self) -> UpstreamResponse:
        return self

    async def __anext__(self) -> bytes:
        if self._pending:
            piece, self._pending = self._pending, b""
            return piece
        c = self._conn
        if c is None:
            if self._error is not None:
                raise self._error
            raise StopAsyncIteration
        parser = self._parser
        assert parser is not None
        sock = c.sock
        while True:
            # Try the socket first: under load the next piece is often there already,
            # and a failed recv costs far less than a trip through trio's scheduler.
            try:
                data = sock.recv(_RECV)
            except BlockingIOError:
                self._fair = 0
                idle = self._idle
                c.deadline = _current_time() + idle if idle != _INF else _INF
                try:
                    await _wait_readable(c.fd)
                except trio.ClosedResourceError:
                    if not c.timed_out:
                        raise
                finally:
                    c.deadline = _INF
                if c.timed_out:
                    self._pool.stats.timeouts += 1
                    self._fail(UpstreamTimeout("idle", received=True, url=self.url), c)
                try:
                    data = sock.recv(_RECV)
                except BlockingIOError:  # spurious wake-up
                    continue
                except OSError as exc:
                    self._fail(UpstreamClosed(f"upstream connection reset mid-response: {exc}", received=True,
                                              url=self.url), c)
            except OSError as exc:
                self._fail(UpstreamClosed(f"upstream connection reset mid-response: {exc}", received=True,
                                          url=self.url), c)
            else:
                self._fair += 1
                if self._fair >= _FAIR:  # data always waiting: let other tasks run too
                    self._fair = 0
                    await trio.lowlevel.checkpoint()
            if not data:
                if parser.until_close:
                    parser.feed_eof()
                    self._finish(c, False)
                    raise StopAsyncIteration
                self._fail(UpstreamClosed("upstream closed the connection mid-response", received=True,
                                          url=self.url), c)
            try:
                piece = parser.feed_body(data)
            except RemoteProtocolError as exc:
                self._fail(UpstreamProtocolError(f"invalid response body from upstream: {exc}", received=True,
                                                 url=self.url), c)
            if parser.done:
                self._finish(c, parser.keep_alive)
                if not piece:
                    raise StopAsyncIteration
            if piece:
                return piece

    def _finish(self, c: _Conn, keep_alive: bool) -> None:
        if self.last_byte_at is None:
            self.last_byte_at = _current_time()
        self._conn = None
        if keep_alive and self._keep:
            self._pool._release(c)
        else:
            self._pool._discard(c)

    def _fail(self, error: UpstreamError, c: _Conn) -> NoReturn:
        self._conn = None
        self._error = error
        self._pool.stats.aborted += 1
        self._pool._discard(c)
        raise error

    async def read(self, max_bytes: int = 64 << 20) -> bytes:
        """The rest of the body, whole.  More than ``max_bytes`` raises UpstreamProtocolError
        and closes the connection: at once when a Content-Length says so (nothing is read),
        else as soon as the bytes read pass the limit (never more than that is held)."""
        declared = self._parser.length_left if self._parser is not None and self._conn is not None else None
        if declared is not None and (declared := declared + len(self._pending)) > max_bytes:
            self._pending = b""
            self._fail(UpstreamProtocolError(f"upstream response body of {declared} bytes exceeds {max_bytes} bytes",
                                             received=True, url=self.url), self._conn)  # type: ignore[arg-type]
        buf = bytearray()
        async for piece in self:
            if len(buf) + len(piece) > max_bytes:
                del buf[:]  # freed now, not when the caller's exception is gone
                if self._conn is not None:
                    self._fail(UpstreamProtocolError(f"upstream response body exceeds {max_bytes} bytes",
                                                     received=True, url=self.url), self._conn)
                raise UpstreamProtocolError(f"upstream response body exceeds {max_bytes} bytes", received=True,
                                            url=self.url)
            buf += piece
        return bytes(buf)

    def close(self) -> None:
        """Give up the rest of the body: closes the connection unless the body was read to its
        end (then it is back in the pool already).  Synchronous and idempotent: what leaving
        the ``async with pool.stream(...)`` block does, for a caller that kept the response."""
        c = self._conn
        if c is not None:
            if c.pump is not None:
                c.pump.stop()
            self._conn = None
            self._pool.stats.aborted += 1
            self._pool._discard(c)

    _abort = close

    async def relay(self, sink: BodySink) -> None:
        """Send the rest of the body into ``sink`` as it arrives, and return at its end.

        The pool's relay task reads the socket and writes each read's de-chunked bytes to
        the sink itself, in the same step that learnt of the data (no task switch, no
        epoll_ctl and no failed recv a read), while this task sleeps until the body ends,
        fails or the sink is full (it then waits for the sink to drain).  The body's last
        bytes go with ``end=True``.  Same semantics as iterating: errors raise
        here (UpstreamError, or what the sink raised), a body read to its end keeps the
        connection, and cancelling this task stops the relay at once (then ``close()``).
        ``first_byte_at`` is set once a body byte went to the sink.
        """
        if self._pending:
            piece, self._pending = self._pending, b""
            self.first_byte_at = _current_time()
            self.body_bytes += len(piece)
            if self._conn is None:  # the whole body came with the head
                self.last_byte_at = self.first_byte_at
            if not sink.send_nowait(piece, self._conn is None and self._error is None):
                await sink.drain()
        c = self._conn
        reactor = self._pool._reactor
        if c is not None and reactor is not None and reactor.running:
            sink.flush_nowait()  # the head goes now, not with the next piece
            pump = _Pump(self, c, sink, reactor)
            try:
                while True:
                    state = await pump.park()
                    if state is _PAUSED:
                        await sink.drain()  # backpressure: the client reads slower than the engine writes
                        pump.resume()
                        continue
                    break
            finally:
                pump.stop()
            if self.first_byte_at is None:
                self.first_byte_at = pump.first
            if state is not _ORPHANED:
                await sink.drain()
                return
        async for piece in self:  # no relay task (the pool is closing): read here
            if self.first_byte_at is None:
                self.first_byte_at = _current_time()
            self.body_bytes += len(piece)
            if not sink.send_nowait(piece):
                await sink.drain()
