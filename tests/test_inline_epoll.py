"""InlineEpoll: handlers run from trio's I/O step (or from a task, the fallback), with the
same behaviour either way; trio's I/O manager is left as it was found."""

from __future__ import annotations

import logging
import socket

import pytest
import trio
import trio.testing
from trio._core._run import GLOBAL_RUN_CONTEXT

from llmgw.daemon.net import inline_epoll
from llmgw.daemon.net.inline_epoll import HANGUP, InlineEpoll, inline_available

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "trio"


@pytest.fixture(params=["inline", "task"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "task":
        monkeypatch.setenv("LLMGW_INLINE_IO", "0")
    return request.param


def _pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    return a, b


def _io_class() -> str:
    return type(GLOBAL_RUN_CONTEXT.runner.io_manager).__name__


async def test_installed_trio_is_verified() -> None:
    # Outside VERIFIED_TRIO the fast path is off (correct, ~13% more router CPU): a skip to
    # see in the summary.  To verify a new trio: read its EpollIOManager (get_events,
    # process_events, _epoll, _registered), run this file, then widen VERIFIED_TRIO.
    lo, hi = inline_epoll.VERIFIED_TRIO
    if not lo <= inline_epoll._trio_version() <= hi:
        pytest.skip(f"trio {trio.__version__} is not in VERIFIED_TRIO {lo}..{hi}: inline I/O dispatch is off")
    assert inline_available()


async def test_handler_runs_on_input_and_sees_waiting_data(mode: str) -> None:
    a, b = _pair()
    got: list[bytes] = []
    in_task: list[bool] = []
    done = trio.Event()
    b.send(b"before")  # waiting before registration: reported too

    def on_ready(mask: int) -> None:
        try:
            trio.lowlevel.current_task()
            in_task.append(True)
        except RuntimeError:
            in_task.append(False)
        while True:
            try:
                data = a.recv(100)
            except BlockingIOError:
                break
            got.append(data)
        if b"".join(got) == b"beforeafter":
            done.set()

    poller = InlineEpoll("test")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(poller.run)
        await trio.testing.wait_all_tasks_blocked()
        assert poller.inline is (mode == "inline")
        assert _io_class() == ("_InlineEpollIOManager" if mode == "inline" else "EpollIOManager")
        poller.register(a.fileno(), on_ready)
        await trio.testing.wait_all_tasks_blocked()
        b.send(b"after")
        await done.wait()
        nursery.cancel_scope.cancel()
    assert in_task and all(t is (mode == "task") for t in in_task)
    assert poller.ep.closed
    assert _io_class() == "EpollIOManager"  # put back once no InlineEpoll runs
    a.close()
    b.close()


async def test_failing_handler_is_dropped_and_others_go_on(mode: str, caplog: pytest.LogCaptureFixture) -> None:
    a1, b1 = _pair()
    a2, b2 = _pair()
    calls: list[int] = []
    ok = trio.Event()

    def bad(mask: int) -> None:
        calls.append(1)
        raise RuntimeError("boom")

    def good(mask: int) -> None:
        a2.recv(100)
        ok.set()

    poller = InlineEpoll("test")
    with caplog.at_level(logging.ERROR, logger="llmgw.inline_epoll"):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(poller.run)
            poller.register(a1.fileno(), bad)
            poller.register(a2.fileno(), good)
            b1.send(b"x")
            await trio.testing.wait_all_tasks_blocked()
            b1.send(b"y")  # a new edge: the dropped handler is not called again
            b2.send(b"z")
            await ok.wait()
            nursery.cancel_scope.cancel()
    assert calls == [1]
    assert "the handler of fd" in caplog.text and "boom" in caplog.text
    for s in (a1, b1, a2, b2):
        s.close()


async def test_later_calls_again_with_hangup_and_unregister_stops(mode: str) -> None:
    a, b = _pair()
    masks: list[int] = []
    second = trio.Event()
    poller = InlineEpoll("test")

    def handler(mask: int) -> None:
        masks.append(mask)
        if len(masks) == 1:
            poller.later(a.fileno())  # "stopped with data waiting": come back after the others
        else:
            second.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(poller.run)
        await trio.testing.wait_all_tasks_blocked()
        poller.register(a.fileno(), handler)
        b.send(b"x")
        await second.wait()
        assert masks[1] == HANGUP
        poller.unregister(a.fileno())
        poller.unregister(a.fileno())  # twice is fine
        b.send(b"y")
        await trio.testing.wait_all_tasks_blocked()
        assert len(masks) == 2
        poller.register(a.fileno(), handler)  # and again after unregister
        await second.wait()
        await trio.testing.wait_all_tasks_blocked()
        assert len(masks) == 3  # the waiting "xy" reported on registration
        nursery.cancel_scope.cancel()
    a.close()
    b.close()


async def test_forget_checks_the_handler(mode: str) -> None:
    poller = InlineEpoll("test")
    a, b = _pair()

    def h1(mask: int) -> None: ...

    def h2(mask: int) -> None: ...

    poller.register(a.fileno(), h1)
    poller.forget(a.fileno(), h2)  # not its handler: kept
    assert poller.handlers[a.fileno()] is h1
    poller.forget(a.fileno(), h1)
    assert a.fileno() not in poller.handlers
    poller.ep.close()
    a.close()
    b.close()


async def test_two_pollers_share_the_hook() -> None:
    pairs = [_pair(), _pair()]
    seen: list[int] = []
    events = [trio.Event(), trio.Event()]
    pollers = [InlineEpoll("one"), InlineEpoll("two")]
    scopes = [trio.CancelScope(), trio.CancelScope()]

    async def run(i: int) -> None:
        with scopes[i]:
            await pollers[i].run()

    def make(i: int):
        def handler(mask: int) -> None:
            pairs[i][0].recv(100)
            seen.append(i)
            events[i].set()
        return handler

    async with trio.open_nursery() as nursery:
        for i in range(2):
            nursery.start_soon(run, i)
        await trio.testing.wait_all_tasks_blocked()
        for i in range(2):
            pollers[i].register(pairs[i][0].fileno(), make(i))
            pairs[i][1].send(b"x")
        for ev in events:
            await ev.wait()
        scopes[0].cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert _io_class() == "_InlineEpollIOManager"  # the second one still runs
        events[1] = trio.Event()
        pairs[1][1].send(b"y")
        await events[1].wait()
        scopes[1].cancel()
    assert _io_class() == "EpollIOManager"
    assert sorted(seen) == [0, 1, 1]
    for a, b in pairs:
        a.close()
        b.close()


def test_unverified_trio_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inline_epoll.trio, "__version__", "9.1.0")

    async def main() -> None:
        assert not inline_available()

    trio.run(main)
