"""LoRA adapters on demand, as the router's core sees them (vLLM replicas of a model whose
``[[models.adapters]]`` declare the adapter; static adapters are never loaded or unloaded here).

Before admission, a request for such an adapter is looked at here (:meth:`AdapterRouting.step`):

* a replica holds it and is not saturated (admission's own measure): nothing to do, the request
  is routed to the holders (the ``serves`` filter keeps them);
* a load of it is in progress anywhere: the request waits on that same load (single flight);
* else a load begins on the least loaded unsaturated replica without it, with a free slot — or,
  when no replica holds it at all, after unloading that replica's least recently used idle
  adapter (a hot adapter spreads to free slots only, it never pushes another out);
* nothing can be loaded: while holders exist (all saturated) the request takes the usual
  admission path; else it waits in the model's admission queue for an adapter to go idle
  (429 with the reason when the queue is full or its deadline passes), or — when every
  candidate's last load of it failed and is in backoff — gets 503 with the engine's reason and
  ``Retry-After``.

The step is a :class:`~.adapters.Load` for the shell to wait on (it starts the HTTP calls of a
new one); the shell then reports with :meth:`waited` (raising the failure, counted, for every
request that waited on a failed load) and, for the load itself, :meth:`load_done`. Pure."""

from __future__ import annotations

import math
from typing import Any

from .adapters import AdapterBook, AdapterSettings, Load, LoadFailure
from .admission import Ticket
from .filters import is_saturated, load_estimate
from .openai_req import ApiError
from .replicas import Replica

# The router's core (dispatch.RouterCore) and its Plan: typed loosely, since dispatch imports this
# module (no import cycle, not even for type checking: tests/test_import_contract.py).
RouterCore = Any
Plan = Any

__all__ = ["AdapterRouting"]


class AdapterRouting:
    def __init__(self, core: RouterCore, settings: AdapterSettings) -> None:
        self.core = core
        self.book = AdapterBook(settings)

    # -- replicas ------------------------------------------------------------------------------
    def add_replica(self, rep: Replica) -> None:
        entry = self.core.table.models.get(rep.view.model)
        if entry is None or entry.engine != "vllm":
            return
        self.book.add_replica(rep.id, entry.max_loaded_adapters,
                              pinned=[a.name for a in entry.declared.values() if a.static])
        self._sync(rep)

    def remove_replica(self, rid: str) -> None:
        self.book.remove_replica(rid)

    def model_changed(self, model: str) -> None:
        """The model was redefined: its replicas' cap and pinned (static) adapters follow. A lower
        cap than the adapters held takes no adapter away; no load goes there until it is below."""
        entry = self.core.table.models.get(model)
        for rep in entry.replicas if entry is not None else ():
            self.add_replica(rep)

    def listed(self, rep: Replica, names: frozenset[str] | set[str], asked_at: float) -> list[Ticket]:
        """The engine's /v1/models (asked at ``asked_at``) lists these adapters: a restart is
        learned (the book follows the engine), the view follows the book."""
        table = self.core.table
        if rep.id not in self.book.replicas:
            table.set_adapters(rep, names)
            return []
        before = self.book.loaded(rep.id)
        self.book.learned(rep.id, names, asked_at)
        self._sync(rep)
        if self.book.loaded(rep.id) != before:
            return self.core.capacity_freed(rep.view.model, everyone=True)
        return []

    def _sync(self, rep: Replica) -> None:
        self.core.table.set_adapters(rep, self.book.loaded(rep.id))

    # -- a request -----------------------------------------------------------------------------
    def step(self, plan: Plan, now: float) -> Load | Ticket | None:
        """What an on-demand adapter request does before admission (module docstring)."""
        core = self.core
        entry = plan.entry
        name = plan.info.adapter
        assert name is not None
        q = core._queue(entry)
        woken: Ticket | None = None
        if plan.ticket is not None:
            if not plan.adapter_wait:
                return None  # the model's own admission wait: the core goes on with it
            if plan.ticket in q:
                return plan.ticket
            woken, plan.ticket, plan.adapter_wait = plan.ticket, None, False
        book = self.book
        cfg = core.sched.config
        live = [r for r in entry.replicas
                if not r.draining and r.breaker.can_pass(now) and r.id in book.replicas]
        if not live:  # every breaker open (or none yet): the usual path fails open or answers 503 at once
            if woken is not None:
                plan.admitted = True
            return None
        for r in live:
            r.view.stale = core.table.is_stale(r, now)
        holders = [r for r in live if book.holds(r.id, name)]
        if any(not is_saturated(r.view, cfg) for r in holders):
            if woken is not None:
                plan.admitted = True  # it waited its turn already
            return None
        ld = book.load_for(name)
        if ld is not None:
            ld.waiters += 1
            book.waits_total += 1
            plan.load = ld
            return ld
        others = sorted((r for r in live if not book.holds(r.id, name) and not is_saturated(r.view, cfg)),
                        key=lambda r: load_estimate(r.view))
        got = book.choose(name, [r.id for r in others], now, evict=not holders,
                          evictable={a for a in entry.declared if entry.on_demand(a)})
        if isinstance(got, Load):
            got.model = entry.name
            got.waiters = 1
            book.waits_total += 1
            plan.load = got
            self._sync(core.table.replicas[got.replica])
            return got
        if holders:
            if woken is not None:
                plan.admitted = True
            return None  # every holder is saturated and no other replica has a free slot: admission
        if got.failure is not None:
            raise self._backoff_error(plan, got.failure, now)
        plan.wait_reason = got.reason
        plan.adapter_wait = True
        if woken is not None:
            q.requeue(woken)
            plan.ticket = woken
            return woken
        t = q.enqueue(plan.info.request_id, now + core.rc.queue_timeout_s, now)
        if t is None:
            plan.adapter_wait = False
            raise core._reject(plan, now, "adapter_no_room", f"{got.reason}; the wait queue is full.")
        plan.ticket = t
        return t

    def waited(self, plan: Plan, now: float, *, cancelled: bool = False) -> None:
        """The request stops waiting on its load: the load ended (success: ask ``next`` again;
        failure: raised here, counted), the client left (``cancelled``: counted), or its own
        deadline passed with the load still going (504, counted)."""
        ld, plan.load = plan.load, None
        if ld is None:
            return
        ld.waiters = max(0, ld.waiters - 1)
        core = self.core
        if cancelled:
            core._done(plan, "client_cancelled", 499, None, None, now)
            return
        f = ld.error
        if f is not None:
            e = ApiError(f.status, f"Loading adapter `{ld.adapter}` on {ld.replica} failed: {f.reason}",
                         type_="timeout" if f.outcome == "timeout" else "bad_gateway",
                         code="adapter_load_failed")
        elif not ld.done:
            e = ApiError(504, f"Loading adapter `{ld.adapter}` on {ld.replica} did not end in time.",
                         type_="timeout", code="adapter_load_failed")
        else:
            return
        core._done(plan, "failed", e.status, None, None, now)
        e.counted = True
        raise e

    def _backoff_error(self, plan: Plan, f: LoadFailure, now: float) -> ApiError:
        wait = max(1, math.ceil(f.retry_at - now))
        e = ApiError(503, f"Loading adapter `{plan.info.adapter}` failed: {f.reason} (tried again in {wait}s).",
                     type_="service_unavailable", code="adapter_load_failed",
                     headers=[("retry-after", str(wait))])
        self.core._done(plan, "failed", 503, None, None, now)
        e.counted = True
        return e

    def load_done(self, ld: Load, now: float, failure: tuple[str, int, str] | None) -> list[Ticket]:
        """The shell's load ended (its unload too, reported with ``book.unloaded``): the book
        takes it, the view follows, and every request waiting on the model may look again."""
        self.book.finish(ld, now, failure)
        rep = self.core.table.replicas.get(ld.replica)
        if rep is not None:
            self._sync(rep)
        return self.core.capacity_freed(ld.model, everyone=True)

    def unloaded(self, ld: Load, now: float, *, ok: bool) -> None:
        self.book.unloaded(ld, now, ok=ok)
