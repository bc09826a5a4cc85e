"""Drives a pure simulator core in real time: schedule a step, wait its duration, complete it,
and hand each request its tokens through a channel.

The core never sees a clock; this loop is the only place where simulated time meets trio's.
With a zero time model the loop still yields between steps, so requests that arrive together
are batched together, as in a real engine."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import trio

__all__ = ["EngineRunner", "Core"]


class Core(Protocol):
    def add_request(self, req: Any, now: float) -> None: ...
    def abort(self, req_id: str, now: float) -> bool: ...
    def has_work(self) -> bool: ...
    def schedule(self, now: float) -> Any: ...
    def complete(self, plan: Any, now: float) -> list[Any]: ...


class EngineRunner:
    def __init__(self, core: Core, *, on_step: Callable[[float], None] | None = None,
                 on_schedule: Callable[[float], None] | None = None) -> None:
        self.core = core
        self.on_step = on_step  # after a step completes (vLLM >= 0.12 publishes KV events here)
        self.on_schedule = on_schedule  # right after scheduling (vLLM <= 0.11 publishes here)
        self._wake = trio.Event()
        self._chans: dict[str, trio.MemorySendChannel[Any]] = {}
        self.steps = 0

    def submit(self, req: Any, send: trio.MemorySendChannel[Any]) -> None:
        """Queue a request; its outputs go to `send` (unbounded, so the engine never blocks on a
        slow client: a step's output per request is one token). Several requests may share one."""
        self.core.add_request(req, trio.current_time())
        self._chans[req.req_id] = send
        self._wake.set()

    def abort(self, req_id: str) -> None:
        """Free a request's sequence at once (its client left)."""
        self._chans.pop(req_id, None)
        if self.core.abort(req_id, trio.current_time()):
            self._wake.set()  # freed blocks may let a waiting request in

    def wake(self) -> None:
        """Something outside a step changed what fits (blocks a decoder read or a timeout freed)."""
        self._wake.set()

    async def run(self) -> None:
        core = self.core
        while True:
            if not core.has_work():
                await self._wait()
                continue
            plan = core.schedule(trio.current_time())
            if self.on_schedule:
                self.on_schedule(trio.current_time())
            if plan is None:
                # Work exists but nothing fits (all blocks held, max_loras): wait for a change.
                await self._wait()
                continue
            if plan.duration > 0:
                await trio.sleep(plan.duration)
            else:
                await trio.lowlevel.checkpoint()
            now = trio.current_time()
            for out in core.complete(plan, now):
                chan = self._chans.get(out.req.req_id)
                if chan is None:
                    continue
                try:
                    chan.send_nowait(out)
                except (trio.ClosedResourceError, trio.BrokenResourceError):
                    pass  # the consumer is gone; its abort follows
                if out.finished:
                    del self._chans[out.req.req_id]
            self.steps += 1
            if self.on_step:
                self.on_step(now)

    async def _wait(self) -> None:
        await self._wake.wait()
        self._wake = trio.Event()
