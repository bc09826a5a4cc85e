"""The control plane's state in its store, both ways.

`read_state` at start: everything the plane loads, decoded. A store that cannot be read — a damaged
page, a row that is not what llmgw wrote — raises StoreCorrupt, which stops the daemon with one
line naming the file and what to do (CORRUPT_ADVICE); the disk is untrusted input like any other.

`write_state`: the whole state from memory, the StoreGuard's recovery after a fault (the caller
holds one transaction around it). Rows that already say the same are left alone."""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from llmgw.daemon.control.store.port import FleetStore
from llmgw.daemon.control.store.rows import AssignmentRow, StoreCorrupt, StoreError
from llmgw.fleet.nodes import Node
from llmgw.fleet.placement import Demand
from llmgw.fleet.types import EngineSpec, NodeFacts

__all__ = ["CORRUPT_ADVICE", "StoredAssignment", "StoredNode", "StoredState", "read_state", "write_state"]

CORRUPT_ADVICE = ("move it aside with its -wal and -shm files and start with `llmgw daemon --adopt` to rebuild it "
                  "from what the agents report, or restore it from a backup")


@dataclass(frozen=True, slots=True)
class StoredNode:
    agent_labels: dict[str, str]
    operator_labels: dict[str, str]
    facts: NodeFacts


@dataclass(frozen=True, slots=True)
class StoredAssignment:
    model: str
    node: str
    spec: EngineSpec
    demand: Demand
    desired: str
    created_at: float
    url: str | None


@dataclass(frozen=True, slots=True)
class StoredState:
    models: dict[str, dict[str, Any]]  # name -> {"source": ..., "model": model_to_dict(...)}
    nodes: dict[str, StoredNode]
    assignments: dict[str, StoredAssignment]


def read_state(st: FleetStore) -> StoredState:
    where = "models"
    try:
        models = st.models()
        for name, rec in models.items():
            if not isinstance(rec, dict) or not isinstance(rec.get("model"), dict):
                raise ValueError(f"model {name!r} is not a model record")
        where = "nodes"
        nodes = {name: StoredNode(dict(row.agent_labels), dict(row.operator_labels), NodeFacts.from_wire(row.facts))
                 for name, row in st.nodes().items()}
        where = "assignments"
        assignments = {}
        for rid, row in st.assignments().items():
            where = f"assignment {rid}"
            assignments[rid] = StoredAssignment(row.model, row.node, EngineSpec.from_wire(row.spec),
                                                Demand.from_wire(row.spec.get("demand") or {}), row.desired,
                                                float(row.created_at), row.url)
    except getattr(st, "faults", (sqlite3.Error,)) as e:
        # SQLite: a page it cannot read is damage. Another backend's fault (a server that went
        # away) is not corruption: it says what it is.
        if isinstance(e, sqlite3.DatabaseError) or st.describe(e) == "corrupted":
            raise StoreCorrupt(st.path, f"{where}: {e}") from None
        raise StoreError(f"store {st.path} cannot be read ({st.describe(e)}): {where}: "
                         f"{' '.join(str(e).split())}") from None
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise StoreCorrupt(st.path, f"{where}: a row llmgw cannot decode: {type(e).__name__}: {e}") from None
    return StoredState(models, nodes, assignments)


def write_state(st: FleetStore, *, models: Mapping[str, dict[str, Any]], nodes: Mapping[str, Node],
                seen_wall: Mapping[str, float], assignments: Mapping[str, AssignmentRow]) -> None:
    """Make the store say what memory says. `seen_wall`: nodes whose agent said hello in this run
    (their agent labels and facts are written with that time)."""
    stored_models = st.models()
    for name in stored_models.keys() - models.keys():
        st.delete_model(name)
    for name, rec in models.items():
        if stored_models.get(name) != rec:
            st.put_model(name, rec)
    stored_nodes = st.nodes()
    for name, n in nodes.items():
        if name in seen_wall:
            st.upsert_node(name, agent_labels=n.agent_labels, facts=n.facts.to_wire(), seen_at=seen_wall[name])
        row = stored_nodes.get(name)
        have = row.operator_labels if row is not None else {}
        if have != n.operator_labels:
            gone = [k for k in have if k not in n.operator_labels]
            if gone:
                st.remove_node_labels(name, gone)
            if n.operator_labels:
                st.set_node_labels(name, n.operator_labels)
    stored = st.assignments()
    for rid in stored.keys() - assignments.keys():
        st.delete_assignment(rid)
    for rid, row in assignments.items():
        old = stored.get(rid)
        if old is None or (old.model, old.node, old.spec, old.desired, old.url) != (row.model, row.node, row.spec,
                                                                                   row.desired, row.url):
            st.put_assignment(row)
