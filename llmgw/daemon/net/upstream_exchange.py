"""One request to an upstream, up to its response head: ``async with pool.stream(...)``.

:class:`_Exchange` is the async context manager ``UpstreamPool.stream`` returns.  Entering
it serializes the request (:func:`llmgw.http1.client.serialize_request`), takes a pooled
connection or opens one, sends the request (almost always one syscall), and reads until
the response head is parsed, under the first-byte and idle deadlines (the pool's sweeper
fires them).  A reused connection found dead before any response byte (``_Stale``) is
replaced by a fresh one and the request resent once.  It returns the
:class:`~llmgw.daemon.net.upstream_response.UpstreamResponse`; leaving the block before
the body ended closes the connection.  ``_parse_base`` splits a base URL (cached).
"""

from __future__ import annotations

import functools
import math
import socket as _socket
from collections.abc import Sequence
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

import trio

from llmgw.daemon.net.upstream_errors import (
    Phase,
    UpstreamClosed,
    UpstreamConnectError,
    UpstreamProtocolError,
    UpstreamTimeout,
    _Stale,
)
from llmgw.daemon.net.upstream_relay import _RECV, _Conn, _PoolSide
from llmgw.daemon.net.upstream_response import UpstreamResponse
from llmgw.http1.client import Data, ResponseParser, serialize_request
from llmgw.http1.errors import LocalProtocolError, RemoteProtocolError

__all__: list[str] = []  # internal to the upstream client: UpstreamPool.stream() returns an _Exchange

_NOSIGNAL = getattr(_socket, "MSG_NOSIGNAL", 0)
_INF = math.inf
_wait_readable = trio.lowlevel.wait_readable
_wait_writable = trio.lowlevel.wait_writable
_current_time = trio.current_time


@functools.lru_cache(maxsize=4096)
def _parse_base(base_url: str) -> tuple[tuple[str, int], str, str]:
    """base_url -> ((host, port), Host header, path prefix)."""
    parts = urlsplit(base_url)  # raises ValueError itself, e.g. for "http://[::1"
    if parts.scheme != "http":
        raise ValueError(f"unsupported upstream URL (plain http:// only): {base_url!r}")
    host = parts.hostname
    if not host:
        raise ValueError(f"no host in upstream URL {base_url!r}")
    port = parts.port or 80  # raises ValueError for a port out of range
    host_header = parts.netloc.rpartition("@")[2]
    return (host, port), host_header, parts.path.rstrip("/")


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

    def __init__(self, pool: _PoolSide, base_url: str, method: str, target: str,
                 headers: Sequence[tuple[str, str]], body: bytes | None, connect_timeout: float,
                 first_byte_timeout: float, idle_timeout: float) -> None:
        self.pool, self.base_url, self.method, self.target = pool, base_url, method, target
        self.headers, self.body = headers, body
        self.connect_timeout, self.first_byte_timeout, self.idle_timeout = (
            connect_timeout, first_byte_timeout, idle_timeout)
        self.resp: UpstreamResponse | None = None

    async def __aenter__(self) -> UpstreamResponse:
        pool, url = self.pool, self.base_url
        try:
            key, host, prefix = _parse_base(url)
        except ValueError as exc:  # an engine's URL is input like any other: a failed connect
            pool.stats.connect_errors += 1
            raise UpstreamConnectError(f"unusable upstream URL: {exc}", url=url) from None
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
        resp.connected_at = now = _current_time()
        fbt = self.first_byte_timeout
        deadline = now + fbt if fbt != _INF else _INF
        while True:
            try:
                await self._exchange(c, resp, data, reused, deadline)
            except _Stale:
                pool.stats.stale_retries += 1
                c = await pool._connect(key, self.connect_timeout, url)
                reused = False
                resp.connected_at = _current_time()
                continue
            resp.head_at = _current_time()
            resp.reused = reused
            self.resp = resp
            return resp

    async def _exchange(self, c: _Conn, resp: UpstreamResponse, data: bytes, reused: bool, deadline: float) -> None:
        pool = self.pool
        pool._active.add(c)
        if pool._wake_sweeper is not None:
            pool._wake_sweeper.set()
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
