"""An agent with several routers (docs/architecture.md, "Several routers"), over real loopback sockets:
the agent runs in this process, the routers are fakes speaking the wire protocol (llmgw.fleet.wire
through llmgw.daemon.net.message_stream), and the engines it launches are real `llmgw sim` processes.

- it dials every router its configured router lists (one with TLS, pinned with the CA the list gives);
- engine updates, heartbeats and KV events reach every router;
- a desired set is applied only from the highest epoch any router spoke of; an older one is ignored
  and counted;
- a router no live router lists is dropped after drop_after_s (the configured one never is)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from llmgw.config import AgentConfig, ControlConfig
from llmgw.daemon.agent.agent import Agent
from llmgw.daemon.net.message_stream import MessageStream, StreamClosed
from llmgw.fleet.types import EngineSpec, RouterAddr
from llmgw.fleet.wire import (
    FEATURE_KV_EVENTS,
    FROM_AGENT,
    Desired,
    EngineUpdate,
    Heartbeat,
    Hello,
    KvEvents,
    Message,
    Routers,
    Welcome,
)

pytestmark = pytest.mark.anyio

HB = 0.3


@dataclass
class Session:
    hello: Hello
    stream: MessageStream
    got: list[Message] = field(default_factory=list)
    closed: bool = False


class FakeRouter:
    """A router's control listener that welcomes every hello with `view` (epoch, leading, routers)
    and records what each session sends; `send` speaks on the newest session."""

    def __init__(self, rid: str, view: tuple[int, bool, tuple[RouterAddr, ...]] = (0, True, ()),
                 tls: Any = None) -> None:
        self.rid, self.view, self.tls = rid, view, tls
        self.sessions: list[Session] = []
        self.port = 0

    @property
    def addr(self) -> RouterAddr:
        return RouterAddr(self.rid, f"127.0.0.1:{self.port}", self.tls.ca_pem if self.tls else "",
                          self.tls.server_name if self.tls else "")

    async def serve(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listener.socket.getsockname()[1]
        await trio.serve_listeners(self._conn, [listener], task_status=task_status)

    async def _conn(self, raw: trio.SocketStream) -> None:
        stream: trio.abc.Stream = trio.SSLStream(raw, self.tls.context, server_side=True) if self.tls else raw
        ms = MessageStream(stream, accept=FROM_AGENT)
        s: Session | None = None
        try:
            hello = await ms.receive()
            assert isinstance(hello, Hello)
            s = Session(hello, ms)
            self.sessions.append(s)
            epoch, leading, routers = self.view
            await ms.send(Welcome(node=hello.node, router_id=self.rid, version=1, heartbeat_s=HB,
                                  credential="" if hello.credential else "cred-1", features=(FEATURE_KV_EVENTS,),
                                  epoch=epoch, leading=leading, routers=routers))
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._beat, ms, nursery.cancel_scope)
                nursery.start_soon(self._receive, s, nursery.cancel_scope)
        except (StreamClosed, trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            if s is not None:
                s.closed = True
            with trio.CancelScope(shield=True):
                await ms.aclose()

    async def _receive(self, s: Session, scope: trio.CancelScope) -> None:
        try:
            while True:
                s.got.append(await s.stream.receive())
        except (StreamClosed, trio.BrokenResourceError, trio.ClosedResourceError):
            scope.cancel()

    async def _beat(self, ms: MessageStream, scope: trio.CancelScope) -> None:
        try:
            while True:
                await ms.send(Heartbeat())
                await trio.sleep(HB)
        except (StreamClosed, trio.BrokenResourceError, trio.ClosedResourceError):
            scope.cancel()

    @property
    def live(self) -> Session | None:
        return self.sessions[-1] if self.sessions and not self.sessions[-1].closed else None

    async def send(self, msg: Message) -> None:
        assert self.live is not None
        await self.live.stream.send(msg)

    def updates(self, replica: str) -> list[str]:
        return [m.report.state for s in self.sessions for m in s.got
                if isinstance(m, EngineUpdate) and m.report.replica == replica]

    def url(self, replica: str) -> str | None:
        return next((m.report.url for s in self.sessions for m in s.got
                     if isinstance(m, EngineUpdate) and m.report.replica == replica and m.report.url), None)

    def kv_blocks(self, replica: str) -> int:
        return sum(len(m.added) for s in self.sessions for m in s.got
                   if isinstance(m, KvEvents) and m.replica == replica)

    def heartbeats(self) -> int:
        return sum(isinstance(m, Heartbeat) for s in self.sessions for m in s.got)


async def until(pred: Callable[[], bool], timeout: float = 30.0) -> None:
    """Wait for a condition of the routers or the agent (bounded; polling, not sleeping as sync)."""
    with trio.fail_after(timeout):
        while not pred():
            await trio.sleep(0.01)


def agent_config(tmp_path: Path, router: FakeRouter) -> AgentConfig:
    return AgentConfig(node="n1", router=f"127.0.0.1:{router.port}", join_token="t", state_dir=str(tmp_path / "state"),
                       gpus=(), memory_mb=1024, reconnect_min_s=0.05, reconnect_max_s=0.2, stop_grace_s=5.0)


def sim_spec(replica: str, kv_events: bool = False) -> EngineSpec:
    return EngineSpec(replica=replica, model="m", engine="vllm", model_path="m", simulate=True, health_timeout_s=30.0,
                      kv_events=kv_events)


@pytest.fixture
def control_tls(tmp_path: Path) -> Any:
    if shutil.which("openssl") is None:
        pytest.skip("openssl not on PATH (the TLS router's certificate)")
    from llmgw.daemon.control.agents.tls import setup_control_tls

    return setup_control_tls(ControlConfig(tls=True, tls_dir=str(tmp_path / "tls"), store=":memory:"), "127.0.0.1")


async def test_an_agent_reaches_every_listed_router_and_follows_the_highest_epoch(tmp_path: Path,
                                                                                  control_tls: Any) -> None:
    a, b, c = FakeRouter("ra"), FakeRouter("rb"), FakeRouter("rc", tls=control_tls)
    async with trio.open_nursery() as nursery:
        for r in (a, b, c):
            await nursery.start(r.serve)
        every = (a.addr, b.addr, c.addr)
        a_alias = RouterAddr("ra", f"localhost:{a.port}")  # the configured router, under another address
        a.view, b.view, c.view = (3, True, every), (3, False, (a_alias, b.addr, c.addr)), (3, False, every)
        agent = Agent(agent_config(tmp_path, a), router=f"127.0.0.1:{a.port}", token="t", drop_after_s=0.5)
        await nursery.start(agent.run)

        # The configured router first (its welcome issues the credential), then the routers it lists —
        # c over TLS, trusting the CA the list gives and verifying its server name.
        await until(lambda: a.live is not None and b.live is not None and c.live is not None)
        assert a.sessions[0].hello.credential == ""
        assert b.live.hello.credential == c.live.hello.credential == "cred-1"  # type: ignore[union-attr]
        assert len(a.sessions) == len(b.sessions) == len(c.sessions) == 1  # one session each, none twice

        # The leader's desired set is applied; every router hears the engine's updates, the agent's
        # heartbeats and the engine's KV events.
        await a.send(Desired(rev=1, engines=(sim_spec("m/1", kv_events=True),), epoch=3))
        await until(lambda: all("ready" in r.updates("m/1") for r in (a, b, c)))
        url, prompts = a.url("m/1"), 0
        while not all(r.kv_blocks("m/1") for r in (a, b, c)):  # bounded by the test's timeout below
            prompts += 1  # a new prompt each time: the engine's first events may precede the agent's SUB
            body = {"model": "m", "max_tokens": 2, "prompt": f"{prompts} tell me about caches " * 40}
            r = await trio.to_thread.run_sync(lambda: httpx.post(f"{url}/v1/completions", json=body, timeout=10))
            assert r.status_code == 200, r.text
            assert prompts < 100, "no KV events reached every router"
        assert all(r.heartbeats() for r in (a, b, c))

        # b takes the lead (epoch 4): a's later desired set (epoch 3, it was paused) is ignored ...
        await b.send(Routers(epoch=4, leading=True, routers=every))
        await until(lambda: agent.epoch == 4)
        await a.send(Desired(rev=2, engines=(), epoch=3))
        await a.send(Desired(rev=3, engines=(), epoch=3))
        await until(lambda: agent.stale_desired == 2)
        assert agent.supervisor is not None and [r.state for r in agent.supervisor.reports()] == ["ready"]
        # ... and b's is applied: the engine stops, and every router hears it.
        await b.send(Desired(rev=1, engines=(), epoch=4))
        await until(lambda: all("stopped" in r.updates("m/1") for r in (a, b, c)))

        # Nobody lists b any more (nor a, the configured router): b is dropped after drop_after_s, a stays.
        for r in (a, b, c):
            await r.send(Routers(epoch=4, leading=r is b, routers=(c.addr,)))
        await until(lambda: b.live is None)
        assert set(agent.links) == {f"127.0.0.1:{a.port}", f"127.0.0.1:{c.port}"}
        assert a.live is not None and c.live is not None and len(a.sessions) == 1
        nursery.cancel_scope.cancel()


async def test_an_older_router_is_one_router_that_always_leads(tmp_path: Path) -> None:
    """Welcome and desired without the new fields (epoch 0, leading, no routers): applied as before."""
    a = FakeRouter("old")
    async with trio.open_nursery() as nursery:
        await nursery.start(a.serve)
        agent = Agent(agent_config(tmp_path, a), router=f"127.0.0.1:{a.port}", token="t", drop_after_s=0.5)
        await nursery.start(agent.run)
        await until(lambda: a.live is not None)
        await a.send(Desired(rev=1, engines=(sim_spec("m/1"),)))
        await until(lambda: "starting" in a.updates("m/1"))
        assert agent.epoch == 0 and agent.stale_desired == 0 and list(agent.links) == [f"127.0.0.1:{a.port}"]
        nursery.cancel_scope.cancel()



async def test_an_epoch_no_router_speaks_of_any_more_is_forgotten(tmp_path: Path) -> None:
    """A store whose leadership was reset (a migration) counts epochs from 1 again: the agent follows
    once no live router has spoken of its highest epoch for drop_after_s — and not before."""
    a = FakeRouter("ra", (5, True, ()))
    async with trio.open_nursery() as nursery:
        await nursery.start(a.serve)
        agent = Agent(agent_config(tmp_path, a), router=f"127.0.0.1:{a.port}", token="t", drop_after_s=2.0)
        await nursery.start(agent.run)
        await until(lambda: a.live is not None and agent.epoch == 5)
        await a.send(Routers(epoch=1, leading=True, routers=()))
        await a.send(Desired(rev=1, engines=(sim_spec("m/1"),), epoch=1))
        await until(lambda: agent.stale_desired == 1)
        assert agent.epoch == 5 and agent.supervisor is not None and agent.supervisor.reports() == []
        await until(lambda: agent.epoch == 1)
        await a.send(Desired(rev=2, engines=(sim_spec("m/1"),), epoch=1))
        await until(lambda: "starting" in a.updates("m/1"))
        nursery.cancel_scope.cancel()
