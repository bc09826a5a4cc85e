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
  ``notify_closing``.  A timeout therefore fires up to one resolution late.  With no
  connection checked out the sweeper sleeps until one is (an idle router wakes for nothing).
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

Where things live (each module imports only those below it): here, the pool
(connections: connect, check out, release, expire; the timeout sweeper).  Below it:
:mod:`llmgw.daemon.net.upstream_exchange`, the exchange (``_Exchange``: send the
request, read the head, resend once on a stale connection);
:mod:`llmgw.daemon.net.upstream_response`, the response and its body (iterate, read,
relay); :mod:`llmgw.daemon.net.upstream_relay`, the relay reactor and pump, with the
connection record, PoolStats and the interfaces the others share;
:mod:`llmgw.daemon.net.upstream_errors`, the errors.  Import the public names
(UpstreamPool, UpstreamResponse, Reply, PoolStats, the errors) from this module.
"""

from __future__ import annotations

import math
import os
import socket as _socket
from collections import deque
from collections.abc import Sequence
from types import TracebackType

import trio

# The errors and the response are re-exported: import them from here.
from llmgw.daemon.net.upstream_errors import (
    UpstreamClosed,
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTimeout,
)
from llmgw.daemon.net.upstream_exchange import _Exchange, _parse_base
from llmgw.daemon.net.upstream_relay import PoolStats, _Conn, _Reactor
from llmgw.daemon.net.upstream_response import Reply, UpstreamResponse

__all__ = ["PoolStats", "Reply", "UpstreamClosed", "UpstreamConnectError", "UpstreamError", "UpstreamPool",
           "UpstreamProtocolError", "UpstreamResponse", "UpstreamTimeout"]

_PEEK = _socket.MSG_PEEK | getattr(_socket, "MSG_DONTWAIT", 0)
_INF = math.inf
_PEEK_AFTER = 1.0  # s idle before a reused connection is checked for a close by the server
_wait_writable = trio.lowlevel.wait_writable
_current_time = trio.current_time


# ---------------------------------------------------------------------------------- pool
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
        self._wake_sweeper: trio.Event | None = None  # set when a connection is checked out and the sweeper sleeps
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
                if not active:  # nothing to watch: no wake-ups (an idle router) until a checkout
                    self._wake_sweeper = trio.Event()
                    await self._wake_sweeper.wait()
                    self._wake_sweeper = None
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
