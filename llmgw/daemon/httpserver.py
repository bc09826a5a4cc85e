"""A lean HTTP/1.1 server on trio + h11.

Not hypercorn: on trio it costs ~0.7 ms CPU a request and never tells a streaming
app that its client left (shared/specs/python-stack.md).  Here one task per
connection serves requests in order (keep-alive, pipelining) and a reader task
owns the receive side; while a handler runs or its response is sent, EOF or a
reset from the peer cancels it at once, so the handler's ``finally:`` blocks run
and a streaming body is ``aclose()``d.  A half-close after the request counts as
leaving: LLM clients don't do that, and a stuck stream would hold an engine slot.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket as _socket
import stat
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import suppress
from dataclasses import dataclass, field
from math import inf
from typing import Any, NoReturn, TypedDict, Unpack
from urllib.parse import parse_qsl

import h11
import trio

__all__ = ["ErrorBody", "Handler", "Request", "Response", "ServerOptions", "ServerStats",
           "json_response", "openai_error_body", "serve_listeners", "serve_tcp", "serve_unix",
           "text_response"]

logger = logging.getLogger(__name__)

_RECV = 65536
_LINGER = 1.0  # s: drain a rejected request so our close doesn't RST away the 4xx
_CLEANUP = 5.0  # s: bound on a streaming body's aclose() (its finally may await)
_BYTES = (bytes, bytearray, memoryview)
_GONE = (trio.BrokenResourceError, trio.ClosedResourceError)
_NOSIGNAL = getattr(_socket, "MSG_NOSIGNAL", 0)


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
        name = name.lower()
        for k, v in self.headers:
            if k == name:
                return v
        return None

    def query_params(self) -> dict[str, str]:
        """Decoded query parameters; the last of repeated keys wins."""
        return dict(parse_qsl(self.query, keep_blank_values=True))

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass(slots=True)
class Response:
    status: int
    headers: list[tuple[str, str]] = field(default_factory=list)  # str names and values
    # bytes -> Content-Length; async iterator -> chunked (HTTP/1.1), one write per chunk.
    body: bytes | AsyncIterator[bytes] = b""


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


class _Conn:
    """State shared by a connection's request loop and its reader task."""
    __slots__ = ("stream", "out", "h11", "client", "scope", "deadline", "timed_out", "eof", "reading",
                 "handling", "paused", "discard", "main", "reader")

    def __init__(self, stream: trio.SocketStream, out: _socket.socket, conn: h11.Connection,
                 client: tuple[str, int] | None) -> None:
        self.stream, self.out, self.h11, self.client = stream, out, conn, client
        # Wraps the request loop; cancelled by the reader when the peer leaves and by
        # the server's sweeper when ``deadline`` passes.  One per connection, so a
        # request costs no scope enter/exit and no deadline re-arming.
        self.scope = trio.CancelScope()
        self.deadline = inf  # read timeout; inf while a request is handled
        self.timed_out = self.eof = self.reading = self.handling = False
        self.paused = False  # reader holds off: h11 has unconsumed pipelined bytes
        self.discard = False  # lingering close: throw input away
        self.main: trio.lowlevel.Task | None = None  # request loop parked for input
        self.reader: trio.lowlevel.Task | None = None  # reader parked while paused

    async def read_loop(self) -> None:
        # Always parked in receive_some (unless paused), so watching a running
        # handler costs no extra syscall; a watcher task spawned per request and
        # cancelled afterwards doubled the CPU cost of a small request.
        while True:
            while self.paused:
                self.reader = trio.lowlevel.current_task()
                await trio.lowlevel.wait_task_rescheduled(self._abort_reader)
            try:
                data = await self.stream.receive_some(_RECV)
            except _GONE:
                data = b""
            if not data:
                self.eof = True
                self.scope.cancel()  # the peer left: stop its handler/stream now
                self._wake_main()
                return
            if self.discard:
                continue
            self.h11.receive_data(data)
            if self.handling:
                # Pipelined bytes mid-request: keep them for the next cycle and stop
                # watching, rather than buffer without bound.
                self.paused = True
            self._wake_main()

    async def write(self, data: bytes) -> None:
        # Straight to the socket (trio's own fd) when it takes everything, as it
        # nearly always does: trio's send_all costs 2-3x the syscall, ~30% of a
        # streamed chunk.  Only a full socket waits in send_all: the backpressure.
        try:
            n = self.out.send(data, _NOSIGNAL)
        except BlockingIOError:
            n = 0
        except OSError as exc:
            raise trio.BrokenResourceError(exc) from exc
        if n < len(data):
            await self.stream.send_all(memoryview(data)[n:])

    def _wake_main(self) -> None:
        if self.main is not None:
            trio.lowlevel.reschedule(self.main)
            self.main = None

    def resume_reader(self) -> None:
        self.paused = False
        if self.reader is not None:
            trio.lowlevel.reschedule(self.reader)
            self.reader = None

    async def wait_input(self) -> bool:
        """Park until the reader brings data or EOF; False once the peer is gone."""
        if self.eof:
            return False
        self.resume_reader()
        self.main = trio.lowlevel.current_task()
        await trio.lowlevel.wait_task_rescheduled(self._abort_main)
        return True

    def _abort_main(self, _: object) -> trio.lowlevel.Abort:
        self.main = None  # cancelled while parked: the reader must not wake us
        return trio.lowlevel.Abort.SUCCEEDED

    def _abort_reader(self, _: object) -> trio.lowlevel.Abort:
        self.reader = None
        return trio.lowlevel.Abort.SUCCEEDED


class _Server:
    def __init__(self, handler: Handler, *, max_body_bytes: int = 16 << 20,
                 max_head_bytes: int = 64 << 10, keepalive_timeout: float = 60.0,
                 request_timeout: float = 30.0, error_body: ErrorBody = openai_error_body,
                 stats: ServerStats | None = None) -> None:
        self.handler, self.error_body = handler, error_body
        self.max_body, self.max_head = max_body_bytes, max_head_bytes
        self.keepalive_timeout, self.request_timeout = keepalive_timeout, request_timeout
        self.stats = stats if stats is not None else ServerStats()
        self.too_large = f"Request body exceeds the limit of {max_body_bytes} bytes"
        self.conns: set[_Conn] = set()
        self.tick = max(0.01, min(1.0, keepalive_timeout / 4, request_timeout / 4))

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

    async def connection(self, stream: trio.SocketStream) -> None:
        client = None
        try:
            if stream.socket.family != _socket.AF_UNIX:
                # trio sets it today; not left to a default: Nagle + delayed ACK
                # stall small writes on keep-alive connections by ~40 ms.
                stream.socket.setsockopt(_socket.IPPROTO_TCP, _socket.TCP_NODELAY, 1)
                client = tuple(stream.socket.getpeername()[:2])
            # A second Python socket on trio's fd for _Conn.write; no dup (which would
            # double the fds per connection), so it must be detached, never closed.
            out = _socket.socket(fileno=stream.socket.fileno())
        except OSError:
            return  # already gone
        c = _Conn(stream, out, h11.Connection(h11.SERVER, max_incomplete_event_size=self.max_head), client)
        stats = self.stats
        stats.connections_open += 1
        stats.connections_total += 1
        self.conns.add(c)
        try:
            out.setblocking(False)  # trio's fd is non-blocking already; be explicit
            async with trio.open_nursery() as nursery:
                nursery.start_soon(c.read_loop)
                with c.scope, suppress(*_GONE):  # _GONE: the peer vanished as we wrote
                    await self.request_loop(c)
                if c.timed_out and c.reading and not c.eof:
                    await self.reject(c, 408, "Timed out reading the request")
                nursery.cancel_scope.cancel()
        except Exception:  # Cancelled (shutdown) passes; nothing else may kill the server
            logger.exception("HTTP connection from %s failed", client)
        finally:
            out.detach()  # trio.serve_listeners closes the fd itself
            self.conns.discard(c)
            stats.connections_open -= 1

    async def request_loop(self, c: _Conn) -> None:
        conn, stats = c.h11, self.stats
        while (req := await self.read_request(c)) is not None:
            c.deadline = inf  # handling has no time limit; a disconnect ends it
            if c.paused and not conn.trailing_data[0]:
                c.resume_reader()  # pipelined input consumed: watch this request again
            stats.requests_active += 1
            c.handling, ok = True, False
            try:
                ok = await self.run(c, req)
            finally:
                c.handling = False
                stats.requests_active -= 1
                if ok:
                    stats.requests_served += 1
                elif c.eof:
                    stats.client_disconnects += 1
            if not ok or conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                return  # error, or HTTP/1.0 / "connection: close" (h11: MUST_CLOSE)
            conn.start_next_cycle()

    async def read_request(self, c: _Conn) -> Request | None:
        conn = c.h11
        # Idle keep-alive wait until the first byte, then one deadline for the whole
        # head + body: per-read timeouts would let a slowloris trickle forever.
        c.reading = bool(conn.trailing_data[0])  # pipelined bytes already buffered
        if c.reading:
            await trio.lowlevel.checkpoint()  # no wait for input this cycle: yield here
        c.deadline = trio.current_time() + (self.request_timeout if c.reading else self.keepalive_timeout)
        head: h11.Request | None = None
        headers: list[tuple[str, str]] = []
        chunks: list[bytes] = []
        size = 0
        try:
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    if conn.they_are_waiting_for_100_continue:
                        await c.write(conn.send(h11.InformationalResponse(status_code=100, headers=[])))
                        continue  # input may have arrived meanwhile
                    if not await c.wait_input():
                        return None  # EOF: idle close, or a truncated request
                    if not c.reading:
                        c.reading = True
                        c.deadline = trio.current_time() + self.request_timeout
                elif type(event) is h11.Request:
                    head = event
                    for name, value in event.headers:
                        if name == b"content-length" and int(value) > self.max_body:
                            await self.reject(c, 413, self.too_large)
                            return None
                        headers.append((name.decode("latin-1"), value.decode("latin-1")))
                elif type(event) is h11.Data:
                    size += len(event.data)
                    if size > self.max_body:
                        await self.reject(c, 413, self.too_large)
                        return None
                    chunks.append(event.data)
                elif type(event) is h11.EndOfMessage:
                    break
                else:
                    return None  # ConnectionClosed
        except h11.RemoteProtocolError as exc:
            await self.reject(c, exc.error_status_hint, f"Malformed HTTP request: {exc}")
            return None
        c.reading = False
        assert head is not None
        target = head.target.decode("latin-1")
        path, _, query = target.partition("?")
        return Request(head.method.decode("ascii"), target, path, query, headers, b"".join(chunks),
                       c.client, head.http_version.decode("ascii"))

    async def reject(self, c: _Conn, status: int, message: str) -> None:
        """Answer an unreadable request with an error, then close gracefully."""
        resp = self.error(status, message)
        resp.headers.append(("connection", "close"))
        try:
            out = c.h11.send(h11.Response(status_code=status, headers=resp.headers))
            out += c.h11.send(h11.Data(data=resp.body))  # type: ignore[arg-type]
            out += c.h11.send(h11.EndOfMessage())
        except h11.LocalProtocolError:
            return  # h11 can't frame a response in this state; just close
        # Closing with unread input makes the kernel send RST, which can destroy the
        # 4xx before the client reads it: half-close and drain until EOF, bounded.
        c.discard = True
        with trio.move_on_after(_LINGER), suppress(*_GONE):
            await c.write(out)
            await c.stream.send_eof()
            while await c.wait_input():
                pass

    async def run(self, c: _Conn, req: Request) -> bool:
        """Call the handler and send its response; True if the connection is reusable."""
        conn = c.h11
        try:
            resp = await self.handler(req)
        except Exception:
            logger.exception("handler failed: %s %s", req.method, req.target)
            self.stats.handler_errors += 1
            resp = self.error(500, "Internal server error")
        try:
            body, headers = resp.body, resp.headers
            if isinstance(body, _BYTES):
                if resp.status not in (204, 304) and not any(n.lower() == "content-length" for n, _ in headers):
                    headers = [*headers, ("content-length", str(len(body)))]
                out = conn.send(h11.Response(status_code=resp.status, headers=headers))
                if body and req.method != "HEAD":
                    out += conn.send(h11.Data(data=body))
                await c.write(out + conn.send(h11.EndOfMessage()))  # one write
                return True
            await c.write(conn.send(h11.Response(status_code=resp.status, headers=headers)))
            # h11 picks chunked framing for an HTTP/1.1 peer when the handler set no
            # framing header; we then frame chunks ourselves (h11's Data path costs
            # ~10 us a chunk, and its chunked writer keeps no count to upset).
            chunked = req.http_version == "1.1" and resp.status not in (204, 304) and not any(
                n.lower() in ("content-length", "transfer-encoding") for n, _ in headers)
            try:
                if req.method != "HEAD":
                    i = 0
                    async for chunk in body:
                        if chunk:  # an empty chunk would end a chunked body
                            # No buffering: each chunk goes to the socket now; a full
                            # socket blocks here, which is the generator's backpressure.
                            await c.write(b"%x\r\n%b\r\n" % (len(chunk), chunk) if chunked
                                          else conn.send(h11.Data(data=chunk)))
                        i += 1
                        if not i & 15:  # c.write rarely yields: don't let a generator
                            await trio.lowlevel.checkpoint()  # that never awaits hog the loop
            finally:
                if (aclose := getattr(body, "aclose", None)) is not None:
                    # Shielded so the generator's finally may await (e.g. cancel an
                    # upstream request) although we got here by cancellation; bounded.
                    with trio.CancelScope(shield=True, deadline=trio.current_time() + _CLEANUP):
                        await aclose()
            await c.write(conn.send(h11.EndOfMessage()))
            return True
        except _GONE:
            c.eof = True  # the peer reset while we wrote: it left
            return False
        except Exception:
            # Mid-stream the head is out already: closing without the last chunk is
            # how the client learns the body is truncated.
            logger.exception("sending the response failed: %s %s", req.method, req.target)
            self.stats.handler_errors += 1
            return False


async def serve_listeners(handler: Handler, listeners: list[trio.SocketListener], *,
                          task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
                          **options: Unpack[ServerOptions]) -> NoReturn:
    """Serve HTTP on listening sockets until cancelled; ``started(listeners)``.

    Cancelling closes the listeners and every connection, cancelling in-flight
    handlers and closing streaming bodies; nothing outlives the call.
    """
    server = _Server(handler, **options)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.sweep)
        await trio.serve_listeners(server.connection, listeners, task_status=task_status)
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
    removed on exit.  Requests get ``client=None`` (authorise by SO_PEERCRED).
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
