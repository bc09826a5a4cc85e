"""The router's upstream HTTP/1.1 client: a lean keep-alive pool over trio.

httpx costs ~1.0-1.4 ms CPU a request under trio and httpcore ~0.7-1.0 ms
(shared/specs/python-stack.md); this client spends a small fraction of that:

* the codec is :mod:`llmgw.http1.client` (sans-I/O, chunked bodies parsed with
  ``bytes.find``), and the sockets are plain non-blocking stdlib sockets read and
  written directly, waiting through ``trio.lowlevel.wait_readable``/``wait_writable``
  only when the kernel has nothing (trio's socket wrappers cost 2-3x the syscall);
* deadlines cost nothing a read: a trio cancel scope with a deadline is ~10 us to
  enter and leave, so instead the pool's sweeper task checks the connections that
  wait for data every ``timer_resolution`` seconds and wakes an overdue one with
  ``notify_closing``.  A timeout therefore fires up to one resolution late.
* TCP_NODELAY on every connection (Nagle + delayed ACK stall small writes ~40 ms).

Usage::

    async with UpstreamPool() as pool:
        async with pool.stream("http://10.0.0.7:8000", "POST", "/v1/completions",
                               [("content-type", "application/json")], body,
                               first_byte_timeout=600, idle_timeout=60) as resp:
            resp.status, resp.headers
            async for piece in resp.iter_body():   # one piece per socket read, de-chunked
                ...

For a proxy, ``await resp.relay(sink)`` instead of iterating: the pool's relay task
reads the socket and writes each read's bytes into ``sink`` (the client's side) in the
same step that learnt of them, while the caller sleeps until the body ends; a streamed
chunk then costs its recv, parse and send, not a task wake-up, an epoll_ctl and a failed
recv as well.

Leaving the block before the body ended (an exception, or the caller's cancellation
when its client left) closes the upstream connection at once, so the engine sees the
disconnect and stops generating; a body read to its end puts a keep-alive connection
back in the pool (LIFO, idle ones bounded per host, expired after ``keepalive_expiry``).
A reused connection that turns out dead (EOF or reset before any response byte) is
replaced by a fresh one and the request resent once: nothing was received, so nothing
was lost.  Errors are :class:`UpstreamError` subclasses with a ``received`` flag: the
router may retry another replica while it is False and nothing went to its client.
"""

from __future__ import annotations

import functools
import json
import math
import os
import socket as _socket
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal, NoReturn
from urllib.parse import urlsplit

import outcome
import trio

from llmgw.daemon.net.inline_epoll import HANGUP, InlineEpoll
from llmgw.http1.client import Data, ResponseParser, serialize_request
from llmgw.http1.errors import LocalProtocolError, RemoteProtocolError
from llmgw.http1.fields import first_header
# The sink a relayed body is written into (the HTTP server's client side): one definition, shared.
from llmgw.http1.sinks import BodySink

__all__ = ["PoolStats", "Reply", "UpstreamClosed", "UpstreamConnectError", "UpstreamError", "UpstreamPool",
           "UpstreamProtocolError", "UpstreamResponse", "UpstreamTimeout"]

_RECV = 65536
_NOSIGNAL = getattr(_socket, "MSG_NOSIGNAL", 0)
_PEEK = _socket.MSG_PEEK | getattr(_socket, "MSG_DONTWAIT", 0)
_INF = math.inf
_PEEK_AFTER = 1.0  # s idle before a reused connection is checked for a close by the server
_FAIR = 16  # reads that found data waiting in a row before we yield to other tasks
_wait_readable = trio.lowlevel.wait_readable
_wait_writable = trio.lowlevel.wait_writable
_current_time = trio.current_time
_reschedule = trio.lowlevel.reschedule
# With one of these in an event, read until EAGAIN or EOF: a short read does not mean that
# the peer's FIN is not queued behind the data (and it raises no further edge).
_HANGUP = HANGUP

Phase = Literal["connect", "first_byte", "idle"]


# ---------------------------------------------------------------------------------- errors
class UpstreamError(Exception):
    """A request to an upstream failed.  ``received``: any response byte had arrived."""

    def __init__(self, message: str, *, received: bool = False, url: str | None = None) -> None:
        super().__init__(message)
        self.received = received
        self.url = url


class UpstreamConnectError(UpstreamError):
    """Could not connect (refused, unreachable, DNS failure).  Nothing was sent."""


class UpstreamTimeout(UpstreamError):
    """A deadline passed.  ``phase``: "connect", "first_byte" (from sending the
    request to the first response byte) or "idle" (a gap between received bytes)."""

    def __init__(self, phase: Phase, message: str | None = None, *, received: bool = False,
                 url: str | None = None) -> None:
        super().__init__(message or f"upstream {phase.replace('_', '-')} timeout", received=received, url=url)
        self.phase = phase


class UpstreamProtocolError(UpstreamError):
    """The upstream sent something that is not valid HTTP/1.1 (or too large)."""


class UpstreamClosed(UpstreamError):
    """The connection was reset or closed before the response was complete."""


class _Stale(Exception):
    """A reused connection was found dead before any response byte: resend once."""


# ---------------------------------------------------------------------------------- pool
@dataclass(slots=True)
class PoolStats:
    """Plain counters, bumped inline; read them from the same trio run."""
    requests: int = 0  # exchanges started (a stale retry counts once)
    connects: int = 0  # connections opened
    connect_errors: int = 0
    reused: int = 0  # requests that went out on a pooled connection
    stale_dropped: int = 0  # idle connections found closed by the server at checkout
    expired: int = 0  # idle connections closed for age (keepalive_expiry)
    stale_retries: int = 0  # reused connection dead after the send: resent on a fresh one
    aborted: int = 0  # connections closed before their response ended (cancel, error, early exit)
    timeouts: int = 0


class _Conn:
    __slots__ = ("deadline", "fd", "idle_since", "key", "pump", "sock", "timed_out")

    def __init__(self, sock: _socket.socket, key: tuple[str, int]) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.key = key
        self.idle_since = 0.0
        self.deadline = _INF  # set only while waiting for the socket: the sweeper's input
        self.timed_out = False
        self.pump: _Pump | None = None  # relaying its body through the reactor


@functools.lru_cache(maxsize=4096)
def _parse_base(base_url: str) -> tuple[tuple[str, int], str, str]:
    """base_url -> ((host, port), Host header, path prefix)."""
    parts = urlsplit(base_url)
    if parts.scheme != "http":
        raise ValueError(f"unsupported upstream URL (plain http:// only): {base_url!r}")
    host = parts.hostname
    if not host:
        raise ValueError(f"no host in upstream URL {base_url!r}")
    port = parts.port or 80
    host_header = parts.netloc.rpartition("@")[2]
    return (host, port), host_header, parts.path.rstrip("/")


def _close(c: _Conn) -> None:
    trio.lowlevel.notify_closing(c.sock)
    c.sock.close()


class UpstreamPool:
    """Keep-alive HTTP/1.1 connections to upstreams, per (host, port).

    Use it as ``async with UpstreamPool(...) as pool:`` (it runs a small timer task);
    leaving closes the idle connections.  Timeouts given to ``stream``/``request`` as
    None take these defaults; ``math.inf`` means no limit.
    """

    def __init__(self, *, max_idle_per_host: int = 64, keepalive_expiry: float = 4.0,
                 connect_timeout: float = 5.0, first_byte_timeout: float = _INF, idle_timeout: float = _INF,
                 timer_resolution: float = 0.05, max_head_bytes: int = 65536) -> None:
        # keepalive_expiry: an idle connection older than this is closed, not reused.
        # vLLM (uvicorn) and llama-server close idle keep-alive connections after 5 s.
        self.max_idle_per_host = max_idle_per_host
        self.keepalive_expiry = keepalive_expiry
        self.connect_timeout = connect_timeout
        self.first_byte_timeout = first_byte_timeout
        self.idle_timeout = idle_timeout
        self.timer_resolution = timer_resolution
        self.max_head_bytes = max_head_bytes
        self.stats = PoolStats()
        self._idle: dict[tuple[str, int], deque[_Conn]] = {}
        self._active: set[_Conn] = set()  # checked out: the sweeper watches their deadlines
        self._open = False
        self._sweeper: trio.CancelScope | None = None
        self._reactor: _Reactor | None = None
        self._reactor_scope: trio.CancelScope | None = None

    # -- lifecycle -----------------------------------------------------------------------------
    async def __aenter__(self) -> UpstreamPool:
        if self._open:
            raise RuntimeError("UpstreamPool is already open")
        # The timer runs as a system task, not in a nursery around the caller's block,
        # so the caller's exceptions come out as themselves, not in an ExceptionGroup.
        self._sweeper = trio.CancelScope()
        trio.lowlevel.spawn_system_task(self._sweep, self._sweeper, name="llmgw.upstream.sweep")
        self._reactor, self._reactor_scope = _Reactor(self.stats), trio.CancelScope()
        trio.lowlevel.spawn_system_task(self._reactor.run, self._reactor_scope, name="llmgw.upstream.relay")
        self._open = True
        return self

    async def __aexit__(self, et: type[BaseException] | None, ev: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop the timer and close the idle connections.  In-flight responses keep
        their connections (closed when they end); timeouts no longer fire for them."""
        self._open = False
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        if self._reactor_scope is not None:
            self._reactor_scope.cancel()  # relays under way go on without it, read by their tasks
            self._reactor_scope = None
        self.close_idle()
        await trio.lowlevel.checkpoint()

    def close_idle(self) -> None:
        """Close every idle connection (in-flight ones are left alone)."""
        idle, self._idle = self._idle, {}
        for conns in idle.values():
            for c in conns:
                _close(c)

    def idle_count(self, base_url: str | None = None) -> int:
        if base_url is None:
            return sum(len(d) for d in self._idle.values())
        return len(self._idle.get(_parse_base(base_url)[0], ()))

    async def _sweep(self, scope: trio.CancelScope) -> None:
        active = self._active
        with scope:
            while True:
                await trio.sleep(self.timer_resolution)
                now = _current_time()
                for c in [c for c in active if c.deadline <= now]:  # a pump's timeout leaves `active`
                    c.deadline = _INF
                    c.timed_out = True
                    if c.pump is not None:
                        c.pump.timeout()
                    else:
                        trio.lowlevel.notify_closing(c.sock)  # its waiter raises ClosedResourceError

    # -- connections ---------------------------------------------------------------------------
    def _checkout(self, key: tuple[str, int]) -> _Conn | None:
        idle = self._idle.get(key)
        if not idle:
            return None
        now = _current_time()
        while idle:
            c = idle.pop()  # LIFO: the most recently used is the least likely to be closed
            if now - c.idle_since > self.keepalive_expiry:
                # This one and all below it (older) may be closed by the server any moment.
                self.stats.expired += 1 + len(idle)
                _close(c)
                while idle:
                    _close(idle.popleft())
                return None
            if now - c.idle_since < _PEEK_AFTER:
                return c  # just used: servers don't time out keep-alive this fast (the retry covers it)
            try:
                c.sock.recv(1, _PEEK)  # b"": the server closed it; data: out of protocol
            except BlockingIOError:
                return c  # alive and quiet
            except OSError:
                pass
            self.stats.stale_dropped += 1
            _close(c)
        return None

    def _release(self, c: _Conn) -> None:
        self._active.discard(c)
        if not self._open or self.max_idle_per_host <= 0:
            _close(c)
            return
        c.idle_since = now = _current_time()
        idle = self._idle.get(c.key)
        if idle is None:
            idle = self._idle[c.key] = deque()
        else:
            if len(idle) >= self.max_idle_per_host:
                _close(idle.popleft())  # the oldest goes
            # LIFO reuse never reaches the bottom while traffic is light: expire it here.
            while idle and now - idle[0].idle_since > self.keepalive_expiry:
                self.stats.expired += 1
                _close(idle.popleft())
        idle.append(c)

    def _discard(self, c: _Conn) -> None:
        self._active.discard(c)
        _close(c)

    async def _connect(self, key: tuple[str, int], timeout: float, url: str) -> _Conn:
        host, port = key
        error: Exception | None = None
        with trio.move_on_after(timeout):
            try:
                infos = await trio.socket.getaddrinfo(host, port, type=_socket.SOCK_STREAM)
            except OSError as exc:
                self.stats.connect_errors += 1
                raise UpstreamConnectError(f"cannot resolve {host}: {exc}", url=url) from exc
            for family, type_, proto, _, addr in infos:
                sock = _socket.socket(family, type_, proto)
                try:
                    sock.setblocking(False)
                    if family != _socket.AF_UNIX:
                        sock.setsockopt(_socket.IPPROTO_TCP, _socket.TCP_NODELAY, 1)
                    try:
                        sock.connect(addr)
                    except BlockingIOError:
                        await _wait_writable(sock)
                        if err := sock.getsockopt(_socket.SOL_SOCKET, _socket.SO_ERROR):
                            raise OSError(err, os.strerror(err))
                except OSError as exc:
                    trio.lowlevel.notify_closing(sock)
                    sock.close()
                    error = exc
                    continue
                except BaseException:
                    trio.lowlevel.notify_closing(sock)
                    sock.close()
                    raise
                self.stats.connects += 1
                return _Conn(sock, key)
            self.stats.connect_errors += 1
            raise UpstreamConnectError(f"cannot connect to {host}:{port}: {error}", url=url) from error
        self.stats.connect_errors += 1
        self.stats.timeouts += 1
        raise UpstreamTimeout("connect", url=url)

    # -- requests ------------------------------------------------------------------------------
    def stream(self, base_url: str, method: str, target: str, headers: Sequence[tuple[str, str]] = (),
               body: bytes | None = None, *, connect_timeout: float | None = None,
               first_byte_timeout: float | None = None, idle_timeout: float | None = None) -> _Exchange:
        """``async with pool.stream(...) as resp``: send the request, wait for the head.

        ``base_url`` is ``http://host:port`` (a path in it prefixes ``target``).  The
        Host header and Content-Length are added when ``headers`` lacks them; do not
        pass hop-by-hop headers (connection, keep-alive, transfer-encoding, te, upgrade)
        from a client.  Raises UpstreamError subclasses on entry and while iterating.
        """
        if not self._open:
            raise RuntimeError("use the pool inside `async with UpstreamPool() as pool:`")
        return _Exchange(self, base_url, method, target, headers, body,
                         self.connect_timeout if connect_timeout is None else connect_timeout,
                         self.first_byte_timeout if first_byte_timeout is None else first_byte_timeout,
                         self.idle_timeout if idle_timeout is None else idle_timeout)

    async def request(self, base_url: str, method: str, target: str, headers: Sequence[tuple[str, str]] = (),
                      body: bytes | None = None, *, connect_timeout: float | None = None,
                      first_byte_timeout: float | None = None, idle_timeout: float | None = None,
                      max_body_bytes: int = 64 << 20) -> Reply:
        """Send a request and read its whole body (non-streaming calls, /metrics scrapes)."""
        async with self.stream(base_url, method, target, headers, body, connect_timeout=connect_timeout,
                               first_byte_timeout=first_byte_timeout, idle_timeout=idle_timeout) as resp:
            data = await resp.read(max_body_bytes)
        return Reply(resp.status, resp.headers, data, resp.reason)


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
        "first_byte_at",
        "headers",
        "http_version",
        "reason",
        "reused",
        "status",
        "url",
    )

    def __init__(self, pool: UpstreamPool, url: str) -> None:
        self._pool = pool
        self.url = url
        self.status = 0
        self.headers: list[tuple[str, str]] = []
        self.reason = ""
        self.http_version = "1.1"
        self.reused = False  # went out on a pooled connection
        self.first_byte_at: float | None = None  # trio time of the first body byte relay() sent on
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
        """The rest of the body, whole.  More than ``max_bytes`` raises UpstreamProtocolError."""
        pieces = []
        size = 0
        async for piece in self:
            size += len(piece)
            if size > max_bytes:
                if self._conn is not None:
                    self._fail(UpstreamProtocolError(f"upstream response body exceeds {max_bytes} bytes",
                                                     received=True, url=self.url), self._conn)
                raise UpstreamProtocolError(f"upstream response body exceeds {max_bytes} bytes", received=True,
                                            url=self.url)
            pieces.append(piece)
        return b"".join(pieces)

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
            if not sink.send_nowait(piece):
                await sink.drain()


# _Pump states, and what park() returns
_RUNNING, _PAUSED, _ENDED, _ORPHANED = "running", "paused", "ended", "orphaned"


class _Reactor:
    """The pool's relay: moves response bodies from upstream sockets to their sinks.

    The sockets of the responses being relayed sit in an InlineEpoll, edge-triggered and
    registered once per response, and each ready one is relayed in place (_Pump.run) in
    the step that learnt of it.  A relayed read therefore costs its recv, parse and send,
    instead of also a trio wake-up of the consumer's task (through a dozen coroutine
    frames), an epoll_ctl and the failed recv that ends a drain.
    """

    __slots__ = ("poller", "pumps", "running", "stats")

    def __init__(self, stats: PoolStats) -> None:
        self.poller = InlineEpoll("upstream relay")
        self.pumps: dict[int, _Pump] = {}
        self.running = True
        self.stats = stats

    def attach(self, pump: _Pump) -> None:
        self.poller.register(pump.fd, pump.run)  # reports data already waiting, too
        self.pumps[pump.fd] = pump

    def detach(self, pump: _Pump) -> None:
        if self.pumps.get(pump.fd) is pump:
            del self.pumps[pump.fd]
            self.poller.unregister(pump.fd)  # the connection goes back to the pool

    async def run(self, scope: trio.CancelScope) -> None:
        try:
            with scope:
                await self.poller.run()
        finally:
            self.running = False
            for pump in list(self.pumps.values()):
                pump.orphan()
            self.pumps.clear()


class _Pump:
    """One response body being relayed by the reactor; its consumer task parks in park()."""

    __slots__ = ("conn", "fd", "first", "idle", "parser", "reactor", "resp", "result", "sink", "sock", "state",
                 "task")

    def __init__(self, resp: UpstreamResponse, c: _Conn, sink: BodySink, reactor: _Reactor) -> None:
        parser = resp._parser
        assert parser is not None
        self.resp, self.conn, self.fd, self.sock, self.parser = resp, c, c.fd, c.sock, parser
        self.sink, self.reactor, self.idle = sink, reactor, resp._idle
        self.task: trio.lowlevel.Task | None = None  # parked in park()
        self.state = _RUNNING
        self.result: outcome.Outcome[Any] | None = None  # for park() when the task was not parked
        self.first: float | None = None  # time of the first byte relayed
        c.pump = self
        c.deadline = _current_time() + self.idle
        reactor.attach(self)

    # -- the reactor's side (never raises) --------------------------------------------------
    def run(self, mask: int) -> None:
        """Relay what the socket holds (at most _FAIR reads, then the reactor comes back).
        ``mask``: the epoll event; without a hang-up in it, a short read drained the socket."""
        if self.state is not _RUNNING:
            return
        now = _current_time()
        sock, parser, resp = self.sock, self.parser, self.resp
        try:
            for _ in range(_FAIR):
                try:
                    data = sock.recv(_RECV)
                except BlockingIOError:
                    break
                except OSError as exc:
                    raise UpstreamClosed(f"upstream connection reset mid-response: {exc}", received=True,
                                         url=resp.url) from None
                if not data:
                    if parser.until_close:
                        parser.feed_eof()
                        self._end(False)
                        return
                    raise UpstreamClosed("upstream closed the connection mid-response", received=True, url=resp.url)
                try:
                    piece = parser.feed_body(data)
                except RemoteProtocolError as exc:
                    raise UpstreamProtocolError(f"invalid response body from upstream: {exc}", received=True,
                                                url=resp.url) from None
                done = parser.done
                if piece:
                    if self.first is None:
                        self.first = now
                    if not self.sink.send_nowait(piece, done):  # the end goes with the last bytes
                        if done:
                            self._end(parser.keep_alive)  # the task drains what the sink kept
                        else:
                            self._pause()
                        return
                elif done:
                    self.sink.send_nowait(b"", True)
                if done:
                    self._end(parser.keep_alive)
                    return
                if len(data) < _RECV and not mask & _HANGUP:
                    break  # drained: data arriving from now on raises a new edge
            else:
                self.reactor.poller.later(self.fd)  # more waiting: after the others
            self.conn.deadline = now + self.idle
        except Exception as exc:  # noqa: BLE001 - an upstream error, or the sink's (the client left)
            self._fail(exc)

    def timeout(self) -> None:
        """The sweeper found the idle deadline passed."""
        if self.state is _RUNNING:
            self.reactor.stats.timeouts += 1
            self._fail(UpstreamTimeout("idle", received=True, url=self.resp.url))

    def orphan(self) -> None:
        """The reactor stops (the pool closes): the consumer reads the rest itself."""
        if self.state is _RUNNING:
            self._detach()
            self.state = _ORPHANED
            self._wake(outcome.Value(_ORPHANED))

    def _end(self, keep_alive: bool) -> None:
        self._detach()  # before the connection can be reused
        self.state = _ENDED
        self.resp._finish(self.conn, keep_alive)
        self._wake(outcome.Value(_ENDED))

    def _pause(self) -> None:
        self.state = _PAUSED
        self.conn.deadline = _INF  # no idle timeout while the client is the slow one
        self._wake(outcome.Value(_PAUSED))

    def _fail(self, exc: BaseException) -> None:
        self._detach()
        self.state = _ENDED
        resp, c = self.resp, self.conn
        if resp._conn is c:
            resp._conn = None
            if isinstance(exc, UpstreamError):
                resp._error = exc
            self.reactor.stats.aborted += 1
            resp._pool._discard(c)
        self._wake(outcome.Error(exc))

    def _detach(self) -> None:
        self.conn.pump = None
        self.conn.deadline = _INF
        self.reactor.detach(self)

    def _wake(self, result: outcome.Outcome[Any]) -> None:
        task = self.task
        if task is not None:
            self.task = None
            _reschedule(task, result)
        else:
            self.result = result

    # -- the consumer's side ------------------------------------------------------------------
    async def park(self) -> Any:
        """Sleep until the relay ends (_ENDED; or raises), pauses (_PAUSED) or is orphaned."""
        result = self.result
        if result is not None:
            self.result = None
            return result.unwrap()
        self.task = trio.lowlevel.current_task()
        return await trio.lowlevel.wait_task_rescheduled(self._abort)

    def _abort(self, _: Any) -> trio.lowlevel.Abort:
        self.task = None  # cancelled while parked: stop relaying now
        self.stop()
        return trio.lowlevel.Abort.SUCCEEDED

    def resume(self) -> None:
        """After a pause: relay again, starting with what arrived meanwhile (its edge is gone)."""
        if self.state is _PAUSED:
            self.state = _RUNNING
            self.run(_HANGUP)

    def stop(self) -> None:
        """Stop relaying (cancelled, or the consumer gave up): the caller closes the connection."""
        if self.state is _RUNNING or self.state is _PAUSED:
            self._detach()
            self.state = _ENDED


class _Exchange:
    """The async context manager returned by :meth:`UpstreamPool.stream`."""

    __slots__ = (
        "base_url",
        "body",
        "connect_timeout",
        "first_byte_timeout",
        "headers",
        "idle_timeout",
        "method",
        "pool",
        "resp",
        "target",
    )

    def __init__(self, pool: UpstreamPool, base_url: str, method: str, target: str,
                 headers: Sequence[tuple[str, str]], body: bytes | None, connect_timeout: float,
                 first_byte_timeout: float, idle_timeout: float) -> None:
        self.pool, self.base_url, self.method, self.target = pool, base_url, method, target
        self.headers, self.body = headers, body
        self.connect_timeout, self.first_byte_timeout, self.idle_timeout = (
            connect_timeout, first_byte_timeout, idle_timeout)
        self.resp: UpstreamResponse | None = None

    async def __aenter__(self) -> UpstreamResponse:
        pool, url = self.pool, self.base_url
        key, host, prefix = _parse_base(url)
        try:
            data = serialize_request(self.method, prefix + self.target if prefix else self.target, self.headers,
                                     self.body, host=host)
        except LocalProtocolError as exc:
            raise ValueError(f"cannot send this request: {exc}") from None
        resp = UpstreamResponse(pool, url)
        resp._idle = self.idle_timeout
        for name, value in self.headers:
            if len(name) == 10 and name.lower() == "connection" and "close" in value.lower():
                resp._keep = False
        pool.stats.requests += 1
        c = pool._checkout(key)
        reused = c is not None
        if c is None:
            c = await pool._connect(key, self.connect_timeout, url)
        else:
            pool.stats.reused += 1
        fbt = self.first_byte_timeout
        deadline = _current_time() + fbt if fbt != _INF else _INF
        while True:
            try:
                await self._exchange(c, resp, data, reused, deadline)
            except _Stale:
                pool.stats.stale_retries += 1
                c = await pool._connect(key, self.connect_timeout, url)
                reused = False
                continue
            resp.reused = reused
            self.resp = resp
            return resp

    async def _exchange(self, c: _Conn, resp: UpstreamResponse, data: bytes, reused: bool, deadline: float) -> None:
        pool = self.pool
        pool._active.add(c)
        sock = c.sock
        try:
            # -- send: almost always one syscall; a full socket waits (first-byte deadline)
            try:
                try:
                    sent = sock.send(data, _NOSIGNAL)
                except BlockingIOError:
                    sent = 0
                while sent < len(data):
                    await self._wait(c, _wait_writable, deadline, "first_byte", False)
                    try:
                        sent += sock.send(memoryview(data)[sent:], _NOSIGNAL)
                    except BlockingIOError:
                        pass
            except OSError as exc:
                if reused:
                    raise _Stale from exc
                raise UpstreamClosed(f"upstream connection failed while sending: {exc}", url=self.base_url) from exc
            # -- the head
            parser = ResponseParser(head_request=self.method == "HEAD", max_head_bytes=pool.max_head_bytes)
            received = 0
            idle = self.idle_timeout
            while True:
                if received:
                    await self._wait(c, _wait_readable, _current_time() + idle if idle != _INF else _INF,
                                     "idle", True)
                else:
                    await self._wait(c, _wait_readable, deadline, "first_byte", False)
                try:
                    chunk = sock.recv(_RECV)
                except BlockingIOError:
                    continue
                except OSError as exc:
                    if not received and reused:
                        raise _Stale from exc
                    raise UpstreamClosed(f"upstream connection reset: {exc}", received=bool(received),
                                         url=self.base_url) from exc
                if not chunk:
                    if not received and reused:
                        raise _Stale
                    raise UpstreamClosed("upstream closed the connection before the response head"
                                         if not received else "upstream closed the connection mid-head",
                                         received=bool(received), url=self.base_url)
                received += len(chunk)
                try:
                    events = parser.feed(chunk)
                except RemoteProtocolError as exc:
                    raise UpstreamProtocolError(f"invalid response from upstream: {exc}", received=True,
                                                url=self.base_url) from exc
                if events:
                    break
        except _Stale:
            pool._discard(c)
            raise
        except BaseException:
            pool.stats.aborted += 1
            pool._discard(c)
            raise
        head = parser.head
        assert head is not None
        resp.status, resp.headers, resp.reason, resp.http_version = (
            head.status, head.headers, head.reason, head.http_version)
        resp._parser = parser
        for ev in events:
            if type(ev) is Data:
                resp._pending = ev.data
        if parser.done:
            resp._conn = None
            if parser.keep_alive and resp._keep:
                pool._release(c)
            else:
                pool._discard(c)
        else:
            resp._conn = c

    async def _wait(self, c: _Conn, wait: Any, deadline: float, phase: Phase, received: bool) -> None:
        c.deadline = deadline
        try:
            await wait(c.fd)
        except trio.ClosedResourceError:
            if not c.timed_out:
                raise
        finally:
            c.deadline = _INF
        if c.timed_out:
            self.pool.stats.timeouts += 1
            raise UpstreamTimeout(phase, received=received, url=self.base_url)

    async def __aexit__(self, et: type[BaseException] | None, ev: BaseException | None,
                        tb: TracebackType | None) -> None:
        resp = self.resp
        if resp is not None:
            resp._abort()  # body not read to its end: the connection can't be reused
