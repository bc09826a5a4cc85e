"""What the control plane needs of a store: the seam for a second backend.

Everything the plane, its agents' sessions, the lifecycle and the admin API keep goes through
these methods (most of them by name, through ``StoreGuard.write``/``must_write``/``read``), and
nothing else of a store is used outside store/. The SQLite store (sqlite.py) is the one backend
today; another (PostgreSQL, for several routers sharing a fleet) implements this Protocol and is
opened in its place by the daemon. The row types and errors a backend speaks are rows.py's.

What a backend must keep that the signatures cannot say:
- ``transaction()`` makes every write inside one commit, and nests (an inner block that fails and
  is caught leaves none of its writes behind: the guard's write-back relies on it);
- a failed write raises (the guard turns it into degraded mode: the plane goes on from memory and
  writes its whole state back later), and a store whose contents cannot be read raises
  StoreCorrupt when it is loaded;
- ``record``/``history``/``prune_history`` are the history: newest first, filters all matching;
- ``path`` names the store in logs and in the admin API's status (a file, or a database's DSN
  without its password).
- ``faults`` is the tuple of exception types that mean "the store failed" (the guard degrades on
  them), ``describe(e)`` says one of them in a few words ("disk full", "locked", "unreachable",
  "timeout", ...), and ``ping()`` raises one of them while the store cannot be reached (the guard
  calls it from a worker thread before each retry, so a hung store never blocks the trio thread);
- several routers share one store (docs/ha.md): ``try_lead``/``release_lead``/``lease`` are the
  leader's lease (its epoch bumped whenever the holder changes). With ``set_fence(id, epoch)`` every
  *fenced* write (all but rows.UNFENCED_OPS) checks, in its own transaction and atomically with its
  commit, that the lease still names that router and epoch, and raises ``Fenced`` (not a fault)
  if not, writing nothing; each outermost transaction with a fenced write bumps ``generation()``
  (the followers poll it and reload). ``store_now`` is the store's clock, the lease's and the
  routers' rows' (``seen_at``) time base: routers' clocks need not agree."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

from llmgw.daemon.control.store.rows import (
    AssignmentRow,
    CredentialRow,
    HistoryRow,
    HoldRow,
    LeaseRow,
    NodeRow,
    RouterRow,
)

__all__ = ["FleetStore"]


@runtime_checkable
class FleetStore(Protocol):
    """The store as the control plane uses it (store.sqlite.Store, store.postgres.PgStore)."""
    path: str
    faults: tuple[type[BaseException], ...]

    def close(self) -> None: ...

    def describe(self, e: BaseException) -> str: ...

    def ping(self) -> None: ...

    def transaction(self) -> AbstractContextManager[None]: ...

    def put_model(self, name: str, spec: dict[str, Any], *, now: float | None = None) -> None: ...

    def delete_model(self, name: str) -> bool: ...

    def models(self) -> dict[str, dict[str, Any]]: ...

    def model(self, name: str) -> dict[str, Any] | None: ...

    def put_doc(self, kind: str, key: str, value: dict[str, Any], *, now: float | None = None) -> None: ...

    def delete_doc(self, kind: str, key: str) -> bool: ...

    def docs(self, kind: str) -> dict[str, dict[str, Any]]: ...

    def write_docs(self, puts: list[tuple[str, str, dict[str, Any]]], deletes: list[tuple[str, str]]) -> None:
        """Several documents put and deleted in one transaction: all or none."""
        ...

    def upsert_node(self, name: str, *, agent_labels: dict[str, str], facts: dict[str, Any],
                    seen_at: float) -> None: ...

    def set_node_labels(self, name: str, labels: dict[str, str]) -> None: ...

    def remove_node_labels(self, name: str, keys: list[str]) -> None: ...

    def nodes(self) -> dict[str, NodeRow]: ...

    def delete_node(self, name: str) -> bool: ...

    def put_assignment(self, row: AssignmentRow) -> None: ...

    def set_desired(self, replica: str, desired: str, *, now: float | None = None) -> None: ...

    def delete_assignment(self, replica: str) -> bool: ...

    def assignments(self) -> dict[str, AssignmentRow]: ...

    def record(self, event: str, *, replica: str | None = None, model: str | None = None,
               node: str | None = None, detail: str = "", ts: float | None = None) -> None: ...

    def history(self, limit: int = 100, replica: str | None = None, model: str | None = None,
                node: str | None = None) -> list[HistoryRow]: ...

    def prune_history(self, keep: int = 100_000) -> int: ...

    def credentials(self) -> dict[str, CredentialRow]: ...

    def put_credential(self, node: str, hash_: str, *, issued_at: float, replacing: Any = ...) -> bool:
        """replacing=... replaces whatever is there; None writes only if the node has no live
        (unrevoked) credential; a hash only if the live one is that. True when written."""
        ...

    def confirm_credential(self, node: str, hash_: str, *, at: float) -> bool: ...

    def revoke_credential(self, node: str, *, at: float) -> bool: ...

    def put_hold(self, domain: str, *, reason: str, drain: bool, now: float | None = None) -> None: ...

    def delete_hold(self, domain: str) -> bool: ...

    def holds(self) -> dict[str, HoldRow]: ...

    # -- several routers on one store (docs/ha.md) -------------------------------------------------
    def store_now(self) -> float:
        """The store's clock (PostgreSQL's clock_timestamp(); SQLite: this host's)."""
        ...

    def try_lead(self, router_id: str, ttl_s: float) -> LeaseRow:
        """Take the lease if it is free or expired, renew it if `router_id` holds it (the epoch
        goes up whenever the holder changes; a first lease is epoch 1); else leave it. The lease as
        it stands after, `mine` when `router_id` holds it."""
        ...

    def release_lead(self, router_id: str) -> None:
        """Expire the lease now if `router_id` holds it (a clean stop: the successor need not wait)."""
        ...

    def lease(self) -> LeaseRow | None: ...

    def set_fence(self, router_id: str | None, epoch: int | None) -> None:
        """From now on every fenced write checks that the lease says (router_id, epoch) and raises
        Fenced, writing nothing, if not; (None, None): no check (a single router)."""
        ...

    def generation(self) -> int:
        """Bumped once by every committed transaction holding a fenced write (followers poll it)."""
        ...

    def register_router(self, router_id: str, info: dict[str, Any], *, started_at: float) -> None: ...

    def router_seen(self, router_id: str) -> None: ...

    def routers(self) -> dict[str, RouterRow]: ...

    def forget_router(self, router_id: str) -> bool: ...

    def cluster_secret(self) -> bytes: ...

    def queue_admin(self, epoch: int, request: dict[str, Any]) -> int: ...

    def admin_requests(self, epoch: int, after_id: int) -> list[tuple[int, dict[str, Any]]]: ...

    def answer_admin(self, qid: int, answer: dict[str, Any]) -> None: ...

    def admin_answer(self, qid: int) -> dict[str, Any] | None: ...

    def take_admin_answer(self, qid: int) -> dict[str, Any] | None:
        """admin_answer, and the request's row deleted once it is answered (its answer may hold a secret)."""
        ...

    def prune_admin(self, older_than_s: float) -> int: ...

    # -- tenants' usage and quota demand (store/usage_rows.py; every write unfenced) -----------------
    def add_usage(self, router_id: str, records: list[Any]) -> None:
        """`router_id`'s UsageRecords (llmgw.tenants.usage), added to what its rows of the same
        (minute, tenant, key, model) hold."""
        ...

    def usage(self, since: float, until: float | None = None, tenant: str | None = None, key: str | None = None,
              model: str | None = None) -> list[Any]:
        """UsageRecords per (hour, tenant, key, model), every router summed, `minute` the hour's
        start: the hours from `since`'s to before `until`; the filters given must all match."""
        ...

    def rollup_usage(self, before: float) -> int:
        """Raw rows of the hours before `before`'s hour added into the hourly ones (once: again
        does nothing); how many raw rows were."""
        ...

    def prune_usage(self, raw_before: float, hourly_before: float) -> int:
        """Rolled-up raw rows before `raw_before` and hourly rows before `hourly_before` deleted."""
        ...

    def spent(self, since_day: float, since_month: float) -> dict[tuple[str, str, str], int]:
        """Tokens (prompt + completion) per ("tenant"|"key", name, "day:YYYY-MM-DD"|"month:YYYY-MM")
        since the UTC day's and month's starts given."""
        ...

    def put_demand(self, router_id: str, demand: dict[str, float]) -> None: ...

    def demands(self, max_age_s: float | None = None) -> dict[str, dict[str, float]]: ...
