"""The control plane's side of multi-node replicas (docs/placement.md, "Multi-node replicas"): the
head is started only once every worker of its group runs (its spec then carries their addresses),
is routed only while they all are ready, and stops with its workers. The rules that keep a group
whole in reconciliation are the pure core's (llmgw/fleet/group_parts.py).

vLLM (a Ray cluster per replica) runs the other way round: its head starts at once, and its workers
are started only once the head reports its Ray port — each is told the head's Ray address
(``sync_ray_group``)."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Protocol

from llmgw.fleet.engine_cmd import ray_group
from llmgw.fleet.group_parts import group_ready, head_peers, is_current, ray_head_address, worker_id
from llmgw.fleet.reconcile import Assignment


class ControlPlane(Protocol):
    """What these read and call of the control plane (plane/plane.py; named so to keep imports one-way)."""

    assignments: dict[str, Assignment]
    guard: Any
    agents: Any
    told_workers: dict[str, tuple[int | None, ...]]  # head -> its workers' pids when it was (last) told

    def _row(self, a: Assignment) -> Any: ...

__all__ = ["head_of", "head_startable", "routable_group", "stop_workers", "sync_head", "sync_ray_group", "workers"]

log = logging.getLogger("llmgw.control")


def workers(plane: ControlPlane, head: Assignment) -> list[Assignment] | None:
    """The head's workers in rank order; None if one is missing."""
    g = head.spec.group
    if g is None:
        return []
    out = []
    for rank in range(1, g.size):
        w = plane.assignments.get(worker_id(head.replica, rank))
        if w is None:
            return None
        out.append(w)
    return out


def head_of(plane: ControlPlane, a: Assignment) -> Assignment | None:
    """A worker's head (None for a head, a single-node replica, or a worker whose head is gone)."""
    if not a.spec.is_worker:
        return None
    return plane.assignments.get(a.spec.group.group)  # type: ignore[union-attr]


def head_startable(a: Assignment) -> bool:
    """In its node's desired set: not a head still waiting for its workers' addresses (vLLM: not a
    worker still waiting for its head's Ray address)."""
    g = a.spec.group
    if g is None:
        return True
    if ray_group(a.spec):
        return g.role == "head" or len(g.peers) == 1
    return g.role == "worker" or len(g.peers) == g.size - 1


def routable_group(plane: ControlPlane, head: Assignment) -> bool:
    ws = workers(plane, head)
    return ws is not None and group_ready(head, ws)


def sync_head(plane: ControlPlane, head: Assignment) -> None:
    """When every worker is ready, tell the head their addresses; written to the store as the head's
    spec. A head already told is restarted when a worker is a new process (another address, or
    another pid at the same one): what the head had placed on its old workers is gone (a llama.cpp
    rpc-server keeps nothing across a restart)."""
    if ray_group(head.spec):
        sync_ray_group(plane, head)
        return
    ws = workers(plane, head)
    g = head.spec.group
    if ws is None or g is None or head.desired != "run":
        return
    peers = head_peers(head, ws)
    if peers is None:
        return
    pids = tuple(w.report.pid if w.report is not None else None for w in ws)
    told = plane.told_workers
    if peers == g.peers:
        before = told.setdefault(head.replica, pids)  # first seen since this router started: as is
        if before == pids:
            return
        told[head.replica] = pids
        head.spec = replace(head.spec, generation=head.spec.generation + 1)
        plane.guard.write("put_assignment", plane._row(head))
        plane.guard.record("replica restart", replica=head.replica, model=head.model, node=head.node,
                           detail="a worker of its group was restarted")
        log.warning("replica %s of %s: a worker restarted; restarting its head on %s", head.replica, head.model,
                    head.node)
        plane.agents.push(head.node)
        return
    told[head.replica] = pids
    head.spec = replace(head.spec, group=replace(g, peers=peers))
    head._match = None
    plane.guard.write("put_assignment", plane._row(head))
    plane.guard.record("group ready", replica=head.replica, model=head.model, node=head.node,
                       detail=f"workers {', '.join(peers)}")
    log.info("replica %s of %s: its %d workers run (%s); starting its head on %s", head.replica, head.model,
             len(ws), ", ".join(peers), head.node)
    plane.agents.push(head.node)


def _tell_worker(plane: ControlPlane, w: Assignment, peers: tuple[str, ...], restart: bool = False) -> None:
    """Set a worker's head address (none: it stops); `restart`: a new generation, so that its agent
    starts a new process even if it sees the same address again."""
    g = w.spec.group
    assert g is not None
    w.spec = replace(w.spec, group=replace(g, peers=peers), generation=w.spec.generation + int(restart))
    w._match = None
    plane.guard.write("put_assignment", plane._row(w))
    plane.agents.push(w.node)


def sync_ray_group(plane: ControlPlane, head: Assignment) -> None:
    """A vLLM head's workers join its Ray head: once the head's present process reports its Ray
    port, each worker is told HOST:PORT (and so started, or restarted at a new address). A part
    that becomes a new process after the whole group ran breaks the Ray cluster: a new head gets
    new workers (they are stopped, then told its address); a new worker gets a new head (its
    generation bumped) and, again, new workers."""
    ws = workers(plane, head)
    g = head.spec.group
    if ws is None or g is None or head.desired not in ("run", "drain"):
        return
    parts = [head, *ws]
    pids = tuple(p.report.pid if p.report is not None else None for p in parts)
    told = plane.told_workers
    before = told.get(head.replica)
    if before is not None and head.desired == "run":
        moved = [i for i, (now, was) in enumerate(zip(pids, before, strict=True))
                 if now is not None and was is not None and now != was]
        if moved:
            del told[head.replica]
            if any(i > 0 for i in moved):  # a worker restarted: vLLM's actors on it are gone
                head.spec = replace(head.spec, generation=head.spec.generation + 1)
                plane.guard.write("put_assignment", plane._row(head))
                plane.agents.push(head.node)
            for w in ws:
                _tell_worker(plane, w, (), restart=True)  # stopped until the (new) head's Ray runs
            what = "its head" if moved == [0] else "a worker"
            plane.guard.record("replica restart", replica=head.replica, model=head.model, node=head.node,
                               detail=f"{what} of its Ray cluster was restarted: restarting the group")
            log.warning("replica %s of %s: %s of its Ray cluster restarted; restarting the group", head.replica,
                        head.model, what)
            return
    addr = ray_head_address(head)
    if addr is None:
        return
    stale = [w for w in ws if w.spec.group is not None and w.spec.group.peers != (addr,)]
    for w in stale:
        _tell_worker(plane, w, (addr,))
    if stale:
        plane.guard.record("group ready", replica=head.replica, model=head.model, node=head.node,
                           detail=f"its Ray head runs at {addr}: starting {len(stale)} workers")
        log.info("replica %s of %s: its Ray head runs at %s; starting its workers on %s", head.replica, head.model,
                 addr, ", ".join(sorted({w.node for w in stale})))
        return
    if before is None and all(p is not None and is_current(a) for p, a in zip(pids, parts, strict=True)):
        told[head.replica] = pids  # the whole group runs: a later new process of a part restarts it


def stop_workers(plane: ControlPlane, head: Assignment) -> None:
    """The head stops: so do its workers (they serve nothing without it)."""
    for w in workers(plane, head) or ():
        if w.desired != "stop":
            w.desired = "stop"
            w.reason = w.reason or f"its head {head.replica} stopped"
            plane.guard.write("set_desired", w.replica, "stop")
            plane.agents.push(w.node)
