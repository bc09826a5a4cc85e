"""A follower's control plane: its memory made what the store says (docs/ha.md).

Several routers share one store; one leads (places, reconciles, sends agents their desired sets)
and writes the fleet's state; the others follow it. A follower keeps its own agents' sessions —
every agent streams to every router — and routes what the store's assignments say is wanted and
its agents report ready. When the store's `generation` changes (any committed write of the
leader) the follower reads the whole state (`read_snapshot`, in a worker thread, on its own
connection) and `apply_snapshot` swaps it in on the trio thread:

- models exactly as stored (the config file's too: the leader applied its file), the router told
  of each new or changed one and of each gone;
- nodes' operator labels and facts; a node the store no longer has and no agent streams is forgotten;
- assignments as stored, each keeping the engine report this router last heard for it (agents report
  an engine before the leader's write of its assignment may reach this router: the report waits in
  `plane.heard` and is used when the assignment arrives);
- holds, and the lifecycle's revisions, suites, results and jobs;
- autoscaled models' counts in force and operators' pins (daemon/control/autoscaling.py);
- tenants and API keys: the router's TenantBook rebuilt and pushed when they changed (a key revoked
  at the leader is refused here from then on);
- the nodes' credentials (hashes): a node that joined at another router is known here, and one an
  operator revoked there has its stream here cut.

Then every assignment is routed again (or withdrawn) by the plane's one rule (`plane._route`).
A new leader applies the same snapshot first, so it starts from the store and not from a memory
that may lag it."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import trio

from llmgw.config import ConfigError
from llmgw.config.load import model_from_dict
from llmgw.daemon.control.plane.config_reload import stored_override
from llmgw.daemon.control.store.port import FleetStore
from llmgw.daemon.control.store.rows import HoldRow
from llmgw.daemon.control.store.state import StoredState, read_state
from llmgw.daemon.control.tenants import TENANT_KINDS
from llmgw.fleet.reconcile import Assignment, Hold
from llmgw.fleet.types import RouterAddr

log = logging.getLogger("llmgw.control")

__all__ = ["Snapshot", "apply_snapshot", "read_snapshot"]

LIFECYCLE_KINDS = ("revisions", "suite", "result", "job")
DOC_KINDS = (*LIFECYCLE_KINDS, *TENANT_KINDS, "autoscale")


@dataclass(frozen=True, slots=True)
class Snapshot:
    state: StoredState
    holds: dict[str, HoldRow]
    docs: dict[str, dict[str, dict[str, Any]]]  # document kind (lifecycle, tenants) -> key -> value
    generation: int
    credentials: dict[str, Any] = field(default_factory=dict)  # node -> CredentialRow (hashes only)


def read_snapshot(st: FleetStore) -> Snapshot:
    """The whole state, read in one go (call it in a worker thread, on a connection of its own)."""
    gen = st.generation()
    return Snapshot(read_state(st), st.holds(), {k: st.docs(k) for k in DOC_KINDS}, gen, st.credentials())


def apply_snapshot(plane: Any, snap: Snapshot, *, resume: bool = False) -> None:
    """Swap the store's state into `plane`'s memory (see the module docstring)."""
    gone = _models(plane, snap.state.models)
    _nodes(plane, snap.state)
    _assignments(plane, snap.state)
    for name in gone:
        if not any(a.model == name for a in plane.assignments.values()):
            plane.router.forget_model(name)
    plane.facility.holds = {d: (Hold(row.reason, row.drain), row.created_at) for d, row in snap.holds.items()}
    plane.lifecycle.reload(snap.docs, resume=resume)
    plane.tenants.reload(snap.docs)
    plane.autoscaling.load(snap.docs.get("autoscale", {}))  # counts in force, pins (autoscaling.py)
    plane.agents.credentials_changed(snap.credentials)  # nodes joined or revoked at another router
    for a in list(plane.assignments.values()):
        plane._route(a)
    plane.followed_generation = snap.generation


def _models(plane: Any, records: dict[str, dict[str, Any]]) -> set[str]:
    """The stored models in memory; answers the names no longer defined."""
    gone = set(plane.models) - set(records)
    plane._unloadable = {}
    for name, rec in sorted(records.items()):
        try:
            m = model_from_dict(rec["model"], f"store model {name}", pools=plane.cfg.pools)
        except (ConfigError, KeyError, TypeError) as e:
            if name not in plane._unloadable:
                log.error("model %s in the store is invalid and is ignored here: %s", name, e)
            plane._unloadable[name] = rec
            gone.add(name)
            continue
        source = rec.get("source", "api")
        if plane.models.get(name) != m or plane.sources.get(name) != source:
            plane._set_model(m, source)
        ov = stored_override(rec)
        if ov is None:
            plane.scale_overrides.pop(name, None)
        else:
            plane.scale_overrides[name] = ov
    for name in gone & set(plane.models):
        del plane.models[name]
        plane.sources.pop(name, None)
        plane.deploys.pop(name, None)
        plane.scale_overrides.pop(name, None)
    return gone


def _nodes(plane: Any, state: StoredState) -> None:
    now = trio.current_time()
    reg = plane.nodes
    for name, row in state.nodes.items():
        n = reg.nodes.get(name)
        if n is None:
            reg.remember(name, agent_labels=row.agent_labels, operator_labels=row.operator_labels,
                         facts=row.facts, now=now)
        elif n.operator_labels != row.operator_labels:
            reg.set_operator_labels(name, row.operator_labels)
    for name in [n for n, node in reg.nodes.items() if n not in state.nodes and not node.connected]:
        reg.forget(name)


def _assignments(plane: Any, state: StoredState) -> None:
    now = trio.current_time()
    old: dict[str, Assignment] = plane.assignments
    new: dict[str, Assignment] = {}
    for rid, row in state.assignments.items():
        a = old.get(rid)
        if a is not None and a.node == row.node and a.model == row.model:
            a.spec, a.demand, a.created_at = row.spec, row.demand, row.created_at
            if a.desired != row.desired:
                a.desired = row.desired
                a.drain_since = now if row.desired == "drain" else None
        else:
            a = Assignment(rid, row.model, row.node, row.spec, row.demand, desired=row.desired,
                           created_at=row.created_at, drain_since=now if row.desired == "drain" else None)
            heard = plane.heard.get(rid)
            if heard is not None and heard[0] == row.node:
                a.report = heard[1]
        if row.url:
            plane.urls[rid] = row.url
        new[rid] = a
    plane.assignments = new
    for rid, a in old.items():
        if rid not in new:
            plane.urls.pop(rid, None)
            plane.router.withdraw_replica(rid)
            plane.router.kv_forget(rid)


def router_addrs(routers: dict[str, Any]) -> list[RouterAddr]:
    """The live routers' rows as agents need them: where each takes agents' streams and its TLS pin
    (those that take none are left out)."""
    out = []
    for rid, r in sorted(routers.items()):
        info = r.info if isinstance(r.info, dict) else {}
        control = info.get("control")
        if isinstance(control, str) and control:
            out.append(RouterAddr(rid, control, str(info.get("control_ca_pem") or ""),
                                  str(info.get("control_server_name") or "")))
    return out
