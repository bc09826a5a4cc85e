"""Sockets whose readiness is handled inside trio's own I/O step, without a task switch.

The router's hot path is a few sockets made ready tens of thousands of times a second:
clients' requests and the engines' streamed chunks.  Waking a trio task for each costs
more than the work it does (a switch through a dozen coroutine frames, and an epoll_ctl
to re-arm trio's one-shot registration), and on a VM every wake-up from idle runs with
cold caches, so its price grows with each line of code it touches.  Measured with
``bench/bench_wakeup.py`` (one byte echoed per wake-up, 1 ms apart): a blocking recv and
send ~20 µs of CPU per wake-up, through a trio task ~65 µs, through trio's I/O step with
this module ~45 µs.

An :class:`InlineEpoll` is a private epoll of sockets registered edge-triggered, each
with a handler.  When the running trio is a version whose epoll I/O manager we have read
and test against (:data:`VERIFIED_TRIO`), the private epoll's fd joins trio's own epoll
and trio's event processing is extended so that an event on it runs :meth:`dispatch`
right there, in the step that learnt of it (:class:`_Hook`).  Otherwise (another trio
version or platform, or ``LLMGW_INLINE_IO=0``) a task waits for the private epoll through
``trio.lowlevel.wait_readable`` and dispatches: the same behaviour, a task switch more.

Handlers run outside any task.  They must not await; they may read and write sockets,
reschedule tasks, cancel scopes and close sockets.  One that raises is logged and
dropped, never allowed into trio's run loop.
"""

from __future__ import annotations

import logging
import os
import select
from collections.abc import Callable
from typing import Any, NoReturn

import trio

__all__ = ["EDGE", "HANGUP", "VERIFIED_TRIO", "Handler", "InlineEpoll", "inline_available"]

log = logging.getLogger("llmgw.inline_epoll")

Handler = Callable[[int], None]  # called with the epoll event mask

EDGE = select.EPOLLIN | select.EPOLLRDHUP | select.EPOLLET
HANGUP = select.EPOLLRDHUP | select.EPOLLHUP | select.EPOLLERR  # in a mask: read until EAGAIN or EOF

# trio releases whose EpollIOManager (get_events / process_events / _epoll / _registered)
# _Hook was checked against; tests/test_inline_epoll.py runs on the installed one.
VERIFIED_TRIO = ((0, 25), (0, 35))


class InlineEpoll:
    """Sockets registered edge-triggered with a handler each; :meth:`run` drives them."""

    __slots__ = ("_parked", "again", "ep", "fd", "handlers", "inline", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self.ep = select.epoll()
        self.fd = self.ep.fileno()
        self.handlers: dict[int, Handler] = {}
        self.again: list[int] = []  # fds whose handler stopped with data waiting (fairness)
        self.inline = False  # dispatching from trio's I/O step (set by run)
        self._parked: trio.lowlevel.Task | None = None  # run()'s task, waiting for `again`

    def register(self, fd: int, handler: Handler) -> None:
        """Watch ``fd``; input already waiting is reported too."""
        self.ep.register(fd, EDGE)
        self.handlers[fd] = handler

    def unregister(self, fd: int) -> None:
        """Stop watching ``fd`` and drop its registration (it may be registered again)."""
        self.handlers.pop(fd, None)
        try:
            self.ep.unregister(fd)
        except (OSError, ValueError):
            pass  # closed already: the kernel dropped it

    def forget(self, fd: int, handler: Handler | None = None) -> None:
        """Stop calling ``fd``'s handler (if it is ``handler``, when given), leaving the
        registration to the socket's close (the kernel drops it then; no dup() of these
        fds exists).  Saves an epoll_ctl."""
        if handler is None or self.handlers.get(fd) == handler:
            self.handlers.pop(fd, None)

    def later(self, fd: int) -> None:
        """Call ``fd``'s handler again after the others (it stopped with data waiting)."""
        self.again.append(fd)
        task = self._parked
        if task is not None:
            self._parked = None
            trio.lowlevel.reschedule(task)

    def dispatch(self) -> None:
        """Run the handlers of the sockets that are ready.  Never raises."""
        self._call(self.ep.poll(0))

    def _run_again(self) -> None:
        again, self.again = self.again, []
        self._call([(fd, HANGUP) for fd in again])

    def _call(self, events: list[tuple[int, int]]) -> None:
        handlers = self.handlers
        for fd, mask in events:
            handler = handlers.get(fd)
            if handler is not None:
                try:
                    handler(mask)
                except Exception:  # a bug in one handler must not stop the others, nor reach trio
                    log.exception("%s: the handler of fd %d failed; dropped", self.name, fd)
                    handlers.pop(fd, None)

    async def run(self) -> NoReturn:
        """Drive the handlers until cancelled; then close the epoll."""
        hook = _Hook.install(self)
        self.inline = hook is not None
        try:
            if hook is not None:
                while True:
                    if self.again:
                        await trio.lowlevel.checkpoint()  # let others run before more of the same
                        self._run_again()
                    else:
                        self._parked = trio.lowlevel.current_task()
                        await trio.lowlevel.wait_task_rescheduled(self._abort)
            else:
                while True:
                    if self.again:
                        await trio.lowlevel.checkpoint()
                    else:
                        await trio.lowlevel.wait_readable(self.fd)
                    self.dispatch()
                    self._run_again()
        finally:
            self._parked = None
            if hook is not None:
                hook.remove(self)
            else:
                trio.lowlevel.notify_closing(self.fd)
            self.inline = False
            self.ep.close()

    def _abort(self, _: Any) -> trio.lowlevel.Abort:
        self._parked = None
        return trio.lowlevel.Abort.SUCCEEDED


def _trio_version() -> tuple[int, int]:
    try:
        major, minor = trio.__version__.split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return (0, 0)


def inline_available() -> bool:
    """Whether :meth:`InlineEpoll.run` dispatches from trio's I/O step in this process
    (call inside ``trio.run``)."""
    return _io_manager() is not None


def _io_manager() -> Any | None:
    if os.environ.get("LLMGW_INLINE_IO", "1") == "0":
        return None
    lo, hi = VERIFIED_TRIO
    if not lo <= _trio_version() <= hi:
        return None
    try:
        from trio._core._run import GLOBAL_RUN_CONTEXT

        io = GLOBAL_RUN_CONTEXT.runner.io_manager
    except (ImportError, AttributeError):
        return None
    base = type(io)
    if base.__name__ != "EpollIOManager" or not all(
            hasattr(io, a) for a in ("_epoll", "_registered", "process_events", "get_events")):
        return None
    return io


_HOOK: trio.lowlevel.RunVar[_Hook] = trio.lowlevel.RunVar("llmgw.inline_epoll")


class _Hook:
    """This run's trio epoll I/O manager, extended (by swapping its class for a subclass
    while any InlineEpoll runs) to dispatch our epolls' events in its own event step."""

    def __init__(self, io: Any) -> None:
        self.io = io
        self.base = type(io)
        self.table: dict[int, Callable[[], None]] = {}  # our epoll fds -> their dispatch
        table, base_process = self.table, self.base.process_events

        def process_events(io_self: Any, events: Any) -> None:
            rest = None
            for ev in events:
                dispatch = table.get(ev[0])
                if dispatch is None:
                    if rest is None:
                        rest = []
                    rest.append(ev)
                else:
                    dispatch()
            if rest:
                base_process(io_self, rest)

        def get_events(io_self: Any, timeout: float) -> Any:
            # trio sizes the batch by its own registrations; ours come on top
            return io_self._epoll.poll(timeout, max(1, len(io_self._registered)) + len(table))

        self.cls = type("_InlineEpollIOManager", (self.base,),
                        {"__slots__": (), "process_events": process_events, "get_events": get_events})

    @classmethod
    def install(cls, poller: InlineEpoll) -> _Hook | None:
        try:
            hook = _HOOK.get()
        except LookupError:
            io = _io_manager()
            if io is None:
                return None
            hook = cls(io)
            _HOOK.set(hook)
        if not hook.table:
            hook.io.__class__ = hook.cls
        hook.io._epoll.register(poller.fd, select.EPOLLIN)  # level: what dispatch leaves comes back
        hook.table[poller.fd] = poller.dispatch
        return hook

    def remove(self, poller: InlineEpoll) -> None:
        if self.table.pop(poller.fd, None) is not None:
            try:
                self.io._epoll.unregister(poller.fd)
            except (OSError, ValueError):
                pass
        if not self.table:
            self.io.__class__ = self.base
