"""The body-sink protocols: how a streamed response body is handed to whoever writes it.

A :class:`RelayBody` is a response body that writes itself into a :class:`BodySink`.
The HTTP server (``llmgw.daemon.net.httpserver``) provides the sink, the client's side of
a response with its framing; the upstream client (``llmgw.daemon.net.upstream``)
provides the relaying body, writing each upstream read into the sink without waking the
request's task.  Both sides import them from here, neither from the other.

A body that cannot be completed (its source failed half-way) raises :class:`BodyAborted`:
the server then ends the response unfinished, so that the client knows it is truncated.

Pure: typing Protocols and that exception only, no I/O.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["BodyAborted", "BodySink", "RelayBody"]


class BodyAborted(Exception):
    """Raised by a streaming body (a RelayBody's ``relay``, or an async iterator) that cannot be
    completed, after it has cleaned up and booked the failure itself: the server writes what
    the body did send, then closes the connection without the body's end (no last chunk; a
    close-delimited body is reset), never passing a truncated body off as complete.  Expected,
    so not logged as an error."""


class BodySink(Protocol):
    """What a :class:`RelayBody` writes into: the client's socket, framing included."""

    def send_nowait(self, data: bytes, end: bool = False) -> bool:
        """Frame and send ``data`` now.  False when the socket did not take all of it (the rest
        is kept, goes out first, and ``drain()`` waits for it).  A gone peer raises
        trio.BrokenResourceError.  ``end``: the body's last bytes (``data`` may be empty),
        sent with the end of the response; nothing may follow."""
        ...

    def flush_nowait(self) -> None:
        """Send the response head (if still held back) now, as far as the socket takes it."""
        ...

    async def drain(self) -> None:
        """Wait until everything kept has been written (backpressure)."""
        ...


class RelayBody(Protocol):
    """A streaming body that writes itself: ``await body.relay(sink)`` returns once the
    body has been written (drained) and cleans up after itself, also when it raises or is
    cancelled (the client left).  ``aclose()`` is called instead when relay() never runs
    (a HEAD request, a response that cannot be framed).  For a proxy: the upstream side
    can hand each read to the sink without waking the request's task."""

    async def relay(self, sink: BodySink) -> None: ...

    async def aclose(self) -> None: ...
