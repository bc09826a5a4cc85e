"""The router's side of the agents' streams with several routers (agents/sessions.py): the welcome
carries the epoch, whether this router leads and the live routers; `routers` messages follow their
changes (to agents that list the feature); `desired` goes out only while leading, with the epoch.

The sessions run in this process over real loopback sockets, with a stand-in for the control plane
(SessionHost) whose leadership the test sets — the plane's own leadership is docs/ha.md's."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from llmgw.config import ControlConfig
from llmgw.daemon.control.agents.sessions import AgentSessions
from llmgw.daemon.control.store.sqlite import Store
from llmgw.daemon.net.message_stream import MessageStream, open_client
from llmgw.fleet.types import EngineSpec, NodeFacts, RouterAddr
from llmgw.fleet.wire import (
    AGENT_FEATURES,
    FEATURE_ROUTERS,
    FROM_ROUTER,
    Desired,
    Heartbeat,
    Hello,
    Message,
    Routers,
    Welcome,
)

pytestmark = pytest.mark.anyio

SPEC = EngineSpec(replica="m/1", model="m", engine="vllm", model_path="m", simulate=True)
R1, R2 = RouterAddr("r1", "127.0.0.1:7070"), RouterAddr("r2", "127.0.0.1:7071")


class Host:
    """A control plane that leads when the test says so."""

    router_id = "r1"

    def __init__(self) -> None:
        self.store = Store.memory()
        self.is_leading, self.the_epoch, self.addrs = False, 4, [R1, R2]

    def leading(self) -> bool:
        return self.is_leading

    def epoch(self) -> int:
        return self.the_epoch

    def router_addrs(self) -> list[RouterAddr]:
        return list(self.addrs)

    def desired_for(self, node: str) -> list[EngineSpec]:
        return [SPEC]

    def agent_joined(self, hello: Hello, peer: str) -> Any:
        return hello.node

    def knows_node(self, node: str) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:  # what the sessions tell the plane: not this test's subject
        return lambda *a, **kw: None


async def hello(port: int, node: str, features: tuple[str, ...]) -> tuple[MessageStream, Welcome]:
    ms = await open_client("127.0.0.1", port, accept=FROM_ROUTER)
    await ms.send(Hello(token="t", node=node, agent_id=node, versions=(1,), labels={}, facts=NodeFacts(), engines=(),
                        features=features))
    with trio.fail_after(10):
        welcome = await ms.receive()
    assert isinstance(welcome, Welcome), welcome
    return ms, welcome


async def next_news(ms: MessageStream, beats: int = 0) -> list[Message]:
    """What the router says next besides heartbeats; with `beats`, until that many heartbeats."""
    out: list[Message] = []
    seen = 0
    with trio.fail_after(10):
        while True:
            m = await ms.receive()
            if not isinstance(m, Heartbeat):
                out.append(m)
                if not beats:
                    return out
            else:
                seen += 1
                if beats and seen >= beats:
                    return out


async def test_a_follower_sends_no_desired_and_a_new_leader_sends_it_with_its_epoch() -> None:
    host = Host()
    cfg = ControlConfig(join_token="t", heartbeat_s=0.05, store=":memory:")
    sessions = AgentSessions(host, cfg, "t")  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]
        await nursery.start(trio.serve_listeners, lambda s: sessions.serve_agent(s, None), listeners)
        new, welcome = await hello(port, "n1", AGENT_FEATURES)
        old, old_welcome = await hello(port, "n2", tuple(f for f in AGENT_FEATURES if f != FEATURE_ROUTERS))
        assert (welcome.epoch, welcome.leading, welcome.routers) == (4, False, (R1, R2)) == \
            (old_welcome.epoch, old_welcome.leading, old_welcome.routers)

        assert await next_news(new, beats=3) == []  # a follower: heartbeats, no desired set
        sessions.push("n1")
        assert await next_news(new, beats=3) == []

        host.is_leading, host.the_epoch = True, 5  # took the lead
        sessions.leadership_changed()
        assert await next_news(new) == [Routers(5, True, (R1, R2))]
        [d] = await next_news(new)
        assert isinstance(d, Desired) and d.engines == (SPEC,) and d.epoch == 5
        [d_old] = await next_news(old)  # an older agent: no routers message, the desired set as before
        assert isinstance(d_old, Desired) and d_old.epoch == 5

        host.addrs.append(RouterAddr("r3", "127.0.0.1:7072", server_name="llmgw-control"))
        sessions.routers_changed()
        assert await next_news(new) == [Routers(5, True, (R1, R2, host.addrs[2]))]
        assert await next_news(new, beats=3) == []  # the desired set unchanged: not sent again
        assert await next_news(old, beats=3) == []

        host.is_leading = False  # lost it
        sessions.leadership_changed()
        sessions.push("n1")
        assert await next_news(new) == [Routers(5, False, (R1, R2, host.addrs[2]))]
        assert await next_news(new, beats=3) == []
        for ms in (new, old):
            await ms.aclose()
        nursery.cancel_scope.cancel()
