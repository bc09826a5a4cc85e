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
llmgw.http1.server and llmgw.http1.response_head; this module only moves its bytes.  It replaced h11, which cost
several times more a request (header validation, event objects, its state machine).

Where things live: here, the server itself (``_Server``: accepting, the request
loop, reading a request, running the handler and sending its response; serve_listeners,
serve_tcp, serve_unix).  What handlers use (Request, Response, the *_response helpers,
ServerStats, ServerOptions) is in :mod:`llmgw.daemon.net.http_types`, re-exported here;
the bounds on connections (the cap, accept failures) in :mod:`llmgw.daemon.net.http_limits`;
a connection's state, its reader callback and its write paths (the RelayBody sink, streamed
bodies) in :mod:`llmgw.daemon.net.http_conn`; a graceful stop (``Drain``: no new
connection, in-flight requests finish) in :mod:`llmgw.daemon.net.http_drain`; the Unix-socket checks in
:mod:`llmgw.daemon.net.unix_sockets`; the BodySink/RelayBody protocols in
:mod:`llmgw.http1.sinks`.
"""

from __future__ import annotations

import json
import logging
import os
import socket as _socket
import struct
from collections.abc import Awaitable, Callable
from contextlib import suppress
from math import inf
from typing import Any, NoReturn, Unpack

import trio

from llmgw.daemon.net.http_conn import (
    _GONE,
    _LAST_CHUNK,
    _Conn,
    _Sink,
    close_body,
    stream_body,
)
from llmgw.daemon.net.http_drain import Drain
from llmgw.daemon.net.http_limits import ConnectionLimits, refusal
from llmgw.daemon.net.http_types import (
    ErrorBody,
    Handler,
    Request,
    Response,
    ServerOptions,
    ServerStats,
    json_response,
    openai_error_body,
    text_response,
)
from llmgw.daemon.net.inline_epoll import InlineEpoll
from llmgw.daemon.net.reuse_port import bind_reuse_port, listen_on
from llmgw.daemon.net.unix_sockets import _peer_uid, _remove_stale_socket
from llmgw.http1.errors import LocalProtocolError, RemoteProtocolError
from llmgw.http1.response_head import BODY_CHUNKED, BODY_CLOSE, BODY_LENGTH, BODY_NONE, serialize_response_head
from llmgw.http1.server import CONTINUE, RequestParser
from llmgw.http1.sinks import BodyAborted, RelayBody

__all__ = ["Drain", "ErrorBody", "Handler", "Request", "Response", "ServerOptions", "ServerStats", "json_response",
           "openai_error_body", "serve_listeners", "serve_tcp", "serve_unix", "text_response"]

logger = logging.getLogger(__name__)

_LINGER = 1.0  # s: drain a rejected request so our close doesn't RST away the 4xx
_BYTES = (bytes, bytearray, memoryview)
_wait_readable = trio.lowlevel.wait_readable
_CLOSE, _KEEP = 1, 2  # _Server.run: the response was sent; the connection closes / is kept
_RST = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() resets the connection


class _Server:
    def __init__(self, handler: Handler, *, max_body_bytes: int = 16 << 20,
                 max_head_bytes: int = 64 << 10, keepalive_timeout: float = 60.0,
                 first_request_timeout: float = 10.0, request_timeout: float = 30.0,
                 error_body: ErrorBody = openai_error_body, stats: ServerStats | None = None,
                 peer_uid: int | None = None, max_connections: int = 0,
                 on_rejected: Callable[[int], None] | None = None) -> None:
        self.handler, self.error_body = handler, error_body
        self.on_rejected = on_rejected  # told of each request answered here, not by the handler
        self.peer_uid = peer_uid
        self.max_body, self.max_head = max_body_bytes, max_head_bytes
        self.keepalive_timeout, self.request_timeout = keepalive_timeout, request_timeout
        self.first_timeout = min(first_request_timeout, keepalive_timeout)
        self.stats = stats if stats is not None else ServerStats()
        self.stats.max_connections = max_connections
        self.too_large = f"Request body exceeds the limit of {max_body_bytes} bytes"
        self.conns: set[_Conn] = set()
        busy = json.dumps(error_body(503, "The server is at its connection limit; retry shortly.",
                                     "server_error")).encode()
        self.limits = ConnectionLimits(max_connections, self.stats, refusal(busy))
        self.waiting = self.limits.waiting  # the request loop keeps it (see read_request)
        self.tick = max(0.01, min(1.0, keepalive_timeout / 4, self.first_timeout / 4, request_timeout / 4))
        self.nursery: trio.Nursery | None = None  # the connections' tasks (and flushers)
        # The read side of all connections: each socket registered once, edge-triggered,
        # read in place by _Conn.on_readable when ready (no reader task per connection,
        # no task switch to learn of input); also what tells a running handler at once
        # that its client left (EOF or reset cancels it).
        self.readers: InlineEpoll | None = None
        # A graceful stop (llmgw.daemon.net.http_drain): no more accepting, no more keep-alive.
        self.draining = False
        self.listening: list[tuple[_socket.socket, trio.SocketListener]] = []  # (accept socket, listener)

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
            limits = self.limits
            where = str(listener.socket.getsockname())
            accepted = 0
            self.listening.append((lsock, listener))
            while not self.draining:  # a drain accepts what is queued, then closes the listener
                try:
                    sock, addr = lsock.accept()
                except BlockingIOError:
                    accepted = 0
                    try:
                        await _wait_readable(lsock)
                    except trio.ClosedResourceError:
                        if self.draining:
                            return
                        raise
                    continue
                except OSError as exc:  # EMFILE...: close the longest waiting, pause, log (limited)
                    if self.draining:
                        return
                    await trio.sleep(limits.accept_failed(exc, where))
                    continue
                if limits.failing:
                    limits.accepted()
                if limits.admit(sock):
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
            self.limits.closed(None)
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
                if c.timed_out and not c.eof:
                    if c.reading:
                        self.rejected(408)
                        await self.reject(c, 408, "Timed out reading the request")
                    else:
                        stats.connections_idle_closed += 1
        except Exception:  # Cancelled (shutdown) passes; nothing else may kill the server
            logger.exception("HTTP connection from %s failed", client)
        finally:
            readers.forget(c.fd, c.on_readable)
            self.conns.discard(c)
            self.limits.closed(c)
            stats.connections_open -= 1
            trio.lowlevel.notify_closing(sock)  # a flusher task still writing stops
            if c.reset:
                with suppress(OSError):
                    sock.setsockopt(_socket.SOL_SOCKET, _socket.SO_LINGER, _RST)
            sock.close()

    async def request_loop(self, c: _Conn) -> None:
        stats = self.stats
        first = True
        while (req := await self.read_request(c, first)) is not None:
            first = c.fresh = False
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
            if served != _KEEP or self.draining:
                return  # error, or HTTP/1.0 / "connection: close" / a close-delimited body; or a drain

    async def read_request(self, c: _Conn, first: bool) -> Request | None:
        p = c.parser
        # Idle keep-alive wait until the first byte (shorter on a new connection), then one
        # deadline for the whole head + body: per-read timeouts would let a slowloris trickle
        # forever.  Meanwhile the connection is among those waiting, which the connection cap
        # closes first, oldest first (http_limits).
        c.reading = bool(p.buffered)  # pipelined bytes already buffered
        if c.reading:
            await trio.lowlevel.checkpoint()  # no wait for input this cycle: yield here
        c.deadline = trio.current_time() + (self.request_timeout if c.reading else
                                            self.first_timeout if first else self.keepalive_timeout)
        waiting = self.waiting
        waiting[c] = None
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
            waiting.pop(c, None)
            self.rejected(exc.status)
            await self.reject(c, exc.status, self.too_large if exc.status == 413 else f"Malformed HTTP request: {exc}")
            return None
        finally:
            waiting.pop(c, None)
        c.reading = False
        target = r.target
        path, _, query = target.partition("?")
        req = Request(r.method, target, path, query, r.headers, r.body, c.client, r.http_version)
        c.keep_alive = r.keep_alive and not self.draining  # draining: "connection: close" on the response
        return req

    def rejected(self, status: int) -> None:
        """A request is answered by the server itself (malformed, too large, too slow): tell the
        owner, who counts it with the requests its handler answers."""
        if self.on_rejected is not None:
            try:
                self.on_rejected(status)
            except Exception:  # a counting bug must not cost the client its answer
                logger.exception("on_rejected(%d) failed", status)

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
                await close_body(resp.body)
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
                    await stream_body(c, body, framing == BODY_CHUNKED, left)  # type: ignore[arg-type]
            finally:
                await close_body(body, c)  # type: ignore[arg-type]
            data, c.pending = c.pending, b""
            await c.write(data + b"0\r\n\r\n" if framing == BODY_CHUNKED and req.method != "HEAD" else data)
            return done
        except _GONE:
            c.eof = True  # the peer reset while we wrote: it left
            return 0
        except BodyAborted:
            # The body's source failed half-way (it booked that itself): the client must not
            # take the bytes it got for the whole body.  Chunked: no last chunk before the
            # close; close-delimited (HTTP/1.0): a reset, not a FIN, ends it.
            self.stats.responses_aborted += 1
            if c.pending:
                c.send_now()
            c.reset = framing == BODY_CLOSE
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
            await close_body(body)
        else:
            sink = _Sink(c, framing == BODY_CHUNKED, length if framing == BODY_LENGTH else 0
                         if framing == BODY_NONE else -1)
            try:
                await relay(sink)  # it cleans up after itself, whatever happens
            except BodyAborted:
                with trio.move_on_after(_LINGER):
                    await sink.drain()  # what it did send (e.g. an in-band error) goes first
                raise
            await sink.drain()
            if sink.left > 0:
                raise LocalProtocolError("the body is shorter than its content-length")
            if sink.ended:
                return done  # the end went with the last bytes
        data, c.pending = c.pending, b""
        await c.write(data + _LAST_CHUNK if framing == BODY_CHUNKED and req.method != "HEAD" else data)
        return done

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

async def serve_listeners(handler: Handler, listeners: list[trio.SocketListener], *,
                          task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
                          drain: Drain | None = None, **options: Unpack[ServerOptions]) -> NoReturn:
    """Serve HTTP on listening sockets until cancelled; ``started(listeners)``.

    Cancelling closes the listeners and every connection, cancelling in-flight
    handlers and closing streaming bodies; nothing outlives the call.  With ``drain``
    (llmgw.daemon.net.http_drain), ``drain.start()`` first stops it gracefully: no new
    connection, in-flight requests finish, each connection closes after its response.
    """
    server = _Server(handler, **options)
    if drain is not None:
        drain.attach(server)
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
                    backlog: int | None = None, reuse_port: bool = False,
                    before_listen: Callable[[], Awaitable[None]] | None = None, drain: Drain | None = None,
                    **options: Unpack[ServerOptions]) -> NoReturn:
    """Serve HTTP on host:port; ``started(bound_port)`` (useful with port 0).

    Give a literal address: with port 0, a name that resolves to several addresses
    gets a different ephemeral port on each, and only the first is reported.
    ``reuse_port``: bind with SO_REUSEPORT, so that several processes of this user
    (``llmgw daemon --workers N``) listen on one port and the kernel spreads the new
    connections among them. ``before_listen`` (with reuse_port): the port is bound and
    reported, then awaited before the sockets listen, so the others keep all the new
    connections until this process is ready for them.
    """
    if not reuse_port:
        listeners = await trio.open_tcp_listeners(port, host=host, backlog=backlog)
        task_status.started(listeners[0].socket.getsockname()[1])
    else:
        socks = await bind_reuse_port(port, host=host)
        task_status.started(socks[0].getsockname()[1])
        try:
            if before_listen is not None:
                await before_listen()
            listeners = listen_on(socks, backlog)
        except BaseException:
            for sock in socks:
                sock.close()
            raise
    await serve_listeners(handler, listeners, drain=drain, **options)


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
