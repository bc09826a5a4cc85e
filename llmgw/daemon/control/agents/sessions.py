"""The control plane's side of the agents' streams (docs/architecture.md has the protocol).

An agent dials in and must say hello within `hello_timeout_s`. Until its hello is accepted a
connection is an outsider: at most `max_pending_agents` wait at once (more are closed at once),
and its frames are capped at `max_hello_bytes`; only an accepted hello lifts the cap to
`max_message_bytes`. The hello is checked — a common protocol version, then the node's identity
(agents/identity.py, llmgw.fleet.identity): the node's credential, or the join token for a node that
has none — and refused with a reason, or answered with a welcome (carrying a new credential at a
first join). A node's live connection is never replaced by another identity.

A session then runs two loops until the stream ends, the agent says bye, falls silent, its node is
revoked, or a newer connection of the same node replaces it: a receiver (heartbeats, engine updates
— each report's URL checked, agents/report_check.py — bye) and a sender (the node's `desired` set whenever
it changed, a heartbeat otherwise).

Several routers (docs/ha.md): the welcome says the leadership epoch, whether this router leads and every
live router's address (SessionHost.epoch/leading/router_addrs); a `routers` message repeats them to an
agent listing FEATURE_ROUTERS whenever they change (leadership_changed, routers_changed); `desired`
goes out only while this router leads, stamped with its epoch.

What the agents say goes to the control plane (plane/plane.py) through SessionHost: a node joined, was
heard, reported an engine, left or disconnected; the plane answers each node's desired set."""

from __future__ import annotations

import logging
import socket
import ssl
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Protocol

import trio

from llmgw.admin.schema import JoinInfo
from llmgw.config import ControlConfig
from llmgw.daemon.control.agents.tls import ControlTls, ca_fingerprint
from llmgw.daemon.control.agents.identity import IdentityStoreError, JoinToken, NodeIdentities, Verdict
from llmgw.daemon.control.agents.report_check import ReportChecker, peer_address, rejected_report
from llmgw.daemon.control.store.port import FleetStore
from llmgw.daemon.control.agents.stream_metrics import StreamStats
from llmgw.daemon.net.message_stream import MessageStream, StreamClosed
from llmgw.fleet.budget import TokenBucket
from llmgw.fleet.identity import LiveSession
from llmgw.fleet.nodes import Node
from llmgw.fleet.report_url import parse_networks
from llmgw.fleet.types import EngineReport, EngineSpec
from llmgw.fleet.wire import (
    FEATURE_KV_EVENTS,
    FEATURE_REPORT_REJECTED,
    FEATURE_ROUTERS,
    FROM_AGENT,
    PROTOCOL_VERSION,
    ROUTER_FEATURES,
    Bye,
    Desired,
    EngineUpdate,
    Heartbeat,
    Hello,
    KvEvents,
    Refused,
    ReportRejected,
    RouterAddr,
    Routers,
    Skipped,
    Welcome,
    WireProtocolError,
)

log = logging.getLogger("llmgw.control")

__all__ = ["AgentSessions", "SessionHost"]

LOG_EVERY_S = 10.0  # a flood of bad connections is logged once per this, with a count


class SessionHost(Protocol):
    """The control plane, as the agents' sessions see it (ControlPlane implements it)."""

    router_id: str
    store: FleetStore

    def agent_joined(self, hello: Hello, peer: str) -> Node:
        """A node's agent said hello (and was welcome): the node's record."""
        ...

    def agent_heard(self, node: str, agent_id: str) -> None: ...

    def power_measured(self, node: str, watts: float) -> None:
        """The node's agent measured its GPUs' power draw (judged by placement: absurd ones are ignored)."""
        ...

    def engine_reported(self, node: str, report: EngineReport) -> None: ...

    def agent_left(self, node: str) -> None:
        """The agent said bye: it is stopping its engines."""
        ...

    def agent_disconnected(self, n: Node, agent_id: str, reason: str) -> None: ...

    def knows_node(self, node: str) -> bool:
        """The router knows this node name (it joined before, or is in the store)."""
        ...

    def kv_events(self, node: str, msg: KvEvents) -> bool:
        """KV block changes of one of `node`'s replicas: False (refused, counted) if not its own."""
        ...

    def kv_refusal(self, node: str, replica: str) -> str | None:
        """Why `node` may not write `replica`'s KV index (a REFUSE_REASONS value), or None."""
        ...

    def kv_skipped(self, node: str, sk: Skipped) -> None:
        """A kv_events message turned away before it was decoded (refused, or over the node's budget)."""
        ...

    def desired_for(self, node: str) -> list[EngineSpec]:
        """What `node` should run now."""
        ...

    def leading(self) -> bool:
        """Whether this router leads the control plane: only the leader sends desired sets."""
        ...

    def node_revoked(self, node: str) -> list[str]:
        """An operator revoked the node: forget it, withdraw its replicas (their ids)."""
        ...

    def leading(self) -> bool:
        """This router leads the control plane now: only then does it send `desired`."""
        ...

    def epoch(self) -> int:
        """The leadership epoch this router knows (its own while leading; 0: none)."""
        ...

    def router_addrs(self) -> list[RouterAddr]:
        """Every live router's control address and TLS pin, for the agents to dial (this one's too)."""
        ...


@dataclass
class _Conn:
    node: str
    agent_id: str
    stream: MessageStream
    peer: str
    checker: ReportChecker
    notify_rejects: bool  # the agent understands report_rejected
    kv_events: bool  # the agent listed the kv_events feature: it may send kv_events
    routers: bool  # the agent understands the routers message
    last_heard: float
    credential_hash: str = ""
    confirm_on_next: bool = False  # a credential issued in the welcome: the next message proves it kept
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    wake: trio.Event = field(default_factory=trio.Event)
    sent_rev: int = -1
    sent_view: tuple[int, bool, tuple[RouterAddr, ...]] | None = None  # (epoch, leading, routers) it was told
    closing_reason: str = ""
    replaced: bool = False


def _ssl_cause(e: BaseException) -> ssl.SSLError | None:
    seen: BaseException | None = e
    for _ in range(4):  # StreamClosed <- trio.BrokenResourceError <- ssl.SSLError
        if seen is None or isinstance(seen, ssl.SSLError):
            break
        seen = seen.__cause__
    return seen if isinstance(seen, ssl.SSLError) else None


class _Throttled:
    """Warnings about outsiders, at most one per key every LOG_EVERY_S, with what was left out."""

    def __init__(self) -> None:
        self._next: dict[str, float] = {}
        self._skipped: dict[str, int] = {}

    def warning(self, key: str, msg: str, *args: Any) -> None:
        now = trio.current_time()
        if now < self._next.get(key, 0.0):
            self._skipped[key] = self._skipped.get(key, 0) + 1
            return
        skipped = self._skipped.pop(key, 0)
        self._next[key] = now + LOG_EVERY_S
        log.warning(msg + (f" (and {skipped} more like it in the last {LOG_EVERY_S:.0f}s)" if skipped else ""),
                    *args)


class AgentSessions:
    """The connected agents, one session per node, and each node's `desired` revision."""

    def __init__(self, host: SessionHost, cfg: ControlConfig, token: str | None) -> None:
        self.host = host
        self.cfg = cfg
        if cfg.join_token_file:
            self.join_token = JoinToken(token, path=cfg.join_token_file)
        else:
            self.join_token = JoinToken(token, generated=token is not None and not cfg.join_token)
        self.identities = NodeIdentities(host.store, self.join_token)
        self.networks = parse_networks(cfg.engine_networks)
        self.conns: dict[str, _Conn] = {}
        self.stats = StreamStats()
        self._node_rev: dict[str, int] = {}  # per node, bumped when its desired set changes
        self._throttled = _Throttled()
        # New node names one join token may register: ghosts by the thousand would cost the router memory
        # and every operator's listing their noise (the partition guard ignores them anyway).
        self.new_names = TokenBucket(cfg.new_nodes_per_minute / 60.0, cfg.new_nodes_per_minute, trio.current_time())
        self._kv_budgets: dict[str, TokenBucket] = {}  # node -> its KV event budget (see _kv_gate)
        self.listener: tuple[str, int] | None = None  # (host, port) agents dial, once listening
        self.tls: ControlTls | None = None

    def set_listener(self, host: str, port: int, tls: ControlTls | None) -> None:
        """Where the control listener is and its TLS (for join-info)."""
        self.listener, self.tls = (host, port), tls

    def join_info(self) -> JoinInfo:
        router = None
        if self.listener is not None:
            host, port = self.listener
            if host in ("", "0.0.0.0", "::"):
                host = socket.gethostname()
            router = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        tls = self.tls
        ca = tls.ca_pem if tls is not None else None
        return JoinInfo(router=router, join_token=self.join_token.current(), join_token_source=self.join_token.source,
                        tls=tls is not None, ca_pem=ca, ca_sha256=ca_fingerprint(ca) if ca else None,
                        server_name=tls.server_name if tls is not None else None)

    @property
    def stale_after_s(self) -> float:
        """A node's connection silent this long may be replaced by the same node's new one."""
        return max(2 * self.cfg.heartbeat_s, 1.0)

    def push(self, node: str) -> None:
        """The node's desired set changed: its session sends it now."""
        self._node_rev[node] = self._node_rev.get(node, 0) + 1
        conn = self.conns.get(node)
        if conn is not None:
            conn.wake.set()

    def leadership_changed(self) -> None:
        """This router took or lost the lead (or the epoch changed): every session tells its agent
        (a `routers` message); while leading, each node's desired set goes out again, with the epoch."""
        leading = self.host.leading()
        for node, conn in self.conns.items():
            if leading:
                self._node_rev[node] = self._node_rev.get(node, 0) + 1
            conn.wake.set()

    def routers_changed(self) -> None:
        """The live routers (or their addresses or pins) changed: every session tells its agent."""
        for conn in self.conns.values():
            conn.wake.set()

    def _view(self) -> tuple[int, bool, tuple[RouterAddr, ...]]:
        return self.host.epoch(), self.host.leading(), tuple(self.host.router_addrs())

    # -- operator actions ----------------------------------------------------------------------------
    def revoke(self, node: str) -> tuple[bool, bool, list[str], str | None]:
        """Cut a node off: its credential refused from now on, its connection closed, the node
        forgotten and its replicas withdrawn. (had a credential, was connected, replicas withdrawn,
        why the store could not record it or None)."""
        had, store_error = self.identities.revoke(node)
        conn = self.conns.pop(node, None)
        if conn is not None:
            conn.closing_reason = "revoked by an operator"
            conn.scope.cancel()
        withdrawn = self.host.node_revoked(node)
        self._node_rev.pop(node, None)
        self._kv_budgets.pop(node, None)
        log.warning("node %s revoked by an operator%s; %d replicas withdrawn", node,
                    " (its connection closed)" if conn is not None else "", len(withdrawn))
        return had, conn is not None, withdrawn, store_error

    def credentials_changed(self, rows: dict[str, Any]) -> None:
        """Several routers: the store's credentials as another router left them (a follower's
        snapshot, plane/follow.py). A node revoked there is cut off here too; one that joined there
        is known here."""
        if not rows:
            return
        for node, row in rows.items():
            old = self.identities.records.get(node)
            if row.revoked_at is not None and (old is None or old.revoked_at is None):
                conn = self.conns.pop(node, None)
                if conn is not None:
                    conn.closing_reason = "revoked at another router"
                    conn.scope.cancel()
                    log.warning("node %s was revoked at another router: its connection here is closed", node)
        self.identities.records.update(rows)

    # -- accepting a connection ----------------------------------------------------------------------
    async def serve_agent(self, raw: trio.SocketStream, ssl_context: ssl.SSLContext | None) -> None:
        """One accepted connection, from its hello to its end."""
        try:
            host, port = raw.socket.getpeername()[:2]
            peer = f"{host}:{port}"
        except OSError:
            host, peer = "", "?"
        if self.stats.pending >= self.cfg.max_pending_agents:
            self.stats.closed_before_hello["pending_cap"] += 1
            self._throttled.warning("pending_cap", "agent connection from %s closed at once: %d connections are "
                                    "already waiting for their hello (control.max_pending_agents)", peer,
                                    self.stats.pending)
            await trio.aclose_forcefully(raw)
            return
        self.stats.pending += 1
        pending = True
        stream: trio.abc.Stream = raw
        if ssl_context is not None:
            stream = trio.SSLStream(raw, ssl_context, server_side=True)
        ms = MessageStream(stream, max_frame=self.cfg.max_hello_bytes, accept=FROM_AGENT)
        try:
            with trio.fail_after(self.cfg.hello_timeout_s):
                hello = await ms.receive()  # the TLS handshake happens in here
            if not isinstance(hello, Hello):
                raise WireProtocolError(f"expected hello first, got {type(hello).TYPE}")
            self.stats.pending -= 1
            pending = False
            admitted = await self._admit(hello, ms, peer, host)
            if admitted is not None:
                await self._session(hello, *admitted)
        except trio.TooSlowError:
            self._closed_before_hello("timeout", peer, f"no hello within {self.cfg.hello_timeout_s}s")
        except WireProtocolError as e:
            if pending:
                self._closed_before_hello("oversize" if "exceeds" in str(e) else "protocol", peer, str(e))
            else:
                log.warning("agent connection from %s closed: %s", peer, e)
        except (StreamClosed, trio.BrokenResourceError, trio.ClosedResourceError) as e:
            if pending:
                cause = _ssl_cause(e)
                self._closed_before_hello("tls" if cause else "closed", peer,
                                          f"TLS handshake failed ({cause.reason or cause}): an agent without TLS, "
                                          "or one that does not trust this router's CA?" if cause
                                          else f"{e or 'closed'} before its hello")
        finally:
            if pending:
                self.stats.pending -= 1
            with trio.move_on_after(1) as cs:
                cs.shield = True
                await ms.aclose()

    def _closed_before_hello(self, why: str, peer: str, detail: str) -> None:
        self.stats.closed_before_hello[why] += 1
        self._throttled.warning(why, "agent connection from %s closed: %s", peer, detail)

    async def _admit(self, hello: Hello, ms: MessageStream, peer: str, host: str) -> tuple[_Conn, str] | None:
        """Check the hello; refuse it (None) or register the node's connection — in one step with
        the check, so two hellos for one node cannot both pass it — and give the credential to
        issue in the welcome ("" for none)."""
        node = hello.node
        if PROTOCOL_VERSION not in hello.versions:
            why = f"no common protocol version (router speaks {PROTOCOL_VERSION}, agent {list(hello.versions)})"
            return await self._refuse(ms, node, peer, "version", why)
        old = self.conns.get(node)
        live = None if old is None else LiveSession(old.agent_id, trio.current_time() - old.last_heard, old.peer)
        try:
            verdict: Verdict = self.identities.check(hello, live, self.stale_after_s)
        except IdentityStoreError as e:
            log.error("%s", e)
            return await self._refuse(ms, node, peer, "store", "the router cannot record a credential for "
                                      "this node now (its store cannot write)", retry=True)
        adm = verdict.admission
        if not adm.ok:
            return await self._refuse(ms, node, peer, adm.kind, adm.reason, retry=adm.retry)
        if not verdict.presented_hash and self.identities.record(node) is None and not self.host.knows_node(node) \
                and not self.new_names.take(trio.current_time()):
            return await self._refuse(ms, node, peer, "join_rate", "the join token registered "
                                      f"{self.cfg.new_nodes_per_minute} new node names in the last minute "
                                      "(control.new_nodes_per_minute); retrying later", retry=True)
        if adm.confirm:
            self.identities.confirm(node, verdict.presented_hash)
        if old is not None:
            log.warning("node %s: a new connection from %s replaces the one from %s (silent for %.1fs)", node, peer,
                        old.peer, trio.current_time() - old.last_heard)
            old.closing_reason = "replaced by a newer connection of the same node"
            old.replaced = True
            old.scope.cancel()
        if adm.issue:
            log.info("node %s from %s: joined with the join token; issued its credential", node, peer)
        elif not verdict.presented_hash and not hello.credential:
            log.warning("node %s from %s: its agent keeps no node credential (an older llmgw?): upgrade it; "
                        "until then the join token alone admits this node name", node, peer)
        ms.max_frame = self.cfg.max_message_bytes  # an accepted hello lifts the outsider's cap
        conn = _Conn(node, hello.agent_id, ms, peer, ReportChecker(peer_address(host), self.networks),
                     notify_rejects=hello.has(FEATURE_REPORT_REJECTED), kv_events=hello.has(FEATURE_KV_EVENTS),
                     routers=hello.has(FEATURE_ROUTERS), last_heard=trio.current_time(),
                     credential_hash=verdict.presented_hash, confirm_on_next=adm.issue)
        if conn.kv_events:
            ms.gate = self._kv_gate(node)
        self.conns[node] = conn
        return conn, verdict.secret

    def _kv_gate(self, node: str) -> Any:
        """The node's KV event budget, and the check that it writes only its own replicas — both
        before a kv_events message is parsed and its blocks decoded (~1 µs each): a flood costs a
        look at each frame's head (llmgw.fleet.wire_peek) and no more."""
        budget = self._kv_budgets.get(node)
        if budget is None:  # per node name, not per connection: reconnecting does not refill it
            budget = self._kv_budgets[node] = TokenBucket(self.cfg.kv_events_per_s, self.cfg.kv_events_burst,
                                                          trio.current_time())

        def gate(t: str, replica: str | None, blocks: int) -> Skipped | None:
            if t != KvEvents.TYPE:
                return None
            if not budget.take(trio.current_time(), 1 + blocks):
                return Skipped(t, "budget", replica, blocks)
            if replica is not None and (why := self.host.kv_refusal(node, replica)) is not None:
                return Skipped(t, why, replica, blocks)
            return None  # decoded (and checked whole) as usual

        return gate

    async def _refuse(self, ms: MessageStream, node: str, peer: str, kind: str, why: str, *,
                      retry: bool = False) -> None:
        self.stats.refused[kind or "other"] += 1
        # Throttled per kind, not per node name: an outsider chooses the names.
        self._throttled.warning(f"refused:{kind}", "refused agent %r from %s: %s", node, peer, why)
        with trio.move_on_after(2):
            await ms.send(Refused(why, retry=retry))
        return None

    # -- a session -----------------------------------------------------------------------------------
    async def _checked(self, conn: _Conn, report: EngineReport) -> EngineReport:
        why = await conn.checker.problem(report)
        if why is None:
            return report
        self.stats.reports_rejected += 1
        self._throttled.warning(f"report:{conn.node}", "node %s (from %s): refused the report of engine %s: %s",
                                conn.node, conn.peer, report.replica, why)
        if conn.notify_rejects:
            await conn.stream.send(ReportRejected(report.replica, why))
        return rejected_report(report, why)

    async def _session(self, hello: Hello, conn: _Conn, secret: str) -> None:
        node, ms = conn.node, conn.stream
        hb = self.cfg.heartbeat_s
        reason = "stream closed"
        n: Node | None = None
        try:
            with conn.scope:
                conn.sent_view = epoch, leading, routers = self._view()
                await ms.send(Welcome(node=node, router_id=self.host.router_id, version=PROTOCOL_VERSION,
                                      heartbeat_s=hb, credential=secret, features=ROUTER_FEATURES, epoch=epoch,
                                      leading=leading, routers=routers))
                engines = tuple([await self._checked(conn, r) for r in hello.engines])
                n = self.host.agent_joined(replace(hello, engines=engines), conn.peer)
                self._node_rev[node] = self._node_rev.get(node, 0) + 1

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

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(guarded, partial(self._sender, conn, hb))
                    nursery.start_soon(guarded, receive)
        except (StreamClosed, trio.BrokenResourceError, trio.ClosedResourceError) as e:
            reason = f"stream closed: {e}" if str(e) else "stream closed"
        finally:
            reason = conn.closing_reason or reason
            if self.conns.get(node) is conn:
                del self.conns[node]
            if n is not None and not conn.replaced:  # replaced: the node's new connection is up
                self.host.agent_disconnected(n, conn.agent_id, reason)

    async def _receiver(self, conn: _Conn) -> str:
        # A peer silent for this long is gone even if TCP has not noticed.
        silence = max(3 * self.cfg.heartbeat_s, self.cfg.not_ready_after_s * 2)
        while True:
            with trio.move_on_after(silence) as cs:
                msg = await conn.stream.receive()
            if cs.cancelled_caught:
                return f"silent for {silence:.0f}s"
            conn.last_heard = trio.current_time()
            if conn.confirm_on_next:  # it saved the credential before sending this
                conn.confirm_on_next = False
                self.identities.confirm(conn.node, conn.credential_hash)
            self.host.agent_heard(conn.node, conn.agent_id)
            if isinstance(msg, Skipped):
                self.host.kv_skipped(conn.node, msg)
                if msg.why == "budget":
                    self._throttled.warning(f"kv-budget:{conn.node}", "node %s (from %s): kv_events over its event "
                                            "budget (control.kv_events_per_s = %d, burst %d) dropped undecoded; its "
                                            "replicas' tier-2 index waits for a reset (llmgw_kv_events_dropped_total)",
                                            conn.node, conn.peer, self.cfg.kv_events_per_s, self.cfg.kv_events_burst)
                else:
                    self._throttled.warning(f"kv:{conn.node}", "node %s (from %s): refused kv_events for replica "
                                            "%r: not one this node runs", conn.node, conn.peer, msg.replica)
            elif isinstance(msg, EngineUpdate):
                self.host.engine_reported(conn.node, await self._checked(conn, msg.report))
            elif isinstance(msg, KvEvents):
                if not conn.kv_events:
                    raise WireProtocolError("kv_events from an agent that did not list the kv_events feature")
                if not self.host.kv_events(conn.node, msg):
                    self._throttled.warning(f"kv:{conn.node}", "node %s (from %s): refused kv_events for replica "
                                            "%r: not one this node runs", conn.node, conn.peer, msg.replica)
            elif isinstance(msg, Bye):
                self.host.agent_left(conn.node)
                return f"agent left: {msg.reason}"
            elif not isinstance(msg, Heartbeat):
                raise WireProtocolError(f"unexpected {type(msg).TYPE} from an agent")
            elif msg.measured_watts is not None:
                self.host.power_measured(conn.node, msg.measured_watts)

    async def _sender(self, conn: _Conn, hb: float) -> None:
        while True:
            view = self._view()
            sent = False
            if conn.routers and view != conn.sent_view:
                conn.sent_view = view
                await conn.stream.send(Routers(*view))
                sent = True
            rev = self._node_rev.get(conn.node, 0)
            if rev != conn.sent_rev and view[1]:  # only a leader says what a node runs
                conn.sent_rev = rev
                await conn.stream.send(Desired(rev=rev, engines=tuple(self.host.desired_for(conn.node)),
                                               epoch=view[0]))
            elif not sent:
                await conn.stream.send(Heartbeat())
            with trio.move_on_after(hb):
                await conn.wake.wait()
            conn.wake = trio.Event()
