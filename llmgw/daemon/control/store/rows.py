"""The store's rows and its input checks: what the router keeps about models, nodes, replica
assignments, node credentials and history, as types; the errors a store raises (named so an
operator knows what to do); and the file modes of the store's files."""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from llmgw.daemon.private_files import PRIVATE_FILE, private_dir, tighten_file
from llmgw.fleet.types import EngineSpec

log = logging.getLogger("llmgw.control")

DESIRED_STATES: tuple[str, ...] = ("run", "drain", "stop")


class StoreError(Exception):
    """The store file cannot be used: not SQLite, not ours, or from a newer llmgw."""


class StoreCorrupt(StoreError):
    """The store file is damaged: SQLite reports corruption, or a row cannot be decoded."""

    def __init__(self, path: str, what: str) -> None:
        super().__init__(f"store {path} is corrupted ({' '.join(what.split())})")  # one line
        self.path = path


class Fenced(StoreError):
    """A fenced write refused: the leader row no longer names this router and its epoch (another
    router leads now). Not a store fault: the store works, this router must stop acting."""

    def __init__(self, router_id: str, epoch: int, holder: str | None, now_epoch: int | None) -> None:
        held = "no leader" if holder is None else f"{holder} leads at epoch {now_epoch}"
        super().__init__(f"router {router_id} is no longer the leader of epoch {epoch} ({held}): write refused")
        self.router_id, self.epoch, self.holder, self.now_epoch = router_id, epoch, holder, now_epoch


@dataclass(frozen=True, slots=True)
class LeaseRow:
    """The leader's lease as try_lead/lease see it: `expires_in_s` by the store's clock (negative:
    expired), `mine` when the router that asked holds it."""
    holder: str
    epoch: int
    expires_in_s: float
    mine: bool


@dataclass(frozen=True, slots=True)
class RouterRow:
    """A router's row: `info` is what it wrote (its addresses, version, ...); `age_s` is the store's
    clock since its last heartbeat (router_seen)."""
    id: str
    info: dict[str, Any]
    started_at: float
    seen_at: float
    age_s: float


class CallTimes:
    """How long a store's calls took (a histogram for /metrics: llmgw_store_call_seconds)."""

    BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

    def __init__(self) -> None:
        self.counts = [0] * (len(self.BUCKETS) + 1)  # the last: above every bucket
        self.total = 0.0

    def record(self, seconds: float) -> None:
        i = 0
        while i < len(self.BUCKETS) and seconds > self.BUCKETS[i]:
            i += 1
        self.counts[i] += 1
        self.total += seconds

    def cumulative(self) -> list[tuple[str, int]]:
        out, n = [], 0
        for le, c in zip((*map(str, self.BUCKETS), "+Inf"), self.counts):
            n += c
            out.append((le, n))
        return out


# Writes any router may make, leader or not: no fence check and no generation bump (the rest are
# fenced when a fence is set, and bump the generation once per outermost transaction).
UNFENCED_OPS = frozenset({
    "upsert_node", "put_credential", "confirm_credential", "register_router", "router_seen", "forget_router",
    "try_lead", "release_lead", "queue_admin", "answer_admin", "take_admin_answer", "prune_admin", "cluster_secret", "record",
    "prune_history", "add_usage", "rollup_usage", "prune_usage", "put_demand"})


# SQLite's primary result codes (sqlite_errorname), and the message fragments when there is none.
_KINDS = (("SQLITE_FULL", "is full", "disk full"), ("SQLITE_READONLY", "readonly", "read-only"),
          ("SQLITE_IOERR", "I/O error", "I/O error"), ("SQLITE_CORRUPT", "malformed", "corrupted"),
          ("SQLITE_NOTADB", "not a database", "corrupted"), ("SQLITE_BUSY", "locked", "locked"),
          ("SQLITE_LOCKED", "is locked", "locked"), ("SQLITE_CANTOPEN", "unable to open", "cannot open"),
          ("SQLITE_PERM", "access permission", "permission denied"))


def describe(e: BaseException) -> str:
    """A store error in a few words an operator acts on: "disk full", "read-only", "I/O error",
    "corrupted", "locked"... (SQLite's message says the rest)."""
    name = getattr(e, "sqlite_errorname", "") or ""
    text = str(e)
    for code, fragment, kind in _KINDS:
        if name == code or name.startswith(code + "_") or fragment in text:
            return kind
    return text.split(":")[0][:60] or type(e).__name__


@dataclass(frozen=True)
class HoldRow:
    """A facility domain an operator holds: nothing new is placed in it; `drain` moves what runs there."""
    domain: str  # LEVEL=VALUE (llmgw.fleet.domains)
    reason: str
    drain: bool
    created_at: float


@dataclass
class NodeRow:
    name: str
    agent_labels: dict[str, str]
    operator_labels: dict[str, str]
    facts: dict[str, Any]
    first_seen: float | None  # None: labelled by an operator, never seen from an agent
    last_seen: float | None

    @property
    def labels(self) -> dict[str, str]:
        """Effective labels: the operator overrides what the agent reports."""
        return {**self.agent_labels, **self.operator_labels}


@dataclass
class AssignmentRow:
    replica: str
    model: str
    node: str
    spec: dict[str, Any]  # EngineSpec.to_wire(), with "demand": Demand.to_wire() (llmgw.fleet.placement)
    desired: str = "run"  # one of DESIRED_STATES
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    # Where its engine last answered as ready: a restarted router probes it and routes there at
    # once, before the agent reconnects. Kept in the spec's JSON (as "url"), so no schema change.
    url: str | None = None

    def engine_spec(self) -> EngineSpec:
        return EngineSpec.from_wire(self.spec)


@dataclass(frozen=True)
class CredentialRow:
    """A node's credential: the hash of the secret its agent keeps (llmgw.fleet.identity)."""
    node: str
    hash: str
    issued_at: float
    confirmed_at: float | None  # None: pending, the agent has not used it yet
    revoked_at: float | None  # set: refused, kept so the agent is told why


@dataclass(frozen=True)
class HistoryRow:
    id: int
    ts: float
    event: str
    replica: str | None
    model: str | None
    node: str | None
    detail: str


def check_name(value: object, what: str = "name") -> str:
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a string, got {type(value).__name__}")
    if not value:
        raise ValueError(f"{what} must not be empty")
    return value


def check_labels(labels: object) -> dict[str, str]:
    if not isinstance(labels, dict):
        raise TypeError(f"labels must be a dict, got {type(labels).__name__}")
    for k, v in labels.items():
        check_name(k, "label key")
        if not isinstance(v, str):
            raise TypeError(f"label {k!r} must have a string value, got {v!r}")
    return labels


def check_obj(value: object, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TypeError(f"{what} must be a dict, got {type(value).__name__}")
    return value


def check_desired(value: object) -> str:
    if value not in DESIRED_STATES:
        raise ValueError(f"desired must be one of {', '.join(DESIRED_STATES)}, got {value!r}")
    return str(value)


def credential_upsert(replacing: Any) -> tuple[str, tuple[Any, ...]]:
    """put_credential's statement (%s placeholders) and its arguments after (node, hash, issued_at),
    one statement for both backends so first-writer-wins needs no lock (see Store.put_credential)."""
    sql = ("INSERT INTO node_credentials (node, hash, issued_at) VALUES (%s, %s, %s) ON CONFLICT (node) DO UPDATE "
           "SET hash = excluded.hash, issued_at = excluded.issued_at, confirmed_at = NULL, revoked_at = NULL")
    if replacing is ...:
        return sql, ()
    if replacing is None:
        return sql + " WHERE node_credentials.revoked_at IS NOT NULL", ()
    return sql + " WHERE node_credentials.revoked_at IS NOT NULL OR node_credentials.hash = %s", (check_name(
        replacing, "replacing"),)


def check_event(event: object, replica: object, model: object, node: object, detail: object) -> None:
    """A history event's fields, as both backends accept them."""
    check_name(event, "event")
    for what, value in (("replica", replica), ("model", model), ("node", node)):
        if value is not None:
            check_name(value, what)
    if not isinstance(detail, str):
        raise TypeError(f"detail must be a string, got {type(detail).__name__}")


def assignment_row(replica: str, model: str, node: str, spec_json: str, desired: str, created_at: float,
                   updated_at: float) -> AssignmentRow:
    """An assignments row as both backends store it (the engine's last ready URL kept in its spec)."""
    spec = json.loads(spec_json)
    url = spec.pop("url", None) if isinstance(spec, dict) else None
    return AssignmentRow(replica, model, node, spec, desired, created_at, updated_at,
                         url if isinstance(url, str) else None)


def dumps_json(value: Any) -> str:
    # Sorted and NaN-free so equal data is equal text and any JSON reader can load it.
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


def sql_statements(script: str) -> Iterator[str]:
    """Split a script into statements: executescript() would commit our open transaction."""
    *parts, tail = script.split(";")
    buf = ""
    for part in parts:
        buf += part + ";"
        if sqlite3.complete_statement(buf):  # a ';' inside a string or trigger body does not end it
            yield buf
            buf = ""
    if (buf + tail).strip():
        raise AssertionError(f"incomplete SQL at end of migration: {buf + tail!r}")


def private_store_files(path: str) -> None:
    """The store, its WAL, shared-memory and lock files 0600, in a directory closed to others.

    A new store file is created empty and 0600 before SQLite opens it (an empty file is an empty
    database), so SQLite creates its -wal and -shm files 0600 too: it gives them the database
    file's mode. Existing files found looser are tightened with a warning. The directory is
    created 0700; an existing one is tightened only when it is llmgw's own (its name says llmgw,
    as the default and the documented /var/lib/llmgw do) — a configured path may sit in a shared
    directory such as /var/lib, which is warned about, never chmod-ed."""
    parent = os.path.dirname(os.path.abspath(path))
    private_dir(parent, "control.store", dedicated="llmgw" in os.path.basename(parent), log=log)
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, PRIVATE_FILE))
    except FileExistsError:
        pass
    for suffix in ("", "-wal", "-shm", ".lock"):
        tighten_file(path + suffix, "control.store", log=log)
