"""The control plane's side of the agents' streams (docs/architecture.md has the protocol).

An agent dials in and must say hello within HELLO_TIMEOUT_S; the hello is checked (the join
token, in constant time; a common protocol version) and refused with a reason, or answered with
a welcome. The hello carries the agent's whole state: what it does not mention, it does not run.
A session then runs two loops until the stream ends, the agent says bye, falls silent, or a newer
connection of the same node replaces it: a receiver (heartbeats, engine updates, bye) and a
sender (the node's `desired` set whenever it changed, a heartbeat otherwise).

What the agents say goes to the control plane (plane.py) through SessionHost: a node joined, was
heard, reported an engine, left or disconnected; the plane answers each node's desired set."""

from __future__ import annotations

import hmac
import logging
import ssl
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import trio

from llmgw.config import ControlConfig
from llmgw.daemon.net.message_stream import MessageStream, StreamClosed
from llmgw.fleet.nodes import Node
from llmgw.fleet.types import EngineReport, EngineSpec
from llmgw.fleet.wire import (
    FROM_AGENT,
    PROTOCOL_VERSION,
    Bye,
    Desired,
    EngineUpdate,
    Heartbeat,
    Hello,
    WireProtocolError,
    Refused,
    Welcome,
)

log = logging.getLogger("llmgw.control")

__all__ = ["HELLO_TIMEOUT_S", "AgentSessions", "SessionHost"]

HELLO_TIMEOUT_S = 10.0


class SessionHost(Protocol):
    """The control plane, as the agents' sessions see it (ControlPlane implements it)."""

    router_id: str

    def agent_joined(self, hello: Hello, peer: str) -> Node:
        """A node's agent said hello (and was welcome): the node's record."""
        ...

    def agent_heard(self, node: str, agent_id: str) -> None: ...

    def engine_reported(self, node: str, report: EngineReport) -> None: ...

    def agent_left(self, node: str) -> None:
        """The agent said bye: it is stopping its engines."""
        ...

    def agent_disconnected(self, n: Node, agent_id: str, reason: str) -> None: ...

    def desired_for(self, node: str) -> list[EngineSpec]:
        """What `node` should run now."""
        ...


@dataclass
class _Conn:
    node: str
    agent_id: str
    stream: MessageStream
    peer: str
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    wake: trio.Event = field(default_factory=trio.Event)
    sent_rev: int = -1
    closing_reason: str = ""


class AgentSessions:
    """The connected agents, one session per node, and each node's `desired` revision."""

    def __init__(self, host: SessionHost, cfg: ControlConfig, token: str | None) -> None:
        self.host = host
        self.cfg = cfg
        self.token = token
        self.conns: dict[str, _Conn] = {}
        self._node_rev: dict[str, int] = {}  # per node, bumped when its desired set changes

    def push(self, node: str) -> None:
        """The node's desired set changed: its session sends it now."""
        self._node_rev[node] = self._node_rev.get(node, 0) + 1
        conn = self.conns.get(node)
        if conn is not None:
            conn.wake.set()

    async def serve_agent(self, raw: trio.SocketStream, ssl_context: ssl.SSLContext | None) -> None:
        """One accepted connection, from its hello to its end."""
        try:
            host, port = raw.socket.getpeername()[:2]
            peer = f"{host}:{port}"
        except OSError:
            peer = "?"
        stream: trio.abc.Stream = raw
        if ssl_context is not None:
            stream = trio.SSLStream(raw, ssl_context, server_side=True)
        ms = MessageStream(stream, max_frame=self.cfg.max_message_bytes, accept=FROM_AGENT)
        try:
            with trio.fail_after(HELLO_TIMEOUT_S):
                hello = await ms.receive()
            if not isinstance(hello, Hello):
                raise WireProtocolError(f"expected hello first, got {type(hello).TYPE}")
            why = self._refusal(hello)
            if why is not None:
                log.warning("refused agent %r from %s: %s", hello.node, peer, why)
                with trio.move_on_after(2):
                    await ms.send(Refused(why))
                return
            await self._session(hello, ms, peer)
        except trio.TooSlowError:
            log.warning("agent connection from %s closed: no hello within %ss", peer, HELLO_TIMEOUT_S)
        except WireProtocolError as e:
            log.warning("agent connection from %s closed: %s", peer, e)
        except (StreamClosed, trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            with trio.move_on_after(1) as cs:
                cs.shield = True
                await ms.aclose()

    def _refusal(self, hello: Hello) -> str | None:
        if self.token is None or not hmac.compare_digest(hello.token.encode(), self.token.encode()):
            return "wrong join token"  # never the token itself, neither here nor in the log
        if PROTOCOL_VERSION not in hello.versions:
            return f"no common protocol version (router speaks {PROTOCOL_VERSION}, agent {list(hello.versions)})"
        return None

    async def _session(self, hello: Hello, ms: MessageStream, peer: str) -> None:
        node = hello.node
        conn = _Conn(node, hello.agent_id, ms, peer)
        old = self.conns.get(node)
        if old is not None:
            log.warning("node %s: a new connection from %s replaces the one from %s", node, peer, old.peer)
            old.closing_reason = "replaced by a newer connection"
            old.scope.cancel()
        self.conns[node] = conn
        n = self.host.agent_joined(hello, peer)
        self._node_rev[node] = self._node_rev.get(node, 0) + 1
        hb = self.cfg.heartbeat_s
        await ms.send(Welcome(node=node, router_id=self.host.router_id, version=PROTOCOL_VERSION, heartbeat_s=hb))
        reason = "stream closed"

        async def receive() -> None:
            nonlocal reason
            reason = await self._receiver(conn)

        async def guarded(fn: Any) -> None:
            # Failures end the session here, never as an exception group out of the nursery.
            nonlocal reason
            try:
                await fn()
            except WireProtocolError as e:
                log.warning("node %s: closing its connection: %s", node, e)
                reason = f"protocol error: {e}"
            except (StreamClosed, trio.BrokenResourceError, trio.ClosedResourceError) as e:
                reason = f"stream closed: {e}" if str(e) else "stream closed"
            nursery.cancel_scope.cancel()

        try:
            with conn.scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(guarded, partial(self._sender, conn, hb))
                    nursery.start_soon(guarded, receive)
        finally:
            reason = conn.closing_reason or reason
            if self.conns.get(node) is conn:
                del self.conns[node]
            self.host.agent_disconnected(n, conn.agent_id, reason)

    async def _receiver(self, conn: _Conn) -> str:
        # A peer silent for this long is gone even if TCP has not noticed.
        silence = max(3 * self.cfg.heartbeat_s, self.cfg.not_ready_after_s * 2)
        while True:
            with trio.move_on_after(silence) as cs:
                msg = await conn.stream.receive()
            if cs.cancelled_caught:
                return f"silent for {silence:.0f}s"
            self.host.agent_heard(conn.node, conn.agent_id)
            if isinstance(msg, EngineUpdate):
                self.host.engine_reported(conn.node, msg.report)
            elif isinstance(msg, Bye):
                self.host.agent_left(conn.node)
                return f"agent left: {msg.reason}"
            elif not isinstance(msg, Heartbeat):
                raise WireProtocolError(f"unexpected {type(msg).TYPE} from an agent")

    async def _sender(self, conn: _Conn, hb: float) -> None:
        while True:
            rev = self._node_rev.get(conn.node, 0)
            if rev != conn.sent_rev:
                conn.sent_rev = rev
                await conn.stream.send(Desired(rev=rev, engines=tuple(self.host.desired_for(conn.node))))
            else:
                await conn.stream.send(Heartbeat())
            with trio.move_on_after(hb):
                await conn.wake.wait()
            conn.wake = trio.Event()
