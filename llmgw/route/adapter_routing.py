"""LoRA adapters on demand, as the router's core sees them (vLLM replicas of a model whose
``[[models.adapters]]`` declare the adapter; static adapters are never loaded or unloaded here).

Before admission, a request for such an adapter is looked at here (:meth:`AdapterRouting.step`)
— once its model has a replica: at zero (an autoscaled model scaled to zero, or all starting) it
waits for a cold start first, like any of the model's requests, and is looked at here when the
first replica comes (the adapter is loaded there):

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
request that waited on a failed load) and, for the load itself, :meth:`load_done`.

**Adapters the model no longer serves** (:meth:`~.replicas.ModelEntry.serves_listed`: removed
from its declaration, or listed by an engine without one) leave routing at once (the table's
view never has them) and are unloaded from every holder once no request for them is in flight:
:meth:`retire_due` hands the shell the unloads to run (it calls it when ``on_retire`` pokes it —
a redefinition, the last request of such an adapter ending, a listing — and once a second, for
failed unloads whose backoff ended), and :meth:`unload_done` takes each end.

**A holding the engine lost** (it restarted on the same URL and answers 404 for the adapter):
:meth:`missing` drops it, so the request is tried again by the normal path — the adapter is
loaded again, or another holder serves it — and never reaches the client as a 404. Pure."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from .adapters import AdapterBook, AdapterSettings, Load, LoadFailure, Unload
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
        self.on_retire: Callable[[], None] = _nothing  # the shell's: retire_due has work now

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
        self.on_retire()  # an adapter it no longer declares is unloaded once idle

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
        if not rep.view.adapters >= self.book.loaded(rep.id):  # it holds one the model does not serve
            self.on_retire()
        if self.book.loaded(rep.id) != before:
            return self.core.capacity_freed(rep.view.model, everyone=True)
        return []

    def _sync(self, rep: Replica) -> None:
        self.core.table.set_adapters(rep, self.book.loaded(rep.id))  # those the model serves

    # -- adapters the model no longer serves; holdings an engine lost ---------------------------
    def retire_due(self, now: float) -> list[Unload]:
        """The unloads to begin now: every idle adapter a replica holds that its model does not
        serve (module docstring). Each has left routing already."""
        table = self.core.table
        out: list[Unload] = []
        for rid, h in self.book.replicas.items():
            rep = table.replicas.get(rid)
            entry = table.models.get(rep.view.model) if rep is not None else None
            if rep is None or entry is None or not h.loaded:
                continue
            unwanted = {a for a in h.loaded if not entry.serves_listed(a)}
            if not unwanted:
                continue
            got = self.book.retire(rid, unwanted, now)
            for u in got:
                u.model = entry.name
            if got:
                self._sync(rep)
                out += got
        return out

    def unload_done(self, u: Unload, now: float, *, ok: bool) -> list[Ticket]:
        """The shell's unload ended: the slot is free (or, failed, held again for a later try);
        a request waiting for room may look again. An adapter no engine holds any more is
        forgotten as withdrawn."""
        self.book.unload_done(u, now, ok=ok)
        table = self.core.table
        rep = table.replicas.get(u.replica)
        if rep is not None:
            self._sync(rep)
        entry = table.models.get(u.model)
        if entry is not None and u.adapter in entry.withdrawn and not any(
                u.adapter in h.loaded or u.adapter in h.unloading
                for r in entry.replicas if (h := self.book.replicas.get(r.id)) is not None):
            entry.withdrawn.discard(u.adapter)
        return self.core.capacity_freed(u.model, everyone=True)

    def release(self, rid: str, adapter: str, now: float) -> None:
        """A request for ``adapter`` on the replica ended: the book counts it; the last one of an
        adapter the model no longer serves lets it be unloaded."""
        book = self.book
        book.release(rid, adapter, now)
        h = book.replicas.get(rid)
        if h is None or adapter not in h.loaded or h.inflight.get(adapter, 0):
            return
        rep = self.core.table.replicas.get(rid)
        entry = self.core.table.models.get(rep.view.model) if rep is not None else None
        if entry is not None and not entry.serves_listed(adapter):
            self.on_retire()

    def missing(self, plan: Plan, rep: Replica, now: float) -> bool:
        """The replica, chosen as a holder of the plan's adapter, answered 404: its engine lost it
        (restarted on the same URL). The holding is dropped (a concurrent request may have done
        so already) and the replica may be tried again for this request (a load puts the adapter
        back). True if so: the shell retries instead of relaying the 404. Only on-demand adapters
        (a static one comes back with the engine's restart), and once a request: a second 404 (an
        engine that answers 404 for another reason, e.g. a route it lacks) is relayed."""
        name = plan.info.adapter
        if name is None or plan.adapter_missing or not plan.entry.on_demand(name):
            return False
        if self.book.forget(rep.id, name, now):
            self._sync(rep)
        plan.adapter_missing = True
        plan.tried.discard(rep.id)
        return True

    # -- a request -----------------------------------------------------------------------------
    def step(self, plan: Plan, now: float) -> Load | Ticket | None:
        """What an on-demand adapter request does before admission (module docstring)."""
        core = self.core
        entry = plan.entry
        name = plan.info.adapter
        assert name is not None
        q = core.wait.queue(entry)
        woken: Ticket | None = None
        if plan.ticket is not None:
            if not plan.adapter_wait and not plan.cold:
                return None  # the model's own admission wait: the core goes on with it
            # its own load's wait, or a cold start's (the first replica came: load it there)
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
                          evictable=_EVERY)  # pinned (static) ones excepted by the book
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
        t = core.wait.enqueue(q, plan, now + core.rc.queue_timeout_s, now)
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
            if not rep.view.adapters >= self.book.loaded(rep.id):  # withdrawn while it loaded
                self.on_retire()
        return self.core.capacity_freed(ld.model, everyone=True)

    def unloaded(self, ld: Load, now: float, *, ok: bool) -> None:
        self.book.unloaded(ld, now, ok=ok)


def _nothing() -> None:
    pass


class _Every:
    """Contains everything: any idle adapter a replica holds may make room, the static (pinned)
    ones excepted — one an engine lists without a declaration included."""

    def __contains__(self, _item: object) -> bool:
        return True


_EVERY = _Every()
