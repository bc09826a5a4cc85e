"""A small trio adapter for pyzmq (pyzmq ships asyncio and gevent integrations, not trio).

libzmq gives each socket one notification fd (``zmq.FD``). It is *edge-triggered*: it turns readable
when the socket's state may have changed, and any call into the socket (including reading
``zmq.EVENTS``) can consume that edge. The rules that follow from it:

* always try the operation with ``zmq.NOBLOCK`` first; a wake-up is only a hint;
* after every wake re-read ``zmq.EVENTS`` and wait again unless the wanted flag is set;
* call ``trio.lowlevel.notify_closing`` before closing, so a parked task gets ClosedResourceError.

Ownership: **one owner task per socket.** Send and receive share the same fd, and trio refuses two
tasks waiting on one fd at once (the second raises ``trio.BusyResourceError``). If several tasks need a
socket, give it to one task and feed that task through a memory channel.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import trio
import zmq

__all__ = ["AsyncSocket"]

_T = TypeVar("_T")


class AsyncSocket:
    """Async ``send_multipart``/``recv_multipart`` over a pyzmq socket, for trio. See module docstring."""

    def __init__(self, sock: zmq.Socket) -> None:
        self.socket = sock
        self._fd: int = sock.getsockopt(zmq.FD)

    async def send_multipart(self, frames: Sequence[Any], *, copy: bool = True) -> None:
        # Waits while POLLOUT is clear. PUB (and ROUTER without ROUTER_MANDATORY) never reports
        # EAGAIN: libzmq silently drops at the high-water mark, so those sends never wait.
        await self._io(zmq.POLLOUT, lambda: self.socket.send_multipart(frames, zmq.NOBLOCK, copy=copy))

    async def recv_multipart(self, *, copy: bool = True) -> list[Any]:
        return await self._io(zmq.POLLIN, lambda: self.socket.recv_multipart(zmq.NOBLOCK, copy=copy))

    async def _io(self, flag: int, op: Callable[[], _T]) -> _T:
        await trio.lowlevel.checkpoint_if_cancelled()
        sock = self.socket
        while True:
            if sock.closed:
                raise trio.ClosedResourceError("zmq socket is closed")
            try:
                result = op()
            except zmq.Again:
                # Edge-triggered: EVENTS is the truth; reading it also re-arms the fd.
                while not sock.getsockopt(zmq.EVENTS) & flag:
                    await trio.lowlevel.wait_readable(self._fd)
                continue
            # The message has been moved; never lose it to a cancellation after the fact.
            await trio.lowlevel.cancel_shielded_checkpoint()
            return result

    def close(self, linger: int | None = None) -> None:
        """Wake any waiter with ClosedResourceError, then close the socket. Idempotent."""
        if self.socket.closed:
            return
        try:
            trio.lowlevel.notify_closing(self._fd)
        except RuntimeError:  # not inside trio.run(): nobody can be waiting
            pass
        self.socket.close(linger=linger)

    def __enter__(self) -> AsyncSocket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
