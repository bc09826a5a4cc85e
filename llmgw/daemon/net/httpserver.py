"""A lean HTTP/1.1 server on trio.

Not hypercorn: on trio it costs ~0.7 ms CPU a request and never tells a streaming
app that its client left (shared/specs/python-stack.md).  Here one task per
connection serves requests in order (keep-alive, pipelining) and one reader task
for the whole server owns the receive sides (a private edge-triggered epoll: no task
and no wake-up of its own per connection); while a handler runs or its response is
sent, EOF or a reset from the peer cancels it at once, so the handler's ``finally:``
blocks run and a streaming body is ``aclose()``d.  A half-close after the request
counts as leaving: LLM clients don't do that, and a stuck stream would hold an
engine slot.  Connections are accepted by a plain loop on the listening socket, and
use raw non-blocking sockets: with a new connection per request, trio's
serve_listeners/SocketStream layers took ~6% (accept) and ~8% (close) of the router's
busy time in py-spy samples.

A streaming body is an async iterator of chunks, or a :class:`RelayBody` that writes
itself into a :class:`BodySink` (the router's proxied responses: each upstream read
is framed and written to the client by whoever read it, without waking this task).

The protocol itself (request parsing, response framing) is the pure codec in
llmgw.http1.server; this module only moves its bytes.  It replaced h11, which cost
several times more a request (header validation, event objects, its state machine).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket as _socket
import stat
import struct
import types
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import suppress
from dataclasses import dataclass, field
from math import inf
from typing import Any, NoReturn, TypedDict, Unpack
from urllib.parse import parse_qsl

import trio

from llmgw.daemon.net.inline_epoll import HANGUP, InlineEpoll
from llmgw.http1.errors import LocalProtocolError, RemoteProtocolError
from llmgw.http1.fields import first_header
from llmgw.http1.server import (
    BODY_CHUNKED,
    BODY_LENGTH,
    BODY_NONE,
    CONTINUE,
    RequestParser,
    serialize_response_head,
)
# RelayBody types Response.body.  BodySink is only re-exported (its old home): import it from llmgw.http1.
from llmgw.http1.sinks import BodySink, RelayBody  # noqa: F401 (BodySink)

__all__ = ["ErrorBody", "Handler", "Request", "Response", "ServerOptions", "ServerStats", "json_response",
           "openai_error_body", "serve_listeners", "serve_tcp", "serve_unix", "text_response"]

logger = logging.getLogger(__name__)

_RECV = 65536
_LINGER = 1.0  # s: drain a rejected request so our close doesn't RST away the 4xx
_CLEANUP = 5.0  # s: bound on a streaming body's aclose() (its finally may await)
_BYTES = (bytes, bytearray, memoryview)
_GONE = (trio.BrokenResourceError, trio.ClosedResourceError)
_NOSIGNAL = getattr(_socket, "MSG_NOSIGNAL", 0)
_wait_readable = trio.lowlevel.wait_readable
_wait_writable = trio.lowlevel.wait_writable
# With one of these in an event, read until EAGAIN or EOF: a short read does not mean that
# the peer's FIN is not queued behind the data (and it raises no further edge).
_HANGUP = HANGUP
_ACCEPT_CAPACITY = frozenset(getattr(errno, e) for e in ("EMFILE", "ENFILE", "ENOMEM", "ENOBUFS") if hasattr(errno, e))
_CLOSE, _KEEP = 1, 2  # _Server.run: the response was sent; the connection closes / is kept
_COALESCE = 16384  # stream bytes held back while the body produces synchronously, at most
_LAST_CHUNK = b"0\r\n\r\n"  # the end of a chunked body (no trailers)


@dataclass(slots=True)
class Request:
    method: str
    target: str  # raw request-target, e.g. "/v1/models?x=1"
    path: str  # target before "?", not percent-decoded
    query: str  # target after "?", raw
    headers: list[tuple[str, str]]  # names lowercased, in arrival order
    body: bytes
    client: tuple[str, int] | None  # None on Unix sockets
    http_version: str = "1.1"

    def header(self, name: str) -> str | None:
        """First value of header ``name`` (case-insensitive), or None."""
        return first_header(self.headers, name.lower())

    def query_params(self) -> dict[str, str]:
        """Decoded query parameters; the last of repeated keys wins."""
        return dict(parse_qsl(self.query, keep_blank_values=True))

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass(slots=True)
class Response:
    status: int
    headers: list[tuple[str, str]] = field(default_factory=list)  # str names and values
    # bytes -> Content-Length; async iterator -> chunked (HTTP/1.1), one write per chunk;
    # a RelayBody -> chunked, written by the body itself.
    body: bytes | AsyncIterator[bytes] | RelayBody = b""


Handler = Callable[[Request], Awaitable[Response]]
ErrorBody = Callable[[int, str, str], Any]  # (status, message, type) -> JSON-able object


def json_response(status: int, obj: Any, headers: Iterable[tuple[str, str]] = ()) -> Response:
    body = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
    return Response(status, [("content-type", "application/json"), *headers], body)


def text_response(status: int, text: str, headers: Iterable[tuple[str, str]] = (),
                  content_type: str = "text/plain; charset=utf-8") -> Response:
    return Response(status, [("content-type", content_type), *headers], text.encode())


def openai_error_body(status: int, message: str, err_type: str) -> Any:
    """OpenAI's error envelope: the default for errors the server itself produces."""
    return {"error": {"message": message, "type": err_type, "param": None, "code": status}}


@dataclass(slots=True)
class ServerStats:
    """Plain counters bumped inline; read them from the same trio run."""
    connections_open: int = 0
    connections_total: int = 0
    requests_active: int = 0
    requests_served: int = 0  # responses written completely
    client_disconnects: int = 0  # requests cut short because the peer left
    handler_errors: int = 0  # handler or streaming body raised


class ServerOptions(TypedDict, total=False):
    max_body_bytes: int  # larger request bodies get 413 (default 16 MiB)
    max_head_bytes: int  # request line + headers; larger gets 431 (default 64 KiB)
    keepalive_timeout: float  # idle wait for a request's first byte (default 60 s)
    request_timeout: float  # first byte -> whole head + body, anti-slowloris (default 30 s)
    error_body: ErrorBody  # envelope of server-made errors (default: openai_error_body)
    stats: ServerStats  # pass one in to read the counters
    peer_uid: int  # Unix sockets: other users' connections get 403 (SO_PEERCRED; where the OS has it)


class _Conn:
    """State shared by a connection's request loop and the server's reader."""
    __slots__ = (
        "backlog",
        "client",
        "deadline",
        "discard",
        "eof",
        "fd",
        "fed",
        "flushing",
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
        self.main: trio.lowlevel.Task | None = None  # request loop parked for input
        self.keep_alive = True  # the request being handled allows another one after it
        self.nursery: trio.Nursery | None = None  # the server's, for a flusher task
        self.pending = b""  # response bytes produced but not yet written (see send_now)
        self.backlog = b""  # bytes the flusher task still has to write
        self.flushing: trio.Event | None = None  # set when the flusher task is done
        self.fed = 0  # reads fed to the parser (or EOF) so far

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


class _Server:
    def __init__(self, handler: Handler, *, max_body_bytes: int = 16 << 20,
                 max_head_bytes: int = 64 << 10, keepalive_timeout: float = 60.0,
                 request_timeout: float = 30.0, error_body: ErrorBody = openai_error_body,
                 stats: ServerStats | None = None, peer_uid: int | None = None) -> None:
        self.handler, self.error_body = handler, error_body
        self.peer_uid = peer_uid
        self.max_body, self.max_head = max_body_bytes, max_head_bytes
        self.keepalive_timeout, self.request_timeout = keepalive_timeout, request_timeout
        self.stats = stats if stats is not None else ServerStats()
        self.too_large = f"Request body exceeds the limit of {max_body_bytes} bytes"
        self.conns: set[_Conn] = set()
        self.tick = max(0.01, min(1.0, keepalive_timeout / 4, request_timeout / 4))
        self.nursery: trio.Nursery | None = None  # the connections' tasks (and flushers)
        # The read side of all connections: each socket registered once, edge-triggered,
        # read in place by _Conn.on_readable when ready (no reader task per connection,
        # no task switch to learn of input); also what tells a running handler at once
        # that its client left (EOF or reset cancels it).
        self.readers: InlineEpoll | None = None

    async def sweep(self) -> NoReturn:
        # Read timeouts by one periodic sweep instead of a trio deadline per
        # request (~10% of a small request's CPU); a timeout fires <= 1 tick late.
        while True:
            await trio.sleep(self.tick)
            now = trio.current_time()
            for c in self.conns:
                if c.deadline <= now:
                    c.timed_out = True
                    c.scope.cancel()

    def error(self, status: int, message: str) -> Response:
        kind = "server_error" if status >= 500 else "invalid_request_error"
        return json_response(status, self.error_body(status, message, kind))

    async def accept_loop(self, listener: trio.SocketListener) -> NoReturn:
        """Accept connections, each served by its own task in the server's nursery.

        Not trio.serve_listeners: its SocketStream wrapping, getsockopt/getpeername calls
        and closing checkpoint took ~14% of the router's busy time with a new connection
        per request (py-spy)."""
        # A second Python socket on the listener's fd, detached (never closed) at the end.
        lsock = _socket.socket(fileno=listener.socket.fileno())
        try:
            lsock.setblocking(False)
            nursery = self.nursery
            assert nursery is not None
            accepted = 0
            while True:
                try:
                    sock, addr = lsock.accept()
                except BlockingIOError:
                    accepted = 0
                    await _wait_readable(lsock)
                    continue
                except OSError as exc:
                    if exc.errno not in _ACCEPT_CAPACITY:
                        raise
                    logger.error("accept failed (%s): retrying in 0.1 s", exc)
                    await trio.sleep(0.1)
                    continue
                nursery.start_soon(self.connection, sock, addr)
                accepted += 1
                if not accepted % 64:
                    await trio.lowlevel.checkpoint()  # a flood of connections: let them run too
        finally:
            lsock.detach()
            with trio.CancelScope(shield=True):
                await listener.aclose()

    async def connection(self, sock: _socket.socket, addr: Any) -> None:
        client = None
        try:
            sock.setblocking(False)
            if sock.family != _socket.AF_UNIX:
                # Not left to a default: Nagle + delayed ACK stall small writes on
                # keep-alive connections by ~40 ms.
                sock.setsockopt(_socket.IPPROTO_TCP, _socket.TCP_NODELAY, 1)
                client = tuple(addr[:2])
        except OSError:
            sock.close()
            return  # already gone
        readers = self.readers
        assert readers is not None
        c = _Conn(sock, RequestParser(max_head_bytes=self.max_head, max_body_bytes=self.max_body), client, readers)
        c.nursery = self.nursery
        stats = self.stats
        stats.connections_open += 1
        stats.connections_total += 1
        self.conns.add(c)
        try:
            # The first request is usually in already: read it here, then register
            # (which reports whatever came meanwhile), saving the reader a round.
            c.on_readable(0)
            if not c.eof:
                readers.register(c.fd, c.on_readable)
            if self.peer_uid is not None and (uid := _peer_uid(sock)) not in (None, self.peer_uid):
                logger.warning("refused a connection from uid %s", uid)
                await self.reject(c, 403, "This socket serves its owner only")
            else:
                with c.scope, suppress(*_GONE):  # _GONE: the peer vanished as we wrote
                    await self.request_loop(c)
                if c.timed_out and c.reading and not c.eof:
                    await self.reject(c, 408, "Timed out reading the request")
        except Exception:  # Cancelled (shutdown) passes; nothing else may kill the server
            logger.exception("HTTP connection from %s failed", client)
        finally:
            readers.forget(c.fd, c.on_readable)
            self.conns.discard(c)
            stats.connections_open -= 1
            trio.lowlevel.notify_closing(sock)  # a flusher task still writing stops
            sock.close()

    async def request_loop(self, c: _Conn) -> None:
        stats = self.stats
        while (req := await self.read_request(c)) is not None:
            c.deadline = inf  # handling has no time limit; a disconnect ends it
            if c.paused and not c.parser.buffered:
                c.resume_reader()  # pipelined input consumed: watch this request again
            stats.requests_active += 1
            c.handling, served = True, 0
            try:
                served = await self.run(c, req)
            finally:
                c.handling = False
                stats.requests_active -= 1
                if served:
                    stats.requests_served += 1
                elif c.eof:
                    stats.client_disconnects += 1
            if served != _KEEP:
                return  # error, or HTTP/1.0 / "connection: close" / a close-delimited body

    async def read_request(self, c: _Conn) -> Request | None:
        p = c.parser
        # Idle keep-alive wait until the first byte, then one deadline for the whole
        # head + body: per-read timeouts would let a slowloris trickle forever.
        c.reading = bool(p.buffered)  # pipelined bytes already buffered
        if c.reading:
            await trio.lowlevel.checkpoint()  # no wait for input this cycle: yield here
        c.deadline = trio.current_time() + (self.request_timeout if c.reading else self.keepalive_timeout)
        try:
            while (r := p.next_request()) is None:
                if p.expect_continue:
                    p.expect_continue = False
                    await c.write(CONTINUE)
                    continue  # input may have arrived meanwhile
                if not await c.wait_input():
                    return None  # EOF: idle close, or a truncated request
                if not c.reading:
                    c.reading = True
                    c.deadline = trio.current_time() + self.request_timeout
        except RemoteProtocolError as exc:
            await self.reject(c, exc.status, self.too_large if exc.status == 413 else f"Malformed HTTP request: {exc}")
            return None
        c.reading = False
        target = r.target
        path, _, query = target.partition("?")
        req = Request(r.method, target, path, query, r.headers, r.body, c.client, r.http_version)
        c.keep_alive = r.keep_alive
        return req

    async def reject(self, c: _Conn, status: int, message: str) -> None:
        """Answer an unreadable request with an error, then close gracefully."""
        resp = self.error(status, message)
        body = resp.body
        assert isinstance(body, bytes)
        head = serialize_response_head(status, resp.headers, http_version=None, keep_alive=False,
                                       body_length=len(body))[0]
        # Closing with unread input makes the kernel send RST, which can destroy the
        # 4xx before the client reads it: half-close and drain until EOF, bounded.
        c.discard = True
        with trio.move_on_after(_LINGER), suppress(*_GONE):
            await c.write(head + body)
            try:
                c.out.shutdown(_socket.SHUT_WR)
            except OSError:
                return  # gone already
            while await c.wait_input():
                pass

    async def run(self, c: _Conn, req: Request) -> int:
        """Call the handler and send its response: _KEEP if the connection is reusable,
        _CLOSE if the response was sent but the connection must close, 0 on failure."""
        try:
            resp = await self.handler(req)
        except Exception:
            logger.exception("handler failed: %s %s", req.method, req.target)
            self.stats.handler_errors += 1
            resp = self.error(500, "Internal server error")
        try:
            head, framing, length, keep = self.frame(c, req, resp)
        except Exception:
            # Nothing is sent yet: answer 500 as if the handler had raised.
            logger.exception("handler returned an invalid response: %s %s", req.method, req.target)
            self.stats.handler_errors += 1
            if not isinstance(resp.body, _BYTES):
                await self.close_body(resp.body)
            resp = self.error(500, "Internal server error")
            head, framing, length, keep = self.frame(c, req, resp)
        body = resp.body
        sized = isinstance(body, _BYTES)
        done = _KEEP if keep else _CLOSE
        try:
            if not sized and (relay := getattr(body, "relay", None)) is not None:
                c.pending = head  # out with the first piece, or when the body has to wait
                return await self.relay_body(c, req, body, relay, framing, length, done)  # type: ignore[arg-type]
            if sized:  # one write
                if framing == BODY_CHUNKED:  # the handler asked for chunked itself
                    await c.write(b"%b%x\r\n%b\r\n0\r\n\r\n" % (head, len(body), body) if body  # type: ignore[arg-type]
                                  else head + b"0\r\n\r\n")
                else:
                    await c.write(head + body if body and framing != BODY_NONE else head)  # type: ignore[operator]
                return done
            c.pending = head  # out with the first chunk, if that comes without waiting
            try:
                if req.method != "HEAD":
                    # Body bytes still allowed: the declared length, none, or no limit (-1).
                    left = length if framing == BODY_LENGTH else 0 if framing == BODY_NONE else -1
                    await self.stream_body(c, body, framing == BODY_CHUNKED, left)  # type: ignore[arg-type]
            finally:
                await self.close_body(body, c)  # type: ignore[arg-type]
            data, c.pending = c.pending, b""
            await c.write(data + b"0\r\n\r\n" if framing == BODY_CHUNKED and req.method != "HEAD" else data)
            return done
        except _GONE:
            c.eof = True  # the peer reset while we wrote: it left
            return 0
        except Exception:
            # Mid-stream the head is out already: closing without the last chunk is
            # how the client learns the body is truncated.
            logger.exception("sending the response failed: %s %s", req.method, req.target)
            self.stats.handler_errors += 1
            if c.pending:
                c.send_now()  # what the body did produce, best effort
            return 0

    async def relay_body(self, c: _Conn, req: Request, body: RelayBody, relay: Any, framing: int, length: int,
                         done: int) -> int:
        """Send a RelayBody, its head waiting in c.pending (see run(); the same errors propagate)."""
        if req.method == "HEAD":
            await self.close_body(body)
        else:
            sink = _Sink(c, framing == BODY_CHUNKED, length if framing == BODY_LENGTH else 0
                         if framing == BODY_NONE else -1)
            await relay(sink)  # it cleans up after itself, whatever happens
            await sink.drain()
            if sink.left > 0:
                raise LocalProtocolError("the body is shorter than its content-length")
            if sink.ended:
                return done  # the end went with the last bytes
        data, c.pending = c.pending, b""
        await c.write(data + _LAST_CHUNK if framing == BODY_CHUNKED and req.method != "HEAD" else data)
        return done

    @staticmethod
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

    @staticmethod
    def frame(c: _Conn, req: Request, resp: Response) -> tuple[bytes, int, int, bool]:
        """The response head and its framing (see serialize_response_head)."""
        body = resp.body
        sized = isinstance(body, _BYTES)
        out = serialize_response_head(resp.status, resp.headers, method=req.method, http_version=req.http_version,
                                      keep_alive=c.keep_alive, body_length=len(body) if sized else None)
        if sized and body:
            framing, length = out[1], out[2]
            if (framing == BODY_LENGTH and len(body) != length) or (framing == BODY_NONE and req.method != "HEAD"):
                raise LocalProtocolError(f"a body of {len(body)} bytes does not fit status {resp.status} "
                                    f"with content-length {length}")
        return out

    @staticmethod
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


async def serve_listeners(handler: Handler, listeners: list[trio.SocketListener], *,
                          task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
                          **options: Unpack[ServerOptions]) -> NoReturn:
    """Serve HTTP on listening sockets until cancelled; ``started(listeners)``.

    Cancelling closes the listeners and every connection, cancelling in-flight
    handlers and closing streaming bodies; nothing outlives the call.
    """
    server = _Server(handler, **options)
    server.readers = readers = InlineEpoll("http server")
    try:
        async with trio.open_nursery() as nursery:
            server.nursery = nursery
            nursery.start_soon(readers.run)
            nursery.start_soon(server.sweep)
            for listener in listeners:
                nursery.start_soon(server.accept_loop, listener)
            task_status.started(listeners)
    finally:
        for listener in listeners:  # those whose accept loop never started
            with trio.CancelScope(shield=True):
                await listener.aclose()
    raise AssertionError("unreachable")  # pragma: no cover


async def serve_tcp(handler: Handler, host: str = "127.0.0.1", port: int = 0, *,
                    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
                    backlog: int | None = None, **options: Unpack[ServerOptions]) -> NoReturn:
    """Serve HTTP on host:port; ``started(bound_port)`` (useful with port 0).

    Give a literal address: with port 0, a name that resolves to several addresses
    gets a different ephemeral port on each, and only the first is reported.
    """
    listeners = await trio.open_tcp_listeners(port, host=host, backlog=backlog)
    task_status.started(listeners[0].socket.getsockname()[1])
    await serve_listeners(handler, listeners, **options)


async def serve_unix(handler: Handler, path: str | os.PathLike[str], *,
                     task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
                     backlog: int = 4096, **options: Unpack[ServerOptions]) -> NoReturn:
    """Serve HTTP on a Unix socket at ``path``, mode 0600; ``started(path)``.

    Put it in a 0700 directory: between bind() and chmod() the socket has umask
    permissions, and only the directory closes that window.  A stale socket file
    is replaced; one with a live server behind it raises EADDRINUSE.  The file is
    removed on exit.  Requests get ``client=None``; ``peer_uid=os.getuid()`` refuses
    other users (SO_PEERCRED) with 403.
    """
    path = os.fspath(path)
    _remove_stale_socket(path)
    sock = trio.socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        await sock.bind(path)
        os.chmod(path, 0o600)
        sock.listen(backlog)
        ino = os.stat(path).st_ino
    except BaseException:
        sock.close()
        raise
    try:
        task_status.started(path)
        await serve_listeners(handler, [trio.SocketListener(sock)], **options)
    finally:
        with suppress(OSError):
            if os.stat(path).st_ino == ino:  # not a successor's socket
                os.unlink(path)


def _peer_uid(sock: _socket.socket | trio.socket.SocketType) -> int | None:
    """The uid of a Unix socket's peer; None elsewhere or where the OS has no SO_PEERCRED (not
    Linux: the socket's 0700 directory is the guard there)."""
    opt = getattr(_socket, "SO_PEERCRED", None)
    if opt is None or sock.family != _socket.AF_UNIX:
        return None
    try:
        return struct.unpack("3i", sock.getsockopt(_socket.SOL_SOCKET, opt, struct.calcsize("3i")))[1]
    except OSError:
        return -1  # unknown where it should be known: nobody's uid, so refused


def _remove_stale_socket(path: str) -> None:
    try:
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            return  # not ours to delete; bind() will fail with EADDRINUSE
    except FileNotFoundError:
        return
    with _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM) as probe:
        probe.setblocking(False)  # a live server with a full backlog must not hang us
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            os.unlink(path)  # nobody listening: left over from a crashed run
            return
        except BlockingIOError:
            pass
    raise OSError(errno.EADDRINUSE, "a server is already listening on this socket", path)
