"""The parts of a multi-node replica (docs/placement.md, "Multi-node replicas"): one assignment per
node — the head, whose replica id is the group's and which serves, and its workers, whose ids are
the head's with ``-wRANK`` — and the rules that keep a group whole.

- ``group_specs``: the parts of a newly placed group, head first;
- ``broken_groups``: groups to write off whole — a part on a lost or unknown node, or a part
  missing (never a partial group);
- ``workers_of`` / ``group_ready`` / ``head_peers``: what the control plane routes and tells the
  head: a head is ready only when it and every worker are; its workers' addresses come from their
  reports' URLs.
- vLLM (a Ray cluster, ``ray_group``) runs the other way round: the head starts first, and
  ``ray_head_address`` (its report's URL host and the Ray port it reports) is what each worker is
  told (its ``group.peers``); the group is ready when the head serves and every worker runs,
  started with that address (``group_ready``).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import replace
from typing import Protocol, TypeVar
from urllib.parse import urlsplit

from llmgw.fleet.engine_cmd import ray_group
from llmgw.fleet.nodes import Node
from llmgw.fleet.types import EngineReport, EngineSpec, GroupLaunch


class Part(Protocol):
    """What these rules read of an assignment (reconcile.Assignment; named so to keep imports one-way)."""

    replica: str
    node: str
    spec: EngineSpec
    desired: str
    report: EngineReport | None


Assignment = TypeVar("Assignment", bound=Part)

__all__ = ["broken_groups", "group_ready", "group_specs", "head_peers", "is_current", "ray_head_address", "worker_id",
           "workers_of"]


def worker_id(head: str, rank: int) -> str:
    return f"{head}-w{rank}"


def group_specs(head: EngineSpec, group: tuple[tuple[str, tuple[int, ...]], ...]
                ) -> list[tuple[str, str, tuple[int, ...], EngineSpec]]:
    """(replica id, node, gpus, spec) of each part of a group placed on `group` (serving node first)."""
    size = len(group)
    out = []
    for rank, (node, gpus) in enumerate(group):
        rid = head.replica if rank == 0 else worker_id(head.replica, rank)
        g = GroupLaunch(role="head" if rank == 0 else "worker", group=head.replica, rank=rank, size=size)
        out.append((rid, node, gpus, replace(head, replica=rid, gpu_indices=gpus, group=g)))
    return out


def _parts(assignments: Iterable[Assignment]) -> dict[str, list[Assignment]]:
    by_group: dict[str, list[Assignment]] = {}
    for a in assignments:
        if a.spec.group is not None:
            by_group.setdefault(a.spec.group.group, []).append(a)
    return by_group


def broken_groups(assignments: Iterable[Assignment], nodes: Mapping[str, Node],
                  capable: Collection[str] | None = None) -> dict[str, str]:
    """replica -> why, for every part of a group that cannot stand: a part's node is lost or
    unknown, or its agent does not run group parts (`capable`: the nodes whose agents do; None:
    all), or the group lacks a part (a head or a rank). Stopped parts are not counted."""
    out: dict[str, str] = {}
    for gid, parts in _parts(assignments).items():
        live = [a for a in parts if a.desired != "stop"]
        if not live:
            continue
        size = live[0].spec.group.size  # type: ignore[union-attr]
        why = ""
        for a in live:
            n = nodes.get(a.node)
            if n is None or n.state == "lost":
                why = f"node {a.node} of its {size}-node group {gid} is {'lost' if n else 'unknown'}"
                break
            if capable is not None and a.node not in capable and n.connected:
                why = f"node {a.node}'s agent does not run multi-node replicas (an older llmgw: upgrade it)"
                break
        if not why:
            ranks = {a.spec.group.rank for a in live}  # type: ignore[union-attr]
            if ranks != set(range(size)) or len(live) != size:
                missing = sorted(set(range(size)) - ranks)
                why = f"its {size}-node group {gid} is incomplete (rank {', '.join(map(str, missing)) or '?'} missing)"
        if why:
            for a in live:
                out[a.replica] = why
    return out


def workers_of(assignments: Iterable[Assignment]) -> dict[str, list[Assignment]]:
    """head replica id -> its workers, rank order."""
    out: dict[str, list[Assignment]] = {}
    for gid, parts in _parts(assignments).items():
        ws = sorted((a for a in parts if a.spec.is_worker), key=lambda a: a.spec.group.rank)  # type: ignore[union-attr]
        out[gid] = ws
    return out


def _address(url: str | None) -> str | None:
    if not url:
        return None
    try:
        u = urlsplit(url)
        port = u.port
    except ValueError:
        return None
    if u.scheme != "http" or not u.hostname or port is None:
        return None
    host = f"[{u.hostname}]" if ":" in u.hostname else u.hostname
    return f"{host}:{port}"


def head_peers(head: Assignment, workers: list[Assignment]) -> tuple[str, ...] | None:
    """The workers' addresses in rank order, when every worker of `head`'s group reports ready at
    an http://host:port URL; else None."""
    g = head.spec.group
    if g is None or len(workers) != g.size - 1:
        return None
    out = []
    for w in workers:
        r = w.report
        addr = _address(r.url) if r is not None and r.state == "ready" else None
        if addr is None:
            return None
        out.append(addr)
    return tuple(out)


def is_current(a: Part) -> bool:
    """`a`'s report is of the process started with its present spec and generation."""
    r = a.report
    return r is not None and r.generation == a.spec.generation and r.spec_hash == a.spec.spec_hash()


def ray_head_address(head: Assignment) -> str | None:
    """A vLLM multi-node head's Ray address, HOST:PORT: its report's URL host (checked by the router
    as every report URL is: the node's own address) and the Ray port it reports; None until its
    present process reports one."""
    r = head.report
    if r is None or r.group_port is None or r.state not in ("starting", "ready") or not is_current(head):
        return None
    addr = _address(r.url)
    if addr is None:
        return None
    return f"{addr.rsplit(':', 1)[0]}:{r.group_port}"


def group_ready(head: Assignment, workers: list[Assignment]) -> bool:
    """The head serves with every worker of its group ready and told to it: the head's report is of
    the process started with the workers' present addresses (its spec and generation). vLLM (Ray):
    the head ready, and every worker ready, started with the head's present Ray address."""
    g = head.spec.group
    if g is None:
        return True
    if ray_group(head.spec):
        addr = ray_head_address(head)
        return (addr is not None and head.report is not None and head.report.state == "ready"
                and len(workers) == g.size - 1
                and all(w.spec.group is not None and w.spec.group.peers == (addr,) and is_current(w)
                        and w.report is not None and w.report.state == "ready" for w in workers))
    peers = head_peers(head, workers)
    r = head.report
    return (peers is not None and peers == g.peers and r is not None and r.generation == head.spec.generation
            and r.spec_hash == head.spec.spec_hash())
