"""The adapter state machine's face to the shell: what the router's LoRA loader
(``daemon/router/adapter_loader.py``), its metrics, the replica scrape and the admin API may ask
of :class:`~.adapter_routing.AdapterRouting` and the replica table — and nothing else. The core
hands it out (``RouterCore.adapter_port()``); the shell never reaches through the core's members.

It holds no state of its own: every call is the routing's or the table's, read or done now."""

from __future__ import annotations

from collections.abc import Callable

from .adapter_routing import AdapterRouting
from .adapters import AdapterBook, Load, Unload
from .admission import Ticket
from .plan import Plan
from .replicas import Replica, ReplicaTable

__all__ = ["AdapterPort"]


class AdapterPort:
    def __init__(self, routing: AdapterRouting, table: ReplicaTable, load_timeout_s: float) -> None:
        self._routing = routing
        self._table = table
        self.load_timeout_s = load_timeout_s  # [router] adapter_load_timeout_s

    # -- what to unload, and when ---------------------------------------------------------------
    def watch_retire(self, poke: Callable[[], None] | None) -> None:
        """``poke`` is called when :meth:`retire_due` has work (None: stop poking)."""
        self._routing.on_retire = poke if poke is not None else _nothing

    def retire_due(self, now: float) -> list[Unload]:
        """The unloads to begin now (AdapterRouting.retire_due)."""
        return self._routing.retire_due(now)

    def unload_done(self, u: Unload, now: float, *, ok: bool) -> list[Ticket]:
        """An unload of an adapter the model no longer serves ended (exactly once)."""
        return self._routing.unload_done(u, now, ok=ok)

    # -- loads ----------------------------------------------------------------------------------
    def load_target(self, ld: Load) -> tuple[str, str] | None:
        """The replica's URL and the adapter's declared source for ``ld``; None when the replica
        or the adapter's declaration is gone."""
        rep = self._table.replicas.get(ld.replica)
        entry = self._table.models.get(ld.model)
        decl = entry.declared.get(ld.adapter) if entry is not None else None
        if rep is None or decl is None:
            return None
        return rep.view.url, decl.source

    def replica_url(self, rid: str) -> str | None:
        """Where replica ``rid`` answers; None when it is gone."""
        rep = self._table.replicas.get(rid)
        return rep.view.url if rep is not None else None

    def unloaded(self, ld: Load, now: float, *, ok: bool) -> None:
        """The unload that made room for ``ld`` ended (reported once per load)."""
        self._routing.unloaded(ld, now, ok=ok)

    def load_done(self, ld: Load, now: float, failure: tuple[str, int, str] | None) -> list[Ticket]:
        """``ld`` ended: None when it went well, else (reason, status, outcome)."""
        return self._routing.load_done(ld, now, failure)

    def waited(self, plan: Plan, now: float, *, cancelled: bool = False) -> None:
        """The plan's wait on its load ended (the request's error is raised when it failed)."""
        self._routing.waited(plan, now, cancelled=cancelled)

    # -- what engines say -----------------------------------------------------------------------
    def listed(self, rep: Replica, names: set[str], asked_at: float) -> list[Ticket]:
        """``rep``'s engine listed the adapters it holds (AdapterRouting.listed)."""
        return self._routing.listed(rep, names, asked_at)

    def missing(self, plan: Plan, rep: Replica, now: float) -> bool:
        """``rep`` answered 404 for the request's adapter, which it held (AdapterRouting.missing)."""
        return self._routing.missing(plan, rep, now)

    # -- listings (metrics, admin API) ----------------------------------------------------------
    def book(self) -> AdapterBook:
        """The adapter book, to read (which replica holds what, the tallies)."""
        return self._routing.book

    def holdings(self) -> tuple[AdapterBook, dict[str, str]]:
        """The book, and each replica's model (for the admin API)."""
        return self._routing.book, {rid: r.view.model for rid, r in self._table.replicas.items()}


def _nothing() -> None:
    pass
