"""One HTTP server connection on trio: its state, its reader and its write paths.

:class:`_Conn` is what a connection's request loop (``httpserver._Server``) and the
server's reader share: ``on_readable`` is the reader's callback (it feeds the request
parser and wakes the loop, or cancels a running handler when the peer leaves), and
``write``/``send_now`` write straight to the non-blocking socket, a flusher task taking
what a full socket refuses.  The response bodies go out from here too: :class:`_Sink`
is the :class:`~llmgw.http1.sinks.BodySink` a RelayBody writes into, ``stream_body``
sends an async iterator's chunks, ``close_body`` closes a body (shielded, bounded).

Split from httpserver.py, whose server loop drives these; the hot paths of every request
and every streamed chunk run here, so they stay as they were measured (see bench/).
"""

from __future__ import annotations

import socket as _socket
import types
from collections.abc import AsyncIterator
from math import inf
from typing import Any

import trio

from llmgw.daemon.net.inline_epoll import HANGUP, InlineEpoll
from llmgw.http1.errors import LocalProtocolError
from llmgw.http1.server import RequestParser
from llmgw.http1.sinks import RelayBody

__all__: list[str] = []  # internal to llmgw.daemon.net.httpserver (its _Server drives these)

_RECV = 65536
_CLEANUP = 5.0  # s: bound on a streaming body's aclose() (its finally may await)
_GONE = (trio.BrokenResourceError, trio.ClosedResourceError)
_NOSIGNAL = getattr(_socket, "MSG_NOSIGNAL", 0)
_wait_writable = trio.lowlevel.wait_writable
# With one of these in an event, read until EAGAIN or EOF: a short read does not mean that
# the peer's FIN is not queued behind the data (and it raises no further edge).
_HANGUP = HANGUP
_COALESCE = 16384  # stream bytes held back while the body produces synchronously, at most
_LAST_CHUNK = b"0\r\n\r\n"  # the end of a chunked body (no trailers)


class _Conn:
    """State shared by a connection's request loop and the server's reader."""
    __slots__ = (
        "backlog",
        "client",
        "deadline",
        "discard",
        "eof",
        "evicted",
        "fd",
        "fed",
        "flushing",
        "fresh",
        "handling",
        "keep_alive",
        "main",
        "nursery",
        "out",
        "parser",
        "paused",
        "pending",
        "readers",
        "reading",
        "ready",
        "reset",
        "scope",
        "timed_out",
    )

    def __init__(self, sock: _socket.socket, parser: RequestParser, client: tuple[str, int] | None,
                 readers: InlineEpoll | None = None) -> None:
        self.out, self.fd, self.parser, self.client = sock, sock.fileno(), parser, client
        self.readers = readers  # None: nobody reads (tests of the write side)
        # Wraps the request loop; cancelled by the reader when the peer leaves and by
        # the server's sweeper when ``deadline`` passes.  One per connection, so a
        # request costs no scope enter/exit and no deadline re-arming.
        self.scope = trio.CancelScope()
        self.deadline = inf  # read timeout; inf while a request is handled
        self.timed_out = self.eof = self.reading = self.handling = False
        self.paused = False  # reader holds off: the parser has unconsumed pipelined bytes
        self.ready = False  # an edge came while paused: read when resumed
        self.discard = False  # lingering close: throw input away
        self.reset = False  # close with a reset (an aborted close-delimited body)
        self.evicted = False  # closed to make room for a new connection (http_limits)
        self.main: trio.lowlevel.Task | None = None  # request loop parked for input
        self.keep_alive = True  # the request being handled allows another one after it
        self.nursery: trio.Nursery | None = None  # the server's, for a flusher task
        self.pending = b""  # response bytes produced but not yet written (see send_now)
        self.backlog = b""  # bytes the flusher task still has to write
        self.flushing: trio.Event | None = None  # set when the flusher task is done
        self.fed = 0  # reads fed to the parser (or EOF) so far
        self.fresh = True  # no request read yet (a drain lets it bring its first one)

    def on_readable(self, mask: int = _HANGUP) -> None:
        """Read what the socket holds (the reader's callback; never raises).

        Always watching (unless paused), so that a running handler learns at once that
        its client left, at no extra syscall.  Edge-triggered: reads until a short read
        (data arriving later raises a new edge; with a hang-up in ``mask``, until EAGAIN
        or EOF) or holds off with ``ready`` set."""
        if self.paused:
            self.ready = True
            return
        sock = self.out
        for _ in range(16):
            try:
                data = sock.recv(_RECV)
            except BlockingIOError:
                return
            except OSError:
                data = b""  # reset, or closed under us
            if not data:
                self.gone()
                return
            if self.discard:
                continue
            self.parser.feed(data)
            self.fed += 1
            if self.handling:
                # Pipelined bytes mid-request: keep them for the next cycle and stop
                # watching, rather than buffer without bound.
                self.paused = self.ready = True
                self._wake_main()
                return
            self._wake_main()
            if len(data) < _RECV and not mask & _HANGUP:
                return
        if self.readers is not None:
            self.readers.later(self.fd)

    async def write(self, data: bytes) -> None:
        # Straight to the socket when it takes everything, as it nearly always
        # does: trio's send_all costs 2-3x the syscall, ~30% of a streamed chunk.
        # Only a full socket waits: the backpressure.
        if self.flushing is not None:
            await self.flushing.wait()  # after what the flusher task still holds
        try:
            n = self.out.send(data, _NOSIGNAL)
        except BlockingIOError:
            n = 0
        except OSError as exc:
            raise trio.BrokenResourceError(exc) from exc
        if n < len(data):
            await _send_all(self.out, memoryview(data)[n:])

    def send_now(self) -> None:
        """Write ``pending`` without waiting, for a caller that must not block now.

        What the socket does not take goes out from a flusher task, which later
        writes wait for.  Never raises: a peer found gone is handled like EOF.
        """
        data, self.pending = self.pending, b""
        if self.flushing is not None:
            self.backlog += data
            return
        try:
            n = self.out.send(data, _NOSIGNAL)
        except BlockingIOError:
            n = 0
        except OSError:
            self.gone()
            return
        if n < len(data):
            assert self.nursery is not None
            self.backlog = data[n:]
            self.flushing = trio.Event()
            self.nursery.start_soon(self._flush)

    async def _flush(self) -> None:
        try:
            while self.backlog:
                data, self.backlog = self.backlog, b""
                await _send_all(self.out, data)
        except _GONE:
            self.gone()
        finally:
            assert self.flushing is not None
            self.flushing.set()
            self.flushing = None

    def gone(self) -> None:
        """The peer left (EOF, or a write failed): stop its handler/stream now."""
        self.eof = True
        self.fed += 1
        if self.readers is not None:
            self.readers.forget(self.fd, self.on_readable)
        if self.main is not None:
            # Parked for input (between requests, or inside one): wait_input() returns
            # and reports EOF, cheaper than delivering a Cancelled (that took ~8% of the
            # router's busy time with a connection closed after each request).
            self._wake_main()
        else:
            self.scope.cancel()  # a handler or a response under way: stop it now

    def evict(self) -> None:
        """Close to make room for a new connection (it waits for a request: nothing is lost)."""
        self.scope.cancel()

    def _wake_main(self) -> None:
        if self.main is not None:
            trio.lowlevel.reschedule(self.main)
            self.main = None

    def resume_reader(self) -> None:
        """Watch again (pipelined input consumed); reads what came meanwhile, here."""
        self.paused = False
        if self.ready:
            self.ready = False
            self.on_readable()

    async def wait_input(self) -> bool:
        """Park until the reader brings data or EOF; False once the peer is gone."""
        if self.eof:
            return False
        fed = self.fed
        self.resume_reader()
        if self.fed != fed:
            return True  # resuming read something already
        self.main = trio.lowlevel.current_task()
        await trio.lowlevel.wait_task_rescheduled(self._abort_main)
        return True

    def _abort_main(self, _: object) -> trio.lowlevel.Abort:
        self.main = None  # cancelled while parked: the reader must not wake us
        return trio.lowlevel.Abort.SUCCEEDED


async def _send_all(sock: _socket.socket, data: bytes | memoryview) -> None:
    """Write all of ``data``, waiting for the socket when it is full (the backpressure)."""
    view = memoryview(data)
    while view:
        try:
            n = sock.send(view, _NOSIGNAL)
        except BlockingIOError:
            try:
                await _wait_writable(sock)
            except trio.ClosedResourceError as exc:
                raise trio.BrokenResourceError(exc) from exc
            continue
        except OSError as exc:
            raise trio.BrokenResourceError(exc) from exc
        view = view[n:]


class _Sink:
    """The BodySink of one response: frames each piece and writes it straight to the socket
    (chunked, or counted against a Content-Length); what the socket refuses is kept for
    ``drain()``.  The response head waits in ``c.pending`` and goes with the first piece."""
    __slots__ = ("c", "chunked", "ended", "left", "rest")

    def __init__(self, c: _Conn, chunked: bool, left: int) -> None:
        self.c, self.chunked, self.left = c, chunked, left  # left: bytes still allowed, -1 no limit
        self.rest = b""
        self.ended = False  # the end of the body went out (with its last bytes)

    def send_nowait(self, data: bytes, end: bool = False) -> bool:
        c = self.c
        if end:
            self.ended = True
        if self.chunked:
            if data:
                data = b"%b%x\r\n%b\r\n%b" % (c.pending, len(data), data, _LAST_CHUNK if end else b"")
            else:
                data = c.pending + _LAST_CHUNK if end else c.pending
        else:
            if self.left >= 0:
                self.left -= len(data)
                if self.left < 0:
                    raise LocalProtocolError("the body is longer than its content-length")
            if c.pending:
                data = c.pending + data
        c.pending = b""
        return self._send(data)

    def flush_nowait(self) -> None:
        c = self.c
        if c.pending:
            data, c.pending = c.pending, b""
            self._send(data)

    def _send(self, data: bytes) -> bool:
        if self.rest or self.c.flushing is not None:
            self.rest += data
            return False
        if not data:
            return True
        try:
            n = self.c.out.send(data, _NOSIGNAL)
        except BlockingIOError:
            n = 0
        except OSError as exc:
            raise trio.BrokenResourceError(exc) from exc
        if n < len(data):
            self.rest = data[n:]
            return False
        return True

    async def drain(self) -> None:
        c = self.c
        if c.flushing is not None:
            await c.flushing.wait()
        if self.rest:
            data, self.rest = self.rest, b""
            await _send_all(c.out, data)


async def stream_body(c: _Conn, body: AsyncIterator[bytes], chunked: bool, left: int) -> None:
    """Send a streaming body, each chunk as soon as it is there.

    Chunks go to ``c.pending`` and out when the body would block for the next
    one: a body that produces several at once (or the head and the first chunk,
    or the last chunk and the end of the response) costs one send() for all.
    Each ``__anext__`` is stepped by hand to learn whether it would block,
    without an extra task or a timer (which cost more than the sends saved).
    """
    it = body.__aiter__()
    anext = type(it).__anext__
    i = 0
    while True:
        step = anext(it).__await__()
        try:
            trap = step.send(None)
        except StopIteration as ready:
            chunk = ready.value  # produced without blocking
        except StopAsyncIteration:
            break
        else:
            if c.pending:  # it has to wait: what we hold goes out first
                c.send_now()
            try:
                chunk = await _resume(step, trap)
            except StopAsyncIteration:
                break
        if chunk:  # an empty chunk would end a chunked body
            if chunked:
                c.pending = b"%b%x\r\n%b\r\n" % (c.pending, len(chunk), chunk)
            else:
                if left >= 0:
                    left -= len(chunk)
                    if left < 0:
                        raise LocalProtocolError("the body is longer than its content-length")
                c.pending = b"%b%b" % (c.pending, chunk)
            if len(c.pending) >= _COALESCE:
                # A full socket blocks here: that is the generator's backpressure.
                data, c.pending = c.pending, b""
                await c.write(data)
        i += 1
        if not i & 15:  # don't let a generator that never awaits hog the loop
            data, c.pending = c.pending, b""
            if data:
                await c.write(data)
            await trio.lowlevel.checkpoint()
    if left > 0:
        raise LocalProtocolError("the body is shorter than its content-length")


async def close_body(body: AsyncIterator[bytes] | RelayBody, c: _Conn | None = None) -> None:
    if (aclose := getattr(body, "aclose", None)) is not None:
        if getattr(body, "ag_frame", True) is None:
            return  # an exhausted async generator: nothing to close, and no cancel scope
        # Shielded so the generator's finally may await (e.g. cancel an
        # upstream request) although we got here by cancellation; bounded.
        # (The scope is entered before the cleanup starts: scopes the cleanup
        # opens must nest inside it.)
        with trio.CancelScope(shield=True, deadline=trio.current_time() + _CLEANUP):
            step = aclose().__await__()
            try:
                trap = step.send(None)
            except StopIteration:
                return  # closed without waiting
            if c is not None and c.pending:
                c.send_now()  # the body's last bytes don't wait for its cleanup
            await _resume(step, trap)


@types.coroutine
def _resume(step: Any, trap: Any) -> Any:
    """``await _resume(step, trap)``: the rest of an await begun by hand with
    ``step.send(None)``, which returned ``trap`` (the operation parked on a trio
    primitive).  Hands the trap to trio and relays what comes back, as ``yield from``
    would; the operation has registered for its wake-up, so nothing may run between."""
    while True:
        try:
            value = yield trap
        except GeneratorExit:
            step.close()
            raise
        except BaseException as exc:  # Cancelled, KeyboardInterrupt: into the operation
            try:
                trap = step.throw(exc)
            except StopIteration as done:
                return done.value
        else:
            try:
                trap = step.send(value)
            except StopIteration as done:
                return done.value
