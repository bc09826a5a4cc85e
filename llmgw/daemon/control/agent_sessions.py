"""The control plane's side of the agents' streams (docs/architecture.md has the protocol).

An agent dials in and must say hello within HELLO_TIMEOUT_S; the hello is checked (the join
token, in constant time; a common protocol version) and refused with a reason, or answered with
a welcome. The hello carries the agent's whole state: what it does not mention, it does not run.
A session then runs two loops until the stream ends, the agent says bye, falls silent, or a newer
connection of the same node replaces it: a receiver (heartbeats, engine updates, bye) and a
sender (the node's `desired` set whenever it changed, a heartbeat otherwise).

AgentSessions is part of the ControlPlane (plane.py), split out by role: what the agents say goes
into the plane's node registry, its engine-report handling and its reconcile loop's wake-up."""

from __future__ import annotations

import hmac
import logging
import ssl
import time
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import trio

from llmgw.daemon.net.message_stream import MessageStream, StreamClosed
from llmgw.fleet.wire import (
    FROM_AGENT,
    PROTOCOL_VERSION,
    Bye,
    Desired,
    EngineUpdate,
    Heartbeat,
    Hello,
    ProtocolError,
    Refused,
    Welcome,
)

if TYPE_CHECKING:
    from llmgw.daemon.control.plane import ControlPlane

log = logging.getLogger("llmgw.control")

__all__ = ["HELLO_TIMEOUT_S", "AgentSessions"]

HELLO_TIMEOUT_S = 10.0


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

    def __init__(self, plane: ControlPlane, token: str | None) -> None:
        self.plane = plane
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
        ms = MessageStream(stream, max_frame=self.plane.cfg.control.max_message_bytes, accept=FROM_AGENT)
        try:
            with trio.fail_after(HELLO_TIMEOUT_S):
                hello = await ms.receive()
            if not isinstance(hello, Hello):
                raise ProtocolError(f"expected hello first, got {type(hello).TYPE}")
            why = self._refusal(hello)
            if why is not None:
                log.warning("refused agent %r from %s: %s", hello.node, peer, why)
                with trio.move_on_after(2):
                    await ms.send(Refused(why))
                return
            await self._session(hello, ms, peer)
        except trio.TooSlowError:
            log.warning("agent connection from %s closed: no hello within %ss", peer, HELLO_TIMEOUT_S)
        except ProtocolError as e:
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
        plane = self.plane
        node = hello.node
        conn = _Conn(node, hello.agent_id, ms, peer)
        old = self.conns.get(node)
        if old is not None:
            log.warning("node %s: a new connection from %s replaces the one from %s", node, peer, old.peer)
            old.closing_reason = "replaced by a newer connection"
            old.scope.cancel()
        self.conns[node] = conn
        now = trio.current_time()
        plane._transitions(plane.nodes.connected(node, hello.agent_id, labels=hello.labels, facts=hello.facts,
                                                 now=now))
        n = plane.nodes.nodes[node]
        plane.store.upsert_node(node, agent_labels=hello.labels, facts=hello.facts.to_wire(), seen_at=time.time())
        log.info("node %s joined from %s (agent %s, %d engines)", node, peer, hello.agent_id, len(hello.engines))
        # The hello is the agent's whole truth: what it does not mention, it does not run.
        reported = {r.replica for r in hello.engines}
        for a in [a for a in plane.assignments.values() if a.node == node and a.replica not in reported]:
            plane._on_report(node, None, a)
        for r in hello.engines:
            plane._on_report(node, r)
        self._node_rev[node] = self._node_rev.get(node, 0) + 1
        hb = plane.cfg.control.heartbeat_s
        await ms.send(Welcome(node=node, router_id=plane.router_id, version=PROTOCOL_VERSION, heartbeat_s=hb))
        reason = "stream closed"

        async def receive() -> None:
            nonlocal reason
            reason = await self._receiver(conn)

        async def guarded(fn: Any) -> None:
            # Failures end the session here, never as an exception group out of the nursery.
            nonlocal reason
            try:
                await fn()
            except ProtocolError as e:
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
            plane._transitions(plane.nodes.disconnected(node, conn.agent_id, reason, trio.current_time()))
            if n.state != "ready":
                log.info("node %s disconnected: %s", node, reason)
            plane._wake.set()

    async def _receiver(self, conn: _Conn) -> str:
        plane = self.plane
        # A peer silent for this long is gone even if TCP has not noticed.
        silence = max(3 * plane.cfg.control.heartbeat_s, plane.cfg.control.not_ready_after_s * 2)
        while True:
            with trio.move_on_after(silence) as cs:
                msg = await conn.stream.receive()
            if cs.cancelled_caught:
                return f"silent for {silence:.0f}s"
            plane._transitions(plane.nodes.heard(conn.node, conn.agent_id, trio.current_time()))
            if isinstance(msg, EngineUpdate):
                plane._on_report(conn.node, msg.report)
                plane._wake.set()
            elif isinstance(msg, Bye):
                # A leaving agent stops its engines: out of routing now, not after failed requests.
                for a in [a for a in plane.assignments.values() if a.node == conn.node]:
                    plane._on_report(conn.node, None, a)
                return f"agent left: {msg.reason}"
            elif not isinstance(msg, Heartbeat):
                raise ProtocolError(f"unexpected {type(msg).TYPE} from an agent")

    async def _sender(self, conn: _Conn, hb: float) -> None:
        while True:
            rev = self._node_rev.get(conn.node, 0)
            if rev != conn.sent_rev:
                conn.sent_rev = rev
                await conn.stream.send(Desired(rev=rev, engines=tuple(self.plane.desired_for(conn.node))))
            else:
                await conn.stream.send(Heartbeat())
            with trio.move_on_after(hb):
                await conn.wake.wait()
            conn.wake = trio.Event()
