"""The agent ↔ router control stream over trio: :mod:`llmgw.fleet.wire` frames on a byte stream.

Either side wraps its connection (plain TCP or ``trio.SSLStream``) in a :class:`MessageStream`;
the agent dials with :func:`open_client`.  One task receives; any number may send.
"""

from __future__ import annotations

import socket
import ssl
from collections import deque
from collections.abc import Collection

import trio

from llmgw.fleet.wire import MAX_FRAME, FrameDecoder, Gate, Message, Skipped, WireProtocolError, encode

__all__ = ["MessageStream", "StreamClosed", "WireProtocolError", "open_client"]

_READ_SIZE = 65536


class StreamClosed(Exception):
    """The connection ended: the peer closed it (EOF) or it broke (reset, TLS failure), or an
    interrupted send left a partial frame on it."""


class MessageStream(trio.abc.AsyncResource):
    """Messages over a ``trio.abc.Stream``, numbered from 1 in each direction.

    ``receive`` raises :class:`StreamClosed` when the connection ends and
    :class:`WireProtocolError` for bad input (then close: the decoder stays failed).  It is
    for one task at a time; ``send`` is safe from many.  `max_frame` and `accept` are the
    decoder's (see :class:`llmgw.fleet.wire.FrameDecoder`).
    """

    def __init__(self, stream: trio.abc.Stream, *, max_frame: int = MAX_FRAME,
                 accept: Collection[str] | None = None) -> None:
        self.stream = stream
        self._decoder = FrameDecoder(max_frame=max_frame, accept=accept)
        self._inbox: deque[Message | Skipped] = deque()
        self._send_lock = trio.Lock()
        self._sent_seq = 0
        self._send_broken = False

    @property
    def max_frame(self) -> int:
        """The largest frame `receive` accepts (the decoder's cap)."""
        return self._decoder.max_frame

    @max_frame.setter
    def max_frame(self, value: int) -> None:
        self._decoder.max_frame = value

    @property
    def gate(self) -> Gate | None:
        """What turns frames away before they are decoded (see FrameDecoder; a Skipped is received)."""
        return self._decoder.gate

    @gate.setter
    def gate(self, value: Gate | None) -> None:
        self._decoder.gate = value

    @property
    def sent_seq(self) -> int:
        """Seq of the last message sent (0 before the first)."""
        return self._sent_seq

    @property
    def received_seq(self) -> int:
        """Seq of the last message received (0 before the first)."""
        return self._decoder.last_seq

    async def send(self, msg: Message) -> None:
        # The lock keeps concurrent senders' frames whole and their seqs in wire order.
        async with self._send_lock:
            if self._send_broken:
                raise StreamClosed("an earlier send was interrupted mid-frame")
            frame = encode(msg, self._sent_seq + 1)  # ValueError (too large) costs no seq
            self._sent_seq += 1
            try:
                await self.stream.send_all(frame)
            except trio.BrokenResourceError as e:
                self._send_broken = True
                raise StreamClosed(f"connection broken: {e}") from e
            except BaseException:
                # Cancelled (or failed) part way: the peer may have half a frame, so any
                # later frame would be misread.
                self._send_broken = True
                raise

    async def receive(self) -> Message | Skipped:
        while not self._inbox:
            try:
                data = await self.stream.receive_some(_READ_SIZE)
            except trio.BrokenResourceError as e:
                raise StreamClosed(f"connection broken: {e}") from e
            if not data:
                partial = self._decoder.buffered
                raise StreamClosed(f"peer closed the connection{f' {partial} bytes into a frame' if partial else ''}")
            self._inbox.extend(self._decoder.feed(data))
        return self._inbox.popleft()

    async def aclose(self) -> None:
        await self.stream.aclose()


async def open_client(host: str, port: int, *, ssl_context: ssl.SSLContext | None = None,
                      server_hostname: str | None = None, max_frame: int = MAX_FRAME,
                      accept: Collection[str] | None = None) -> MessageStream:
    """Dial the router; with `ssl_context`, TLS verified against `server_hostname` (default:
    `host`), handshake done here so a bad certificate fails the connect, not the first message."""
    tcp = await trio.open_tcp_stream(host, port)
    stream: trio.abc.Stream = tcp
    try:
        # trio sets it already; said again because Nagle + delayed ACK would stall each small frame ~40 ms.
        tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)
        if ssl_context is not None:
            tls = trio.SSLStream(tcp, ssl_context, server_hostname=server_hostname or host)
            await tls.do_handshake()
            stream = tls
    except BaseException:
        await trio.aclose_forcefully(tcp)
        raise
    return MessageStream(stream, max_frame=max_frame, accept=accept)
