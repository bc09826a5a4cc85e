"""The HTTP server's bounds on connections: a cap on open connections, what happens at the cap,
and what happens when accept() itself fails.

Every connection costs a file descriptor, and an fd limit reached makes accept() fail for
everyone (and the upstream connections the router needs, too). So the server keeps at most
``cap`` connections (``ServerOptions.max_connections``; the router derives it from the fd limit,
:mod:`llmgw.daemon.net.fd_limit`). A connection accepted at the cap makes room by closing the
connection that has waited longest for a request — idle keep-alive, never sent a byte, or a
request still trickling in: what idle-connection floods and slowloris hold — and is served. A
connection whose request is being handled is never closed for another; when every connection
is, the new one is refused at once: a canned 503 (``retry-after: 1``), sent without waiting,
then closed. Both are counted (``connections_evicted``, ``connections_refused``).

When accept() fails for lack of descriptors or memory (EMFILE, ENFILE, ENOMEM, ENOBUFS: the
limit was reached by something else, or the cap was set above it), the 32 longest-waiting
connections are closed, and accepting resumes once they are; with none waiting, accepting
pauses, from 50 ms doubling to 1 s while it keeps failing, instead of spinning. The failure is
logged when it starts and then at most once per 10 s (``accept_errors`` counts every one).
"""

from __future__ import annotations

import errno
import logging
import socket as _socket
from typing import Any, Protocol

import trio

from llmgw.daemon.net.log_limit import LogLimiter, repeats

__all__ = ["ConnectionLimits", "refusal"]

logger = logging.getLogger("llmgw.daemon.net.httpserver")

_CAPACITY = frozenset(getattr(errno, e) for e in ("EMFILE", "ENFILE", "ENOMEM", "ENOBUFS") if hasattr(errno, e))
# The listening socket itself is unusable: nothing to wait for.
_FATAL = frozenset(getattr(errno, e) for e in ("EBADF", "EINVAL", "ENOTSOCK", "EOPNOTSUPP") if hasattr(errno, e))
_NOSIGNAL = getattr(_socket, "MSG_NOSIGNAL", 0) | getattr(_socket, "MSG_DONTWAIT", 0)
_BACKOFF_MIN, _BACKOFF_MAX = 0.05, 1.0
_LOG_EVERY = 10.0  # s between two log lines about failing accepts
_EVICT_BATCH = 32  # connections closed when accept() finds no descriptor
_CLOSING = 0.01  # s for those to close before the next accept()


class _Waiter(Protocol):
    """A connection as the limits see it (httpserver's _Conn)."""
    evicted: bool

    def evict(self) -> None: ...


class ConnectionLimits:
    """Open connections against the cap; the connections waiting for a request, oldest first."""

    __slots__ = ("_faults", "backoff", "cap", "evicting", "failing", "open", "refusal", "stats", "waiting")

    def __init__(self, cap: int, stats: Any, refusal: bytes) -> None:
        self.cap = cap  # 0: no cap
        self.stats = stats  # a ServerStats
        self.refusal = refusal  # the canned 503, head and body
        self.open = 0  # accepted and not yet closed
        self.evicting = 0  # of those, told to close (their tasks have yet to run)
        # Connections waiting for a request's first byte or for the rest of it, in the order
        # they began waiting (the request loop adds and removes them: a dict as an ordered set).
        self.waiting: dict[_Waiter, None] = {}
        self.backoff = _BACKOFF_MIN
        self.failing = False  # accept() failed last time
        self._faults = LogLimiter(_LOG_EVERY)

    def admit(self, sock: _socket.socket) -> bool:
        """A connection was accepted: True to serve it, False when it was refused (and closed)."""
        if self.cap and self.open - self.evicting >= self.cap and not self.evict_oldest():
            self.stats.connections_refused += 1
            try:
                sock.send(self.refusal, _NOSIGNAL)
            except OSError:
                pass
            sock.close()
            return False
        self.open += 1
        return True

    def evict_oldest(self) -> bool:
        """Close the connection that has waited longest for a request; False when none waits."""
        for c in self.waiting:
            del self.waiting[c]
            c.evicted = True
            self.evicting += 1
            self.stats.connections_evicted += 1
            c.evict()
            return True
        return False

    def closed(self, c: _Waiter | None) -> None:
        """An admitted connection is closed (called once for each; None: before it was set up)."""
        self.open -= 1
        if c is not None:
            if c.evicted:
                self.evicting -= 1
            self.waiting.pop(c, None)

    def accepted(self) -> None:
        """accept() works again after failing."""
        self.failing = False
        self.backoff = _BACKOFF_MIN
        if (n := self._faults.clear("accept", trio.current_time())) is not None:
            logger.warning("accepting connections again%s", repeats(n))

    def accept_failed(self, exc: OSError, listener: str) -> float:
        """accept() raised: the seconds to wait before the next try (raises what is fatal)."""
        if exc.errno in _FATAL:
            raise exc
        self.failing = True
        self.stats.accept_errors += 1
        if exc.errno not in _CAPACITY:
            # One connection's trouble (ECONNABORTED, EPROTO, EPERM from a firewall): the next
            # may be fine. Still a pause, short, should it persist.
            delay = 0.01
        else:
            # Descriptors back for the connections queued in the backlog (a client waiting
            # behind a flood of idle ones among them): close a batch of the longest waiting,
            # and retry once their tasks have closed them; with none to close, back off.
            evicted = 0
            while evicted < _EVICT_BATCH and self.evict_oldest():
                evicted += 1
            if evicted:
                delay = _CLOSING
            else:
                delay = self.backoff
                self.backoff = min(_BACKOFF_MAX, self.backoff * 2)
        if (n := self._faults.hit("accept", trio.current_time())) is not None:
            logger.error("accept on %s failed (%s): connections wait in the backlog; open %d, cap %s%s",
                         listener, exc, self.open, self.cap or "none", repeats(n))
        return delay


def refusal(body: bytes) -> bytes:
    """The canned answer to a connection over the cap."""
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
            b"connection: close\r\n"
            b"content-length: %d\r\n\r\n%b" % (len(body), body))

