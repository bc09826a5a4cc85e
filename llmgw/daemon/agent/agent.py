"""The agent: one per node. It learns the node's facts, dials the router, says hello with its full
state, and then runs what the router's `desired` sets say, reporting every engine's changes.

The connection is the agent's to keep: on any failure it reconnects with exponential backoff and
jitter, and says hello again with everything it runs — the router needs no memory of it. A
router that falls silent for three heartbeats is treated as gone (a half-open TCP connection
would otherwise hide it). Engines keep running while the router is away; only an agent that is
stopped stops them.

Identity: the first welcome carries the node's credential; the agent saves it (credential.py)
before it sends anything else, and presents it in every later hello. The join token is needed
only until then. A refusal that will not fix itself (a wrong token or credential, a revoked node)
is retried with the longest backoff; one marked `retry` (the node's old connection has not timed
out on the router yet) with the usual one.
"""

from __future__ import annotations

import logging
import math
import os
import random
import shutil
import socket
import ssl
import subprocess
import uuid
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import trio

from llmgw.config import AgentConfig
from llmgw.daemon.agent.credential import load_credential, save_credential
from llmgw.daemon.agent.engines import EngineSupervisor
from llmgw.daemon.agent.kv_subscriber import FLUSH_S, KvSubscribers
from llmgw.daemon.agent.router_tls import RouterTls
from llmgw.daemon.net.message_stream import MessageStream, StreamClosed, open_client
from llmgw.fleet.facts import NVIDIA_SMI_POWER, NVIDIA_SMI_QUERY, parse_meminfo_mb, parse_nvidia_smi, parse_power_draw
from llmgw.fleet.lifecycle import RestartPolicy
from llmgw.fleet.types import EngineReport, GpuInfo, NodeFacts
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
    Refused,
    ReportRejected,
    Welcome,
    WireProtocolError,
    encode,
)

log = logging.getLogger("llmgw.agent")

__all__ = ["Agent", "RouterRefused", "gather_facts"]

WELCOME_TIMEOUT_S = 10.0


class RouterRefused(Exception):
    """The router refused this agent (wrong token or credential, unsupported version ...)."""

    def __init__(self, reason: str, retry: bool = False) -> None:
        super().__init__(reason)
        self.retry = retry


class CredentialNotSaved(Exception):
    """The credential the router issued could not be saved: the session ends before it is used."""


# What ends a session (and is followed by a reconnect), as opposed to a bug.
_SESSION_ERRORS = (StreamClosed, trio.BrokenResourceError, trio.ClosedResourceError, WireProtocolError,
                   trio.TooSlowError, ssl.SSLError, OSError)


async def gather_facts(acfg: AgentConfig) -> NodeFacts:
    from llmgw import __version__

    if acfg.gpus is not None:
        gpus = tuple(GpuInfo(i, g.name, g.memory_mb) for i, g in enumerate(acfg.gpus))
    else:
        gpus = ()
        if shutil.which(NVIDIA_SMI_QUERY[0]):
            try:
                with trio.fail_after(10):
                    done = await trio.run_process(NVIDIA_SMI_QUERY, capture_stdout=True, check=False,
                                                  stderr=subprocess.DEVNULL)
                gpus = parse_nvidia_smi(done.stdout.decode(errors="replace"))
            except (OSError, trio.TooSlowError) as e:
                log.warning("nvidia-smi failed: %s; reporting no GPUs", e)
    memory = acfg.memory_mb
    if memory is None:
        try:
            memory = parse_meminfo_mb(Path("/proc/meminfo").read_text())
        except OSError:
            memory = 0
    return NodeFacts(cpus=os.cpu_count() or 0, memory_mb=memory, gpus=gpus, hostname=socket.gethostname(),
                     agent_version=__version__, declared_watts=acfg.declared_watts,
                     measured_watts=await measure_power() if gpus and acfg.gpus is None else None)


POWER_EVERY_S = 30.0  # the GPUs' power draw is measured this often, and sent with a heartbeat when it changed


async def measure_power() -> float | None:
    """The GPUs' power draw now (nvidia-smi power.draw, summed), for the router's power budgets;
    None where nvidia-smi is missing or cannot say. Taken at the start, then every POWER_EVERY_S
    (the hello carries the latest; a heartbeat carries it when it changed)."""
    if not shutil.which(NVIDIA_SMI_POWER[0]):
        return None
    try:
        with trio.fail_after(10):
            done = await trio.run_process(NVIDIA_SMI_POWER, capture_stdout=True, check=False,
                                          stderr=subprocess.DEVNULL)
    except (OSError, trio.TooSlowError) as e:
        log.warning("nvidia-smi power.draw failed: %s; reporting no measured power", e)
        return None
    return parse_power_draw(done.stdout.decode(errors="replace")[:65536])


class Agent:
    def __init__(self, acfg: AgentConfig, *, router: str, token: str | None, tls: RouterTls | None = None) -> None:
        self.cfg = acfg
        host, _, port = router.rpartition(":")
        self.router_host, self.router_port = host.strip("[]"), int(port)
        self.token = token or ""
        self.tls = tls
        self.credential = load_credential(acfg.state_dir, acfg.node)
        self.agent_id = uuid.uuid4().hex[:12]
        self.facts = NodeFacts()
        self.connected = False
        self.welcomed = False
        self.router_id: str | None = None
        self.supervisor: EngineSupervisor | None = None
        self._ms: MessageStream | None = None
        self._reported = trio.Event()
        self._outbox_send, self._outbox = trio.open_memory_channel[EngineReport](math.inf)
        self._rng = random.Random()
        self.kv = KvSubscribers()  # engines' KV events → mirrors → kv_events up the stream

    def _on_report(self, report: EngineReport) -> None:
        self._reported.set()
        self.kv.on_report(report)
        if self.connected:
            self._outbox_send.send_nowait(report)
        # while disconnected the next hello carries the whole state instead

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        a = self.cfg
        self.facts = await gather_facts(a)
        r = a.restart
        sup = self.supervisor = EngineSupervisor(
            Path(a.state_dir), a.advertise_host, self._on_report,
            policy_factory=partial(RestartPolicy, base_s=r.base_s, max_s=r.max_s,
                                   crashloop_after=r.crashloop_after, window_s=r.window_s),
            grace_s=a.stop_grace_s, log=logging.getLogger("llmgw.engine"))
        adopted = await sup.adopt_leftovers()
        if adopted:
            log.info("adopted %d engines left running by an earlier agent: %s", len(adopted),
                     ", ".join(e.replica for e in adopted))
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(self.kv.run)
                await nursery.start(sup.run)
                if self.facts.gpus and a.gpus is None:
                    nursery.start_soon(self._power_loop)
                if adopted:
                    await self._settle_adopted(sup)
                task_status.started()
                await self._connect_loop()
        finally:
            with trio.CancelScope(shield=True):
                await sup.stop_all()

    async def _settle_adopted(self, sup: EngineSupervisor, limit_s: float = 5.0) -> None:
        """Give adopted engines a moment to answer their health check, so the hello reports them
        ready rather than starting (which would take them out of routing for that moment)."""
        with trio.move_on_after(limit_s):
            while any(r.state == "starting" for r in sup.reports()):
                self._reported = trio.Event()
                await self._reported.wait()

    async def _connect_loop(self) -> None:
        a = self.cfg
        delay = a.reconnect_min_s
        while True:
            self.welcomed = False
            try:
                ms = await open_client(self.router_host, self.router_port,
                                       ssl_context=self.tls.context if self.tls else None,
                                       server_hostname=self.tls.server_name if self.tls else None, accept=FROM_ROUTER)
            except (OSError, ssl.SSLError, trio.BrokenResourceError) as e:
                log.warning("cannot reach the router at %s:%d: %s", self.router_host, self.router_port,
                            _connect_error(e))
            else:
                try:
                    await self._session(ms)
                except RouterRefused as e:
                    if e.retry:
                        log.warning("the router refused this agent for now: %s", e)
                    else:
                        log.error("the router refused this agent: %s", e)
                        delay = a.reconnect_max_s  # a wrong token or credential will not fix itself quickly
                except CredentialNotSaved as e:
                    log.error("%s", e)
                except trio.TooSlowError:
                    log.warning("the router went silent (or sent no welcome); reconnecting")
                except _SESSION_ERRORS as e:
                    if not self.welcomed and self.tls is None \
                            and isinstance(e, StreamClosed | trio.BrokenResourceError | ConnectionError):
                        # Closed before any answer to our hello: a TLS listener drops a plaintext hello.
                        log.warning("the router at %s:%d closed the connection before answering the hello "
                                    "(%s): most likely the router expects TLS (its [control] listen is beyond "
                                    "loopback, or control.tls = true) and this agent dials plain TCP: set agent.tls "
                                    "= true and agent.tls_ca or tls_ca_pem (`llmgw ctl join-info` on the router "
                                    "prints them)", self.router_host, self.router_port, e or type(e).__name__)
                    else:
                        log.warning("connection to the router lost: %s", e or type(e).__name__)
                finally:
                    self.connected = False
                    with trio.CancelScope(shield=True), trio.move_on_after(1):
                        await ms.aclose()
            if self.welcomed:
                delay = a.reconnect_min_s
            await trio.sleep(delay * (0.5 + self._rng.random()))  # jitter: agents must not return in lockstep
            delay = min(delay * 2, a.reconnect_max_s)

    async def _session(self, ms: MessageStream) -> None:
        sup = self.supervisor
        assert sup is not None
        while True:  # reports queued for an earlier connection are covered by the hello
            try:
                self._outbox.receive_nowait()
            except trio.WouldBlock:
                break
        self.connected = True
        reports = tuple(sup.reports())
        hello = Hello(token=self.token, node=self.cfg.node, agent_id=self.agent_id,
                      versions=tuple(sorted(SUPPORTED_VERSIONS)), labels=dict(self.cfg.labels), facts=self.facts,
                      engines=reports, credential=self.credential, features=AGENT_FEATURES)
        resend: tuple[EngineReport, ...] = ()
        if len(encode(hello, 1)) > MAX_HELLO:
            # The router caps a hello's size until it is accepted: send the reports without their
            # log tails and details first, and whole right after the welcome.
            hello = replace(hello, engines=tuple(replace(r, log_tail=(), detail=r.detail[:200]) for r in reports))
            resend = tuple(r for r in reports if r.log_tail or len(r.detail) > 200)
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
                save_credential(self.cfg.state_dir, self.cfg.node, msg.credential)
            except OSError as e:
                raise CredentialNotSaved(f"cannot save the node credential the router issued in "
                                         f"{self.cfg.state_dir}: {e.strerror or e}; reconnecting") from None
            self.credential = msg.credential
            log.info("node %s: joined the router; its credential is saved in the state directory", self.cfg.node)
        for r in resend:
            self._outbox_send.send_nowait(r)
        self.welcomed = True
        if msg.router_id != self.router_id:
            log.info("connected to router %s at %s:%d as node %s", msg.router_id, self.router_host,
                     self.router_port, self.cfg.node)
        self.router_id = msg.router_id
        hb = msg.heartbeat_s
        self._ms = ms
        failed: list[BaseException] = []

        async def guarded(fn: Any) -> None:
            # Kept out of the nursery's exception group: the first failure ends the session
            # and is raised as itself below.
            try:
                await fn()
            except _SESSION_ERRORS as e:
                failed.append(e)
                nursery.cancel_scope.cancel()

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(guarded, partial(self._sender, ms, hb))
                nursery.start_soon(guarded, partial(self._receive, ms, hb, sup))
                if msg.has(FEATURE_KV_EVENTS):  # an older router would close the stream on them
                    self.kv.resend_all()
                    nursery.start_soon(guarded, partial(self._kv_sender, ms))
        finally:
            self._ms = None
            self.connected = False
        if failed:
            raise failed[0]

    async def _receive(self, ms: MessageStream, hb: float, sup: EngineSupervisor) -> None:
        while True:
            with trio.fail_after(max(3 * hb, 2.0)):
                msg = await ms.receive()
            if isinstance(msg, Desired):
                sup.apply(list(msg.engines))
            elif isinstance(msg, ReportRejected):
                log.warning("the router refused the report of engine %s: %s (it treats the engine as failed)",
                            msg.replica, msg.reason)
            elif not isinstance(msg, Heartbeat):
                raise WireProtocolError(f"unexpected {type(msg).TYPE} from the router")

    async def say_bye(self, reason: str = "agent stopping") -> None:
        """Tell the router we are leaving (and stopping our engines), so it takes them out of
        routing at once; best effort, bounded."""
        ms = self._ms
        if ms is None:
            return
        with trio.move_on_after(1):
            try:
                await ms.send(Bye(reason))
            except _SESSION_ERRORS:
                pass

    async def _kv_sender(self, ms: MessageStream) -> None:
        """Every FLUSH_S, the engines' KV block changes (bounded per flush)."""
        while True:
            for m in self.kv.take():
                await ms.send(m)
            await trio.sleep(FLUSH_S)

    async def _sender(self, ms: MessageStream, hb: float) -> None:
        sent_power = self.facts.measured_watts  # the hello carried it
        while True:
            with trio.move_on_after(hb) as cs:
                report = await self._outbox.receive()
            if not cs.cancelled_caught:
                await ms.send(EngineUpdate(report))
                continue
            power = self.facts.measured_watts
            await ms.send(Heartbeat(measured_watts=power if power != sent_power else None))
            sent_power = power

    async def _power_loop(self) -> None:
        """Measure the GPUs' power draw every POWER_EVERY_S (heartbeats carry it when it changed)."""
        while True:
            await trio.sleep(POWER_EVERY_S)
            measured = await measure_power()
            if measured is not None:
                self.facts = replace(self.facts, measured_watts=measured)


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
