"""The router's control plane: models, the node registry, reconciliation, the store, and the
replicas it routes in and out of the router's scheduler; the admin API's views of all that.

Agents dial in (docs/architecture.md has the protocol; their sessions are agents/sessions.py) and
report their engines. A reconcile loop applies the node timeouts, asks the pure reconciler for a
plan, writes it to the store, pushes each changed node its desired set, and moves replicas in and
out of the scheduler (through the router's control port) as their engines report ready or stop.
Draining replicas take no new requests and stop when their last request ends (or at
`drain_timeout_s`).

Every store call goes through a StoreGuard (store/guard.py): a store that cannot write leaves the
plane running from memory, and the whole state is written back when it can. The plane loads its
state from the store at start (store/state.py: a store it cannot read stops the daemon there with
what to do), routes the replicas whose engines still answer before their agents are back
(`restore_routing`), and keeps engines the store does not know running (plane/unknown_engines.py) —
or adopts them, with `--adopt`.
"""

from __future__ import annotations

import logging
import secrets
import ssl
import time
import uuid
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import trio

from llmgw import __version__
from llmgw.admin.schema import ModelView, NodeView, ReplicaView, Status
from llmgw.config import (
    Config,
    DeployConfig,
    ModelConfig,
)
from llmgw.daemon.control.agents.sessions import AgentSessions
from llmgw.daemon.control.autoscaling import Autoscaling
from llmgw.daemon.control.plane.config_reload import load_models, reconcile_file
from llmgw.daemon.control.plane.facility import FacilityControl
from llmgw.daemon.control.plane.leading import Leading
from llmgw.daemon.control.plane.groups import head_of, head_startable, routable_group, stop_workers, sync_head
from llmgw.daemon.control.lifecycle.lifecycle import Lifecycle
from llmgw.daemon.control.model_deploy import ModelError, deploy_of
from llmgw.daemon.control.plane.actions import OperatorActions
from llmgw.daemon.control.plane.views import model_views, node_views, replica_views
from llmgw.daemon.control.plane.restore import restore_routing
from llmgw.daemon.control.store.port import FleetStore
from llmgw.daemon.control.store.rows import AssignmentRow
from llmgw.daemon.control.store.guard import StoreGuard
from llmgw.daemon.control.tenants import TenantsManager
from llmgw.daemon.control.store.state import read_state, write_state
from llmgw.daemon.control.plane.unknown_engines import UnknownEngines, adopt
from llmgw.daemon.router.control_port import RouterPort
from llmgw.fleet.engine_cmd import ray_group
from llmgw.fleet.nodes import Node, NodeRegistry, NodeTimeouts, Transition
from llmgw.fleet.reconcile import Assignment, ModelDeploy, reconcile
from llmgw.fleet.types import KV_FOLLOWED_STATES, EngineReport, EngineSpec
from llmgw.config.names import CANDIDATE_SUFFIX
from llmgw.fleet.wire import FEATURE_GROUPS, Hello, KvEvents, Skipped
from llmgw.lifecycle.config_diff import ScaleOverride

if TYPE_CHECKING:
    from llmgw.daemon.net.upstream import UpstreamPool

log = logging.getLogger("llmgw.control")

__all__ = ["ControlPlane", "ModelError", "deploy_of"]


class ControlPlane(Leading):
    """The fleet's control plane; its side of several routers on one store is `Leading`'s (plane/leading.py)."""

    def __init__(self, cfg: Config, store: FleetStore, router: RouterPort, *, token: str | None,
                 settle_s: float | None = None, adopt: bool = False, fresh_store: bool = False,
                 shared: bool = False) -> None:
        """`adopt`: engines the store does not know are adopted (`llmgw daemon --adopt`);
        `fresh_store`: the store was created at this start (said in the warnings about them);
        `shared`: other routers share the store (docs/ha.md) — the plane starts as a follower and
        writes nothing of the fleet's until it leads (daemon/control/leader.py)."""
        self.cfg = cfg
        c = cfg.control
        self.store = store
        self.guard = StoreGuard(store)  # every store call goes through it
        self.shared = shared  # other routers share the store: it leads only once elected (plane/leading.py)
        self.guard.active = not shared
        self.adopt = adopt
        self.fresh_store = fresh_store
        self.unknown = UnknownEngines(self.guard)
        self.facility = FacilityControl(cfg.facility, self.guard, store)  # holds, budgets, rebalancing
        self.urls: dict[str, str] = {}  # replica -> where its engine last answered ready (kept in the store)
        self._seen_wall: dict[str, float] = {}  # node -> wall time of its last hello in this run
        self._unloadable: dict[str, dict[str, Any]] = {}  # stored models this llmgw cannot load, as stored
        self.router = router
        self.router_id = uuid.uuid4().hex[:12]
        if shared:  # epoch 0 is no lease's: any fenced write that got past the guard is refused too
            store.set_fence(self.router_id, 0)
        self.nodes = NodeRegistry(NodeTimeouts(c.not_ready_after_s, c.lost_after_s, c.max_lost_fraction,
                                               c.partition_lost_interval_s), trio.current_time())
        self.models: dict[str, ModelConfig] = {}
        self.scale_overrides: dict[str, ScaleOverride] = {}  # operators' scales of config-file models
        self.sources: dict[str, str] = {}  # model -> "config" | "api" | "adopted"
        self.deploys: dict[str, ModelDeploy] = {}
        self.assignments: dict[str, Assignment] = {}
        self.unplaceable: dict[str, str] = {}
        self.group_nodes: set[str] = set()  # nodes whose agents run multi-node parts (FEATURE_GROUPS)
        self.told_workers: dict[str, tuple[int | None, ...]] = {}  # multi-node heads: plane/groups.py
        self.agents = AgentSessions(self, c, token)
        self.agents.identities.shared = shared  # nodes join and are revoked at any router sharing the store
        self._wake = trio.Event()
        self._partition_logged: dict[str, str] = {}
        self.port: int | None = None
        self._started = trio.current_time()
        # Placing before the fleet has joined would stack every replica on the first agent in.
        self._settle_until = self._started + (c.settle_s if settle_s is None else settle_s)
        self._reconciles = 0
        self.lifecycle = Lifecycle(self)  # revisions, eval suites and results, jobs (lifecycle/lifecycle.py)
        self.actions = OperatorActions(self)  # what an operator asks of it (plane/actions.py)
        self.tenants = TenantsManager(self)  # tenants and API keys, the router's TenantBook (control/tenants.py)
        self.autoscaling = Autoscaling(self)  # autoscaled models' counts in force (control/autoscaling.py)
        self.reloader: Any = None  # the config file's check and reload (plane/config_reload.py), set by the daemon
        # Several routers on one store (docs/ha.md): daemon/control/leader.py, set by the daemon before
        # the plane runs; None: this router alone, always the leader.
        self.leadership: Any = None
        self.heard: dict[str, tuple[str, EngineReport]] = {}  # replica -> (node, its agent's latest report)
        self.followed_generation = -1  # the store's generation a follower last applied (plane/follow.py)
        self._load()
        self.guard.rewrite = self._rewrite
        self._from_store = {n for n, node in self.nodes.nodes.items() if not node.connected}

    # -- startup ------------------------------------------------------------------------------
    def _load(self) -> None:
        """The state from the store (read_state raises StoreCorrupt for one it cannot read), then the
        config file's models reconciled with it by the reload's rule (plane/config_reload.py)."""
        stored = read_state(self.store)
        load_models(self, stored.models)  # the store's, and the file's new ones (plane/config_reload.py)
        now = trio.current_time()
        for name, row in stored.nodes.items():
            self.nodes.remember(name, agent_labels=row.agent_labels, operator_labels=row.operator_labels,
                                facts=row.facts, now=now)
        for rid, row in stored.assignments.items():
            self.assignments[rid] = Assignment(rid, row.model, row.node, row.spec, row.demand, desired=row.desired,
                                               created_at=row.created_at,
                                               drain_since=now if row.desired == "drain" else None)
            if row.url:
                self.urls[rid] = row.url
        if self.assignments:
            log.info("store: %d models, %d nodes, %d assignments; waiting for agents to reconnect",
                     len(self.models), len(self.nodes.nodes), len(self.assignments))
        self.lifecycle.load()
        self.tenants.load()
        self.autoscaling.load(self.store.docs("autoscale"))
        reconcile_file(self)  # the file's models against those stored (docs/configuration.md)

    def _rewrite(self, st: FleetStore) -> None:
        """The whole state from memory into `st` (the StoreGuard's recovery, in one transaction)."""
        models = {n: self.actions.model_record(n, m, self.sources.get(n, "api")) for n, m in self.models.items()}
        write_state(st, models={**self._unloadable, **models}, nodes=self.nodes.nodes, seen_wall=self._seen_wall,
                    assignments={rid: self._row(a) for rid, a in self.assignments.items()})
        self.lifecycle.rewrite(st)
        self.tenants.rewrite(st)
        self.autoscaling.rewrite(st)

    def _set_model(self, m: ModelConfig, source: str) -> None:
        self.models[m.name] = m
        self.sources[m.name] = source
        dep = self.autoscaling.adjust(m, deploy_of(m))  # an autoscaled model's count in force
        if dep is None:
            self.deploys.pop(m.name, None)
        else:
            self.deploys[m.name] = dep
        self.router.define_model(m)
        self.lifecycle.say_revisions(m.name)  # the revision id its requests' traces carry

    async def restore_routing(self, pool: UpstreamPool) -> int:
        """Route the stored replicas whose engines still serve, before any agent is back (plane/restore.py);
        call it before the control listener opens. Answers how many were routed."""
        return await restore_routing(pool, self.assignments, self.urls, lambda a, r: self._on_report(a.node, r))

    # -- serving agents ------------------------------------------------------------------------
    async def serve(self, host: str, port: int, *, ssl_context: ssl.SSLContext | None = None,
                    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """The agents' listener (each connection a session: self.agents) and the reconcile loop."""
        listeners = await trio.open_tcp_listeners(port, host=host)
        self.port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._reconcile_loop)
            nursery.start_soon(self.autoscaling.run)
            await nursery.start(trio.serve_listeners, lambda s: self.agents.serve_agent(s, ssl_context), listeners)
            task_status.started(self.port)

    # -- what the agents' sessions tell us (the SessionHost of agents/sessions.py) ----------------
    def agent_joined(self, hello: Hello, peer: str) -> Node:
        node = hello.node
        now = trio.current_time()
        self._transitions(self.nodes.connected(node, hello.agent_id, labels=hello.labels, facts=hello.facts,
                                               now=now))
        n = self.nodes.nodes[node]
        if hello.has(FEATURE_GROUPS):
            self.group_nodes.add(node)
        else:
            self.group_nodes.discard(node)
        self._seen_wall[node] = time.time()
        self.guard.write("upsert_node", node, agent_labels=hello.labels, facts=hello.facts.to_wire(),
                         seen_at=self._seen_wall[node])
        log.info("node %s joined from %s (agent %s, %d engines)", node, peer, hello.agent_id, len(hello.engines))
        for rid in [rid for rid, (n, _) in self.heard.items() if n == node]:
            del self.heard[rid]
        for r in hello.engines:
            self.heard[r.replica] = (node, r)
        # The hello is the agent's whole truth: what it does not mention, it does not run.
        reported = {r.replica for r in hello.engines}
        for a in [a for a in self.assignments.values() if a.node == node and a.replica not in reported]:
            self._on_report(node, None, a)
        self.unknown.node_gone(node, keep=reported)
        for r in hello.engines:
            self._on_report(node, r)
            self.router.kv_session_started(r.replica)  # its mirror comes again as a reset: no lost events
        self.unknown.warn(node, self.fresh_store)
        return n

    def agent_heard(self, node: str, agent_id: str) -> None:
        self._transitions(self.nodes.heard(node, agent_id, trio.current_time()))

    def power_measured(self, node: str, watts: float) -> None:
        n = self.nodes.nodes.get(node)
        if n is not None:  # for placement's power budgets; kept in memory (the next hello carries it too)
            n.facts = replace(n.facts, measured_watts=watts)

    def engine_reported(self, node: str, report: EngineReport) -> None:
        self.heard[report.replica] = (node, report)
        self._on_report(node, report)
        self._wake.set()

    def agent_left(self, node: str) -> None:
        # A leaving agent stops its engines: out of routing now, not after failed requests.
        for rid in [rid for rid, (n, _) in self.heard.items() if n == node]:
            del self.heard[rid]
        for a in [a for a in self.assignments.values() if a.node == node]:
            self._on_report(node, None, a)
        self.unknown.node_gone(node)

    def knows_node(self, node: str) -> bool:
        return node in self.nodes.nodes

    def kv_refusal(self, node: str, replica: str) -> str | None:
        """Why `node` may not write `replica`'s KV index ("unknown_replica", "other_node"), or None."""
        a = self.assignments.get(replica)
        if a is None and not self.leading() and self.heard.get(replica, ("",))[0] == node:
            return None  # a follower: the node runs it; its assignment has not reached this router yet
        return None if a is not None and a.node == node else "unknown_replica" if a is None else "other_node"

    def kv_events(self, node: str, msg: KvEvents) -> bool:
        """An agent's kv_events: applied only for a replica assigned to `node` (an agent never
        writes another node's replicas); refused and counted otherwise (False)."""
        if (why := self.kv_refusal(node, msg.replica)) is not None:
            self.router.kv_refused(why)
            return False
        self.router.kv_events(msg)
        return True

    def kv_skipped(self, node: str, sk: Skipped) -> None:
        """A kv_events message the session's gate turned away undecoded: refused (not the node's
        replica) or dropped (over the node's event budget)."""
        if sk.why == "budget":
            self.router.kv_dropped(sk.replica if sk.replica and self.kv_refusal(node, sk.replica) is None else None,
                                  sk.blocks)
        else:
            self.router.kv_refused(sk.why)

    def agent_disconnected(self, n: Node, agent_id: str, reason: str) -> None:
        # Its engines' events stop with the stream: their index is dropped (the agent's next
        # session starts with a full copy) rather than kept and silently aging.
        for a in self.assignments.values():
            if a.node == n.name:
                self.router.kv_forget(a.replica)
        self._transitions(self.nodes.disconnected(n.name, agent_id, reason, trio.current_time()))
        if n.state != "ready":
            log.info("node %s disconnected: %s", n.name, reason)
        self._wake.set()

    def node_revoked(self, node: str) -> list[str]:
        """An operator revoked the node (agents/sessions.py cut its connection): its replicas leave
        routing now and are placed elsewhere at the next reconcile; the node is forgotten."""
        mine = [a for a in self.assignments.values() if a.node == node]
        for a in mine:
            self._on_report(node, None, a)
        self.nodes.forget(node)
        self.store.delete_node(node)
        self.store.record("node revoked", node=node, detail=f"{len(mine)} replicas withdrawn")
        self._wake.set()
        return sorted(a.replica for a in mine)

    def desired_for(self, node: str) -> list[EngineSpec]:
        """What `node` should run: its session sends this as the node's desired set. Engines the
        store does not know are in it too, so that the agent leaves them running."""
        mine = [a.spec for a in self.assignments.values()
                if a.node == node and a.desired in ("run", "drain") and head_startable(a)]
        return mine + self.unknown.specs_for(node)

    # -- engine reports → scheduler ------------------------------------------------------------
    def _on_report(self, node: str, report: EngineReport | None, a: Assignment | None = None) -> None:
        if a is None:
            assert report is not None
            a = self.assignments.get(report.replica)
            if a is None:
                if not self.leading():
                    return  # a follower: the assignment may not have reached it yet (self.heard keeps the report)
                if self.adopt and adopt(self, node, report):
                    return
                new = report.replica not in self.unknown.engines
                if self.unknown.report(node, report) and new:
                    self.agents.push(node)  # kept: in the node's desired set from now on
                return  # removed by the router: its absence from `desired` makes the agent stop it
            if a.node != node:
                return  # not ours (any more): its absence from `desired` makes the agent stop it
        old = a.engine_state
        a.report = report
        new = a.engine_state
        if old != new:
            detail = report.detail if report else "not running on the node"
            level = logging.WARNING if new in ("crashed", "failed", "crashloop") else logging.INFO
            log.log(level, "replica %s on %s: %s → %s%s", a.replica, node, old, new,
                    f" ({detail})" if detail else "")
            self.guard.record(f"engine {new}", replica=a.replica, model=a.model, node=node, detail=detail)
            if new == "ready":
                self.autoscaling.engine_ready(a.model, a.created_at)  # its cold start, measured
        if report is not None and report.state == "ready" and report.url and self.urls.get(a.replica) != report.url:
            self.urls[a.replica] = report.url  # where a restarted router finds it (restore_routing)
            self.guard.write("put_assignment", self._row(a))
        self._route(a)
        if a.desired == "stop" and (report is None or report.state == "stopped"):
            self._forget(a, "stopped")

    def _route(self, a: Assignment) -> None:
        if a.spec.is_worker:  # never routed; its head is, while the whole group is ready
            head = head_of(self, a)
            if head is not None:
                sync_head(self, head)
                self._route(head)
            return
        if ray_group(a.spec):
            sync_head(self, a)  # a vLLM head's Ray port: its workers are told it (plane/groups.py)
        r = a.report
        m = self.models.get(a.model) or self.lifecycle.router_model(a.model)  # a candidate's: lifecycle/lifecycle.py
        routable = (r is not None and r.state == "ready" and r.url and m is not None
                    and a.desired in ("run", "drain") and self.nodes.nodes.get(a.node) is not None
                    and self.nodes.nodes[a.node].state != "lost"
                    and (a.spec.group is None or routable_group(self, a)))
        if not routable:
            self.router.withdraw_replica(a.replica)
            if r is None or r.state not in KV_FOLLOWED_STATES:
                # its agent no longer follows its KV events; one that does (an unhealthy engine, a
                # group waiting for a worker) sends only changes: its index is kept for its return
                self.router.kv_forget(a.replica)
            return
        if a.desired == "run":
            d = m.deploy or DeployConfig()  # type: ignore[union-attr]
            self.router.add_replica(m, a.replica, r.url, pool=d.pool, weight=d.weight,  # type: ignore[arg-type]
                                    node=a.node, role=a.spec.role or "both")  # a prefill/decode group's role
        else:
            self.router.drain_replica(a.replica)

    def _forget(self, a: Assignment, why: str) -> None:
        self.assignments.pop(a.replica, None)
        self.told_workers.pop(a.replica, None)
        self.router.kv_forget(a.replica)
        self.urls.pop(a.replica, None)
        self.facility.placed.pop(a.replica, None)
        self.unknown.removed(a.replica)
        self.router.withdraw_replica(a.replica)
        self.guard.write("delete_assignment", a.replica)
        self.guard.record("replica removed", replica=a.replica, model=a.model, node=a.node, detail=why)
        if a.model not in self.models and not any(x.model == a.model for x in self.assignments.values()):
            self.router.forget_model(a.model)

    # -- reconciliation ------------------------------------------------------------------------
    def _transitions(self, ts: list[Transition]) -> None:
        for t in ts:
            level = logging.WARNING if t.new == "lost" else logging.INFO
            log.log(level, "node %s: %s → %s (%s)", t.node, t.old or "new", t.new, t.reason)
            self.guard.record(f"node {t.new}", node=t.node, detail=t.reason)
            if t.new == "lost":
                self.unknown.node_gone(t.node)
            # Not ready changes no routing: the data path to its engines does not go through the agent.
            if t.new == "lost" or t.old == "lost":
                self._wake.set()

    async def _reconcile_loop(self) -> None:
        period = min(1.0, self.cfg.control.heartbeat_s)
        while True:
            try:
                self.reconcile_once()
            except Exception:
                log.exception("reconcile failed; retrying")
            with trio.move_on_after(period):
                await self._wake.wait()
            self._wake = trio.Event()

    def reconcile_once(self) -> None:
        now = trio.current_time()
        self._transitions(self.nodes.tick(now, {a.node for a in self.assignments.values()}))
        if not self.leading():
            return  # a follower: its views' node states are its own, its decisions the leader's
        self._log_partition()
        if now < self._settle_until:
            known = [self.nodes.nodes[n] for n in self._from_store if n in self.nodes.nodes]
            if not known or not all(n.connected for n in known):
                return
            self._settle_until = now  # every node we knew is back: no reason to wait longer
        nodes = self.nodes.nodes
        held = self.unknown.held_nodes()
        if held:  # engines outside placement's books run there: place nothing new on them
            nodes = {name: replace(n, state="not_ready") if name in held and n.state == "ready" else n
                     for name, n in nodes.items()}
        plan = reconcile(self.deploys, nodes, list(self.assignments.values()),
                         new_id=self._new_id, now_wall=time.time(), facility=self.facility.round(now),
                         group_nodes=self.group_nodes)
        self.facility.warn(plan.warnings)
        drain_timeout = self.cfg.control.drain_timeout_s
        with self.guard.transaction("reconcile"):
            for rid, why in plan.lost:
                a = self.assignments.get(rid)
                if a is not None:
                    log.warning("replica %s of %s written off: %s", rid, a.model, why)
                    self._forget(a, f"lost: {why}")
                    self.agents.push(a.node)  # a multi-node part on a live node: its agent stops it
            if plan.create:  # the verdicts as they stand now, kept beside each new replica (plane/facility.py)
                self.facility.record_placements(plan.create, nodes, self.assignments.values(), self.deploys,
                                                time.time())
            for a in plan.create:
                self.assignments[a.replica] = a
                self.guard.write("put_assignment", self._row(a))
                self.guard.record("replica placed", replica=a.replica, model=a.model, node=a.node,
                                  detail=f"gpus {list(a.spec.gpu_indices)}" if a.spec.gpu_indices else "")
                log.info("replica %s of %s placed on %s", a.replica, a.model, a.node)
                self.agents.push(a.node)
            for rid, why in plan.moving:  # surge first: each drains once its replacement is ready
                a = self.assignments[rid]
                a.moving = why
                self.guard.record("replica moving", replica=rid, model=a.model, node=a.node, detail=why)
                log.info("replica %s of %s on %s moves: %s", rid, a.model, a.node, why)
            for rid, why in plan.drain:
                a = self.assignments[rid]
                a.desired, a.drain_since, a.reason = "drain", now, why
                self.guard.write("set_desired", rid, "drain")
                self.guard.record("replica draining", replica=rid, model=a.model, node=a.node, detail=why)
                self._route(a)
            for a in [a for a in self.assignments.values() if a.desired == "drain" and not a.spec.is_worker]:
                st = self.router.replica_state(a.replica)
                idle = st is None or st.inflight == 0
                if idle or now - (a.drain_since or now) >= drain_timeout:
                    a.desired = "stop"
                    self.guard.write("set_desired", a.replica, "stop")
                    self.router.withdraw_replica(a.replica)
                    self.agents.push(a.node)
                    stop_workers(self, a)
            for a in [a for a in self.assignments.values() if a.desired == "stop"]:
                n = self.nodes.nodes.get(a.node)
                if n is not None and n.connected and (a.report is None or a.report.state == "stopped"):
                    self._forget(a, a.reason or "stopped")
        self._reconciles += 1
        if self._reconciles % 3600 == 0:
            self.guard.write("prune_history")
        # Until the agents had a chance to reconnect, "cannot be placed" is only noise.
        settled = now - self._started >= max(self.cfg.control.not_ready_after_s, self.cfg.control.settle_s)
        if held:
            note = (f"; {len(held)} node{'s' if len(held) > 1 else ''} held (running engines the store does not "
                    "know; see llmgw ctl status)")
            plan.unplaceable = {name: why + note for name, why in plan.unplaceable.items()}
        for name, why in plan.unplaceable.items():
            if settled and self.unplaceable.get(name) != why:
                log.warning("model %s: %s", name, why)
                self.guard.record("unplaceable", model=name, detail=why)
        self.unplaceable = plan.unplaceable if settled else {}
        self.lifecycle.tick()

    def _log_partition(self) -> None:
        """Say when the partition guard starts or stops holding a failure domain's losses back."""
        now, before = self.nodes.disrupted, self._partition_logged
        if now == before:
            return
        cut_off = self.nodes.cut_off
        for d in sorted(now.keys() - before.keys()):
            if cut_off:
                log.warning("partition guard: domain %s: %s — suspecting the router's own network; no node is "
                            "declared lost until one answers", d or "(no facility labels)", now[d])
            else:
                log.warning("partition guard: domain %s: %s — suspecting the router's own network; its nodes are "
                            "declared lost at most one per %.0fs (control.partition_lost_interval_s)",
                            d or "(no facility labels)", now[d], self.cfg.control.partition_lost_interval_s)
        for d in sorted(before.keys() - now.keys()):
            log.info("partition guard: domain %s: enough nodes are back; node timeouts apply again",
                     d or "(no facility labels)")
        self._partition_logged = dict(now)

    def _new_id(self, model: str) -> str:
        model = model.removesuffix(CANDIDATE_SUFFIX)  # a candidate's replica keeps its id when promoted
        while True:
            rid = f"{model}/{secrets.token_hex(3)}"
            if rid not in self.assignments:
                return rid

    def _row(self, a: Assignment) -> AssignmentRow:
        spec = a.spec.to_wire()
        spec["demand"] = a.demand.to_wire()
        return AssignmentRow(replica=a.replica, model=a.model, node=a.node, spec=spec, desired=a.desired,
                             created_at=a.created_at, updated_at=time.time(), url=self.urls.get(a.replica))

    # -- views (plane/views.py) -------------------------------------------------------------------
    def node_views(self) -> list[NodeView]:
        return node_views(self.nodes.nodes.values(), self.assignments.values(), trio.current_time(),
                          held=self.facility.held_domains)

    def replica_views(self) -> list[ReplicaView]:
        return replica_views(self.assignments.values(), self.router)

    def model_views(self) -> list[ModelView]:
        return model_views(self.models, self.sources, self.assignments.values(), self.unplaceable)

    def summary(self) -> Status:
        states: dict[str, int] = {}
        for n in self.nodes.nodes.values():
            states[n.state] = states.get(n.state, 0) + 1
        return Status(version=__version__, router_id=self.router_id, nodes=states,
                      assignments=len(self.assignments), partition_suspected=self.nodes.partition_suspected,
                      control_port=self.port, unplaceable=dict(self.unplaceable), store=self.guard.status(),
                      unknown_engines=self.unknown.by_node(), adopt=self.adopt,
                      kv_parity_alarms={r.replica: r.model for r in self.router.kv_summary().replicas
                                        if r.parity.status == "alarm"}, **self._ha_summary())

