"""The agent's session with one router (a :class:`RouterLink`); the agent keeps one per router
(agent.py: its configured router, and every other router the routers list).

A link is the agent's to keep: on any failure it reconnects with its own exponential backoff and
jitter, and says hello again with everything the node runs — the router needs no memory of it. A
router that falls silent for three heartbeats is treated as gone (a half-open TCP connection
would otherwise hide it). A refusal that will not fix itself (a wrong token or credential, a
revoked node) is retried with the longest backoff; one marked `retry` (the node's old connection
has not timed out on the router yet) with the usual one.

What the router says goes to the agent (welcome, routers, desired); what the agent says — engine
updates, heartbeats with the GPUs' power draw, KV events — goes to every live link
(:meth:`RouterLink.queue_report`, :meth:`RouterLink.queue_kv`)."""

from __future__ import annotations

import logging
import math
import random
import ssl
from dataclasses import replace
from functools import partial
from typing import Any, Protocol

import trio

from llmgw.config import AgentConfig
from llmgw.daemon.agent.credential import save_credential
from llmgw.daemon.agent.engines import EngineSupervisor
from llmgw.daemon.agent.kv_subscriber import KvSubscribers
from llmgw.daemon.agent.router_tls import RouterTls
from llmgw.daemon.net.message_stream import MessageStream, StreamClosed, open_client
from llmgw.fleet.types import EngineReport, NodeFacts, RouterAddr
from llmgw.fleet.wire import (
    AGENT_FEATURES,
    FEATURE_KV_EVENTS,
    FROM_ROUTER,
    MAX_HELLO,
    SUPPORTED_VERSIONS,
    Bye,
    Desired,
    EngineUpdate,
    Heartbeat,
    Hello,
    KvEvents,
    Refused,
    ReportRejected,
    Routers,
    Welcome,
    WireProtocolError,
    encode,
)

log = logging.getLogger("llmgw.agent")

__all__ = ["CredentialNotSaved", "LinkHost", "RouterLink", "RouterRefused"]

WELCOME_TIMEOUT_S = 10.0


class RouterRefused(Exception):
    """The router refused this agent (wrong token or credential, unsupported version ...)."""

    def __init__(self, reason: str, retry: bool = False) -> None:
        super().__init__(reason)
        self.retry = retry


class CredentialNotSaved(Exception):
    """The credential the router issued could not be saved: the session ends before it is used."""


class FellBehind(Exception):
    """The router did not take this session's KV events for too long (agent.py's KV pump)."""


class LinkHost(Protocol):
    """The agent, as its links see it (agent.Agent implements it)."""

    cfg: AgentConfig
    token: str
    agent_id: str
    credential: str  # the node's, "" before its first welcome; a link sets it when a welcome issues one
    facts: NodeFacts
    supervisor: EngineSupervisor | None
    kv: KvSubscribers

    def heard_routers(self, link: RouterLink, epoch: int, leading: bool, routers: tuple[RouterAddr, ...]) -> None:
        """A welcome's or `routers` message's view: the epoch, whether it leads, the live routers."""
        ...

    def desired(self, link: RouterLink, msg: Desired) -> None: ...


# What ends a session (and is followed by a reconnect), as opposed to a bug.
_SESSION_ERRORS = (StreamClosed, trio.BrokenResourceError, trio.ClosedResourceError, WireProtocolError,
                   trio.TooSlowError, ssl.SSLError, OSError, FellBehind)


class RouterLink:
    """The agent's session with one router at `address` ("host:port"), reconnecting until cancelled
    (`scope`). `configured`: the router of the agent's config (never dropped)."""

    def __init__(self, agent: LinkHost, address: str, tls: RouterTls | None, *, configured: bool) -> None:
        self.agent = agent
        self.address = address
        host, _, port = address.rpartition(":")
        self.host, self.port = host.strip("[]"), int(port)
        self.tls = tls
        self.configured = configured
        self.router_id: str | None = None  # as its last welcome said
        self.connected = False  # a session is up (reports queue for it from the hello on)
        self.welcomed = False
        self.epoch = 0  # the leadership epoch this router last spoke of
        self.leading = True
        self.listed: tuple[RouterAddr, ...] = ()  # the routers it last listed
        self.unlisted_since: float | None = None  # agent.py's drop rule
        self.kv_behind_since: float | None = None  # agent.py's KV pump
        self.scope = trio.CancelScope()
        self._ms: MessageStream | None = None
        self._session_scope: trio.CancelScope | None = None
        self._reports: trio.MemorySendChannel[EngineReport] | None = None
        self._kv: trio.MemorySendChannel[KvEvents] | None = None
        self._kv_queue: trio.MemoryReceiveChannel[KvEvents] | None = None
        self._fell_behind = ""
        self._rng = random.Random()

    def __repr__(self) -> str:
        return f"RouterLink({self.address}, router={self.router_id})"

    # -- what the agent hands to every live link ---------------------------------------------------
    def queue_report(self, report: EngineReport) -> None:
        if self._reports is not None:
            self._reports.send_nowait(report)  # while disconnected the next hello carries the whole state

    @property
    def live(self) -> bool:
        """Welcomed, and the session is still up."""
        return self.connected and self.welcomed

    @property
    def kv_live(self) -> bool:
        """The session takes kv_events (its router listed the feature)."""
        return self._kv is not None

    def kv_backlog(self) -> int:
        return self._kv_queue.statistics().current_buffer_used if self._kv_queue is not None else 0

    def queue_kv(self, msg: KvEvents) -> None:
        if self._kv is not None:
            self._kv.send_nowait(msg)

    def end_session(self, why: str) -> None:
        """End the current session (the link reconnects)."""
        if self._session_scope is not None:
            self._fell_behind = why
            self._session_scope.cancel()

    async def say_bye(self, reason: str) -> None:
        ms = self._ms
        if ms is None:
            return
        try:
            await ms.send(Bye(reason))
        except _SESSION_ERRORS:
            pass

    # -- the connection ----------------------------------------------------------------------------
    async def run(self) -> None:
        with self.scope:
            await self._connect_loop()

    async def _connect_loop(self) -> None:
        a = self.agent.cfg
        delay = a.reconnect_min_s
        while True:
            self.welcomed = False
            try:
                ms = await open_client(self.host, self.port, ssl_context=self.tls.context if self.tls else None,
                                       server_hostname=self.tls.server_name if self.tls else None, accept=FROM_ROUTER)
            except (OSError, ssl.SSLError, trio.BrokenResourceError) as e:
                log.warning("cannot reach the router at %s:%d: %s", self.host, self.port, _connect_error(e))
            else:
                try:
                    await self._session(ms)
                except RouterRefused as e:
                    if e.retry:
                        log.warning("the router at %s:%d refused this agent for now: %s", self.host, self.port, e)
                    else:
                        log.error("the router at %s:%d refused this agent: %s", self.host, self.port, e)
                        delay = a.reconnect_max_s  # a wrong token or credential will not fix itself quickly
                except CredentialNotSaved as e:
                    log.error("%s", e)
                except trio.TooSlowError:
                    log.warning("the router at %s:%d went silent (or sent no welcome); reconnecting", self.host,
                                self.port)
                except FellBehind as e:
                    log.warning("the router at %s:%d %s; reconnecting (its KV index gets a full copy)", self.host,
                                self.port, e)
                except _SESSION_ERRORS as e:
                    if not self.welcomed and self.tls is None \
                            and isinstance(e, StreamClosed | trio.BrokenResourceError | ConnectionError):
                        # Closed before any answer to our hello: a TLS listener drops a plaintext hello.
                        log.warning("the router at %s:%d closed the connection before answering the hello "
                                    "(%s): most likely the router expects TLS (its [control] listen is beyond "
                                    "loopback, or control.tls = true) and this agent dials plain TCP: set agent.tls "
                                    "= true and agent.tls_ca or tls_ca_pem (`llmgw ctl join-info` on the router "
                                    "prints them)", self.host, self.port, e or type(e).__name__)
                    else:
                        log.warning("connection to the router at %s:%d lost: %s", self.host, self.port,
                                    e or type(e).__name__)
                finally:
                    self.connected = False
                    with trio.CancelScope(shield=True), trio.move_on_after(1):
                        await ms.aclose()
            if self.welcomed:
                delay = a.reconnect_min_s
            await trio.sleep(delay * (0.5 + self._rng.random()))  # jitter: agents must not return in lockstep
            delay = min(delay * 2, a.reconnect_max_s)

    def _hello(self) -> tuple[Hello, tuple[EngineReport, ...]]:
        """The hello, and the reports to send whole right after the welcome (if it had to trim them)."""
        ag = self.agent
        assert ag.supervisor is not None
        reports = tuple(ag.supervisor.reports())
        hello = Hello(token=ag.token, node=ag.cfg.node, agent_id=ag.agent_id,
                      versions=tuple(sorted(SUPPORTED_VERSIONS)), labels=dict(ag.cfg.labels), facts=ag.facts,
                      engines=reports, credential=ag.credential, features=AGENT_FEATURES)
        if len(encode(hello, 1)) <= MAX_HELLO:
            return hello, ()
        # The router caps a hello's size until it is accepted: send the reports without their
        # log tails and details first, and whole right after the welcome.
        hello = replace(hello, engines=tuple(replace(r, log_tail=(), detail=r.detail[:200]) for r in reports))
        return hello, tuple(r for r in reports if r.log_tail or len(r.detail) > 200)

    async def _session(self, ms: MessageStream) -> None:
        ag = self.agent
        # Reports queued for an earlier connection are covered by the hello.
        self._reports, reports = trio.open_memory_channel[EngineReport](math.inf)
        self.connected = True
        try:
            hello, resend = self._hello()
            await ms.send(hello)
            with trio.fail_after(WELCOME_TIMEOUT_S):
                msg = await ms.receive()
            if isinstance(msg, Refused):
                raise RouterRefused(msg.reason, msg.retry)
            if not isinstance(msg, Welcome):
                raise WireProtocolError(f"expected welcome, got {type(msg).TYPE}")
            if msg.credential:
                # Saved before anything else is sent: the router takes our next message as proof that
                # we have it, and from then on refuses this node without it.
                try:
                    save_credential(ag.cfg.state_dir, ag.cfg.node, msg.credential)
                except OSError as e:
                    raise CredentialNotSaved(f"cannot save the node credential the router issued in "
                                             f"{ag.cfg.state_dir}: {e.strerror or e}; reconnecting") from None
                ag.credential = msg.credential
                log.info("node %s: joined the router; its credential is saved in the state directory", ag.cfg.node)
            for r in resend:
                self._reports.send_nowait(r)
            self.welcomed = True
            if msg.router_id != self.router_id:
                log.info("connected to router %s at %s:%d as node %s", msg.router_id, self.host, self.port,
                         ag.cfg.node)
            self.router_id = msg.router_id
            await self._run_session(ms, msg, reports)
        finally:
            self._reports = self._kv = self._kv_queue = None
            self.connected = False
            self.listed = ()

    async def _run_session(self, ms: MessageStream, welcome: Welcome,
                           reports: trio.MemoryReceiveChannel[EngineReport]) -> None:
        hb = welcome.heartbeat_s
        failed: list[BaseException] = []

        async def guarded(fn: Any) -> None:
            # Kept out of the nursery's exception group: the first failure ends the session
            # and is raised as itself below.
            try:
                await fn()
            except _SESSION_ERRORS as e:
                failed.append(e)
                nursery.cancel_scope.cancel()

        self._ms, self._fell_behind, self.kv_behind_since = ms, "", None
        try:
            async with trio.open_nursery() as nursery:
                self._session_scope = nursery.cancel_scope
                self.agent.heard_routers(self, welcome.epoch, welcome.leading, welcome.routers)
                nursery.start_soon(guarded, partial(self._sender, ms, hb, reports))
                nursery.start_soon(guarded, partial(self._receive, ms, hb))
                if welcome.has(FEATURE_KV_EVENTS):  # an older router would close the stream on them
                    self._kv, self._kv_queue = trio.open_memory_channel[KvEvents](math.inf)
                    self.agent.kv.resend_all()  # this router's copy starts from a reset
                    nursery.start_soon(guarded, partial(self._kv_sender, ms, self._kv_queue))
        finally:
            self._ms = self._session_scope = None
        if failed:
            raise failed[0]
        if self._fell_behind:
            raise FellBehind(self._fell_behind)

    async def _receive(self, ms: MessageStream, hb: float) -> None:
        while True:
            with trio.fail_after(max(3 * hb, 2.0)):
                msg = await ms.receive()
            if isinstance(msg, Desired):
                self.agent.desired(self, msg)
            elif isinstance(msg, Routers):
                self.agent.heard_routers(self, msg.epoch, msg.leading, msg.routers)
            elif isinstance(msg, ReportRejected):
                log.warning("the router refused the report of engine %s: %s (it treats the engine as failed)",
                            msg.replica, msg.reason)
            elif not isinstance(msg, Heartbeat):
                raise WireProtocolError(f"unexpected {type(msg).TYPE} from the router")

    async def _kv_sender(self, ms: MessageStream, queue: trio.MemoryReceiveChannel[KvEvents]) -> None:
        """The engines' KV block changes the agent's pump hands this session (agent.py)."""
        async for m in queue:
            await ms.send(m)

    async def _sender(self, ms: MessageStream, hb: float, reports: trio.MemoryReceiveChannel[EngineReport]) -> None:
        sent_power = self.agent.facts.measured_watts  # the hello carried it
        while True:
            with trio.move_on_after(hb) as cs:
                report = await reports.receive()
            if not cs.cancelled_caught:
                await ms.send(EngineUpdate(report))
                continue
            power = self.agent.facts.measured_watts
            await ms.send(Heartbeat(measured_watts=power if power != sent_power else None))
            sent_power = power


# What OpenSSL says when the other end does not speak TLS: it closed the connection on our
# ClientHello (a plain-TCP router drops it as an oversized frame), or answered with non-TLS bytes.
_NOT_TLS_REASONS = frozenset({"UNEXPECTED_EOF_WHILE_READING", "WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE",
                              "PACKET_LENGTH_TOO_LONG", "HTTP_REQUEST", "UNKNOWN_PROTOCOL"})


def _connect_error(e: BaseException) -> str:
    """Why the connect failed, with what to do about a certificate the agent does not trust."""
    cause = e.__cause__ if isinstance(e, trio.BrokenResourceError) and e.__cause__ else e
    if isinstance(cause, ssl.SSLCertVerificationError):
        return (f"{cause.verify_message or cause}: the router's certificate is not one this agent trusts; set "
                "agent.tls_ca_pem (and tls_server_name) from `llmgw ctl join-info` on the router")
    if isinstance(cause, ssl.SSLError):
        if cause.reason in _NOT_TLS_REASONS:
            return (f"TLS handshake failed ({cause.reason}): got a non-TLS answer — the router's control port "
                    "is not TLS (a loopback [control] listen is plain TCP unless control.tls = true): set "
                    "agent.tls = false, or control.tls = true on the router")
        return f"TLS failed ({cause.reason or cause}): does the router serve TLS? (agent.tls, control.tls)"
    return str(e) or type(e).__name__
