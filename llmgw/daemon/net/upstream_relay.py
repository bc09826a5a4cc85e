"""The upstream pool's relay: response bodies moved from upstream sockets to their sinks.

``UpstreamResponse.relay(sink)`` (in :mod:`llmgw.daemon.net.upstream_response`) hands its
connection to the pool's :class:`_Reactor`, a system task running an InlineEpoll over the
sockets being relayed, and parks in :meth:`_Pump.park`.  Each ready socket is read and its
de-chunked bytes written into the :class:`~llmgw.http1.sinks.BodySink` (the client's side
of the response) in place, by :meth:`_Pump.run`, in the step that learnt of them; the
consumer's task wakes only when the body ends or fails, or when the sink is full.

This is the hot path of every streamed token the router proxies: code here moved as it
was measured (bench/bench_upstream.py, bench/bench_router.py).

Being the bottom of the upstream client (upstream_errors aside), this module also holds
what the modules above share: ``_Conn`` (a connection: socket, pool key, the deadline the
sweeper watches, the pump relaying it), :class:`PoolStats`, the read size ``_RECV`` and
fairness bound ``_FAIR``, and two Protocols by which the lower modules see the upper ones
without importing them: ``_PoolSide`` (the pool, as the exchange, the response and the
relay use it) and ``_RelayedResponse`` (the response, as a pump uses it).
"""

from __future__ import annotations

import math
import socket as _socket
from dataclasses import dataclass
from typing import Any, Protocol

import outcome
import trio

from llmgw.daemon.net.inline_epoll import HANGUP, InlineEpoll
from llmgw.daemon.net.upstream_errors import UpstreamClosed, UpstreamError, UpstreamProtocolError, UpstreamTimeout
from llmgw.http1.client import ResponseParser
from llmgw.http1.errors import RemoteProtocolError
from llmgw.http1.sinks import BodySink

__all__ = ["PoolStats"]  # the rest is internal to the upstream client

_RECV = 65536
_INF = math.inf
_FAIR = 16  # reads that found data waiting in a row before we yield to other tasks
_current_time = trio.current_time
_reschedule = trio.lowlevel.reschedule
# With one of these in an event, read until EAGAIN or EOF: a short read does not mean that
# the peer's FIN is not queued behind the data (and it raises no further edge).
_HANGUP = HANGUP


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


class _PoolSide(Protocol):
    """What the exchange, the response and the relay use of :class:`UpstreamPool` (it lives
    above them, in llmgw.daemon.net.upstream, and implements this)."""

    max_head_bytes: int
    stats: PoolStats
    _active: set[_Conn]
    _reactor: _Reactor | None

    def _checkout(self, key: tuple[str, int]) -> _Conn | None: ...

    async def _connect(self, key: tuple[str, int], timeout: float, url: str) -> _Conn: ...

    def _release(self, c: _Conn) -> None: ...

    def _discard(self, c: _Conn) -> None: ...


class _RelayedResponse(Protocol):
    """What a :class:`_Pump` uses of the response it relays (an ``UpstreamResponse``, which
    lives above it, in llmgw.daemon.net.upstream_response, and implements this)."""

    url: str
    _conn: _Conn | None
    _error: UpstreamError | None
    _idle: float
    _parser: ResponseParser | None
    _pool: _PoolSide
    body_bytes: int
    last_byte_at: float | None

    def _finish(self, c: _Conn, keep_alive: bool) -> None: ...


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

    def __init__(self, resp: _RelayedResponse, c: _Conn, sink: BodySink, reactor: _Reactor) -> None:
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
                if done:  # read before the send: a woken client may preempt this process right after it
                    resp.last_byte_at = now
                if piece:
                    if self.first is None:
                        self.first = now
                    resp.body_bytes += len(piece)
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
