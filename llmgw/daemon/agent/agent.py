"""The agent: one per node. It learns the node's facts, dials its router, says hello with its full
state, and then runs what the leading router's `desired` sets say, reporting every engine's changes.

Each router's session is a :class:`~llmgw.daemon.agent.router_links.RouterLink`, the agent's to
keep (it reconnects with its own backoff). Engines keep running while routers are away; only an
agent that is stopped stops them.

Identity: the first welcome carries the node's credential; the agent saves it (credential.py)
before it sends anything else, and presents it in every later hello — at every router, since
they share the store. The join token is needed only until then.

Several routers (docs/architecture.md, "Several routers"): once welcomed, the agent dials every
router the routers list (welcome, `routers` messages), each with the TLS pin the list gives;
engine updates, heartbeats and KV events go to every live session. A `desired` is applied only
when its epoch is at least the highest any router has spoken of; an older one is a deposed
leader's, ignored (logged once per router and epoch, counted in `stale_desired`). A router
absent from every live router's list for `drop_after_s` is dropped — never the configured one.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import ssl
import subprocess
import uuid
from dataclasses import replace
from functools import partial
from pathlib import Path

import trio

from llmgw.config import AgentConfig
from llmgw.daemon.agent.credential import load_credential
from llmgw.daemon.agent.engines import EngineSupervisor
from llmgw.daemon.agent.kv_subscriber import FLUSH_S, MAX_MESSAGES_PER_FLUSH, KvSubscribers
from llmgw.daemon.agent.router_links import RouterLink, RouterRefused
from llmgw.daemon.agent.router_tls import RouterTls, listed_tls
from llmgw.fleet.facts import NVIDIA_SMI_POWER, NVIDIA_SMI_QUERY, parse_meminfo_mb, parse_nvidia_smi, parse_power_draw
from llmgw.fleet.lifecycle import RestartPolicy
from llmgw.fleet.types import EngineReport, GpuInfo, NodeFacts, RouterAddr
from llmgw.fleet.wire import Desired

log = logging.getLogger("llmgw.agent")

__all__ = ["Agent", "RouterRefused", "gather_facts"]

DROP_AFTER_S = 30.0  # a router absent from every live router's list this long is dropped
KV_STALL_S = 10.0  # a session that takes no KV events for this long is restarted (the others go on)


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
    def __init__(self, acfg: AgentConfig, *, router: str, token: str | None, tls: RouterTls | None = None,
                 drop_after_s: float = DROP_AFTER_S, more_routers: tuple[str, ...] = ()) -> None:
        """`router`: the router to dial first; `more_routers` (`[agent] routers`): others of the same
        fleet dialed from the start too, with the same TLS settings, never dropped."""
        self.cfg = acfg
        self.token = token or ""
        self.credential = load_credential(acfg.state_dir, acfg.node)
        self.agent_id = uuid.uuid4().hex[:12]
        self.facts = NodeFacts()
        self.supervisor: EngineSupervisor | None = None
        self.drop_after_s = drop_after_s
        self.configured = RouterLink(self, router, tls, configured=True)
        self.links: dict[str, RouterLink] = {router: self.configured}  # control address -> its session
        for addr in more_routers:
            if addr not in self.links:
                self.links[addr] = RouterLink(self, addr, tls, configured=True)
        self.epoch = 0  # the highest leadership epoch a router has spoken of
        self._epoch_heard_at = 0.0  # when a live router last spoke of it (see _forget_epoch)
        self.stale_desired = 0  # desired sets ignored: a deposed leader's (older epoch)
        self._stale_logged: set[tuple[str, int]] = set()
        self._bad_pins: set[str] = set()
        self._nursery: trio.Nursery | None = None
        self._reported = trio.Event()
        self.kv = KvSubscribers()  # engines' KV events → mirrors → kv_events up every stream

    def _on_report(self, report: EngineReport) -> None:
        self._reported.set()
        self.kv.on_report(report)
        for link in self.links.values():
            link.queue_report(report)

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
                self._nursery = nursery
                nursery.start_soon(self._kv_pump)
                nursery.start_soon(self._watch_routers)
                for link in [x for x in self.links.values() if x.configured and x is not self.configured]:
                    nursery.start_soon(link.run)
                await self.configured.run()
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

    # -- what the routers say (router_links.py calls these) ----------------------------------------
    def heard_routers(self, link: RouterLink, epoch: int, leading: bool, routers: tuple[RouterAddr, ...]) -> None:
        """A welcome or `routers` message: the epoch it knows, whether it leads, the live routers."""
        if leading and (not link.leading or epoch != link.epoch) and epoch:
            log.info("router %s at %s leads (epoch %d)", link.router_id, link.address, epoch)
        link.epoch, link.leading, link.listed = epoch, leading, routers
        self._heard_epoch(epoch)
        self._one_session_each(link)
        self._dial_listed()

    def desired(self, link: RouterLink, msg: Desired) -> None:
        if msg.epoch < self.epoch:
            self.stale_desired += 1
            if (link.address, msg.epoch) not in self._stale_logged:
                if len(self._stale_logged) > 1024:
                    self._stale_logged.clear()
                self._stale_logged.add((link.address, msg.epoch))
                log.warning("router %s at %s sent a desired set of epoch %d, but a router spoke of epoch %d: "
                            "ignored (a deposed leader's)", link.router_id, link.address, msg.epoch, self.epoch)
            return
        link.epoch = max(link.epoch, msg.epoch)
        self._heard_epoch(msg.epoch)
        assert self.supervisor is not None
        self.supervisor.apply(list(msg.engines))

    def _heard_epoch(self, epoch: int) -> None:
        if epoch >= self.epoch:
            self.epoch = epoch
            self._epoch_heard_at = trio.current_time()

    # -- the set of routers ------------------------------------------------------------------------
    def _is_linked(self, r: RouterAddr) -> bool:
        return r.control in self.links or any(link.router_id == r.id for link in self.links.values())

    def _one_session_each(self, link: RouterLink) -> None:
        """A router reached at two addresses (the configured one and the one it advertises, say, after
        it restarted under a new id): one session is kept — the configured router's, else the first."""
        for other in list(self.links.values()):
            if other is link or other.router_id is None or other.router_id != link.router_id:
                continue
            dup = link if not link.configured else other
            log.info("router %s is reachable at %s and %s: keeping the session with %s", link.router_id,
                     other.address, link.address, (other if dup is link else link).address)
            self._drop(dup)
            return

    def _drop(self, link: RouterLink) -> None:
        if self.links.get(link.address) is link:
            del self.links[link.address]
        link.scope.cancel()

    def _dial_listed(self) -> None:
        """Start a session with every listed router the agent has none with."""
        if self._nursery is None:
            return
        for link in list(self.links.values()):
            for r in link.listed if link.live else ():
                if self._is_linked(r):
                    continue
                try:
                    tls = listed_tls(self.cfg, r)
                except (OSError, ssl.SSLError, ValueError) as e:
                    if r.control not in self._bad_pins:
                        self._bad_pins.add(r.control)
                        log.error("router %s at %s: its listed TLS pin cannot be used (%s); not dialing it", r.id,
                                  r.control, e)
                    continue
                log.info("router %s at %s (listed by router %s): dialing it", r.id, r.control, link.router_id)
                new = self.links[r.control] = RouterLink(self, r.control, tls, configured=False)
                self._nursery.start_soon(new.run)

    async def _watch_routers(self) -> None:
        while True:
            await trio.sleep(min(1.0, self.drop_after_s / 4))
            self._drop_unlisted(trio.current_time())

    def _drop_unlisted(self, now: float) -> None:
        """Drop the routers no live router lists any more (for drop_after_s), and forget an epoch no
        live router has spoken of for as long. Nothing changes while no router is live: no one to ask."""
        live = [link for link in self.links.values() if link.live]
        if not live:
            return
        addrs = {r.control for link in live for r in link.listed}
        ids = {r.id for link in live for r in link.listed}
        for link in [link for link in self.links.values() if not link.configured]:
            if link.address in addrs or (link.router_id is not None and link.router_id in ids):
                link.unlisted_since = None
            elif link.unlisted_since is None:
                link.unlisted_since = now
            elif now - link.unlisted_since >= self.drop_after_s:
                log.info("router %s at %s: no router has listed it for %.0fs; dropped", link.router_id,
                         link.address, now - link.unlisted_since)
                self._drop(link)
        self._forget_epoch(live, now)

    def _forget_epoch(self, live: list[RouterLink], now: float) -> None:
        """A store whose lease was reset (a migration, a new store) starts epochs from 1 again: once
        no live router has spoken of the agent's highest epoch for drop_after_s, it follows the
        highest a live router speaks of. (A deposed leader learns it within its own lease, far
        sooner: it sends no desired set meanwhile.)"""
        highest = max(link.epoch for link in live)
        if highest >= self.epoch:
            self._epoch_heard_at = now
        elif now - self._epoch_heard_at >= self.drop_after_s:
            log.warning("no live router has spoken of epoch %d for %.0fs; following epoch %d (was the store's "
                        "leadership reset?)", self.epoch, now - self._epoch_heard_at, highest)
            self.epoch, self._epoch_heard_at = highest, now

    # -- what goes to every router -----------------------------------------------------------------
    async def _kv_pump(self) -> None:
        """Every FLUSH_S, the engines' KV block changes (bounded per flush) to every session that takes
        them. A session behind by more than a flush holds the flush back (the mirrors keep the net
        changes meanwhile); one behind for KV_STALL_S is restarted, and the others go on."""
        while True:
            await trio.sleep(FLUSH_S)
            live = [link for link in self.links.values() if link.kv_live]
            now = trio.current_time()
            behind = False
            for link in live:
                if link.kv_backlog() <= MAX_MESSAGES_PER_FLUSH:
                    link.kv_behind_since = None
                elif link.kv_behind_since is None:
                    link.kv_behind_since, behind = now, True
                elif now - link.kv_behind_since >= KV_STALL_S:
                    link.end_session(f"took no KV events for {KV_STALL_S:.0f}s")
                else:
                    behind = True
            if live and not behind:
                for m in self.kv.take():
                    for link in live:
                        link.queue_kv(m)

    async def say_bye(self, reason: str = "agent stopping") -> None:
        """Tell every router we are leaving (and stopping our engines), so they take them out of
        routing at once; best effort, bounded."""
        with trio.move_on_after(1):
            async with trio.open_nursery() as nursery:
                for link in list(self.links.values()):
                    nursery.start_soon(link.say_bye, reason)

    async def _power_loop(self) -> None:
        """Measure the GPUs' power draw every POWER_EVERY_S (heartbeats carry it when it changed)."""
        while True:
            await trio.sleep(POWER_EVERY_S)
            measured = await measure_power()
            if measured is not None:
                self.facts = replace(self.facts, measured_watts=measured)
