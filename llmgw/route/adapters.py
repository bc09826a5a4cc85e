"""The adapter book: which LoRA adapters each vLLM replica holds, and what to load or unload next.

vLLM never refuses a load when it is full (it evicts inside its own cache), so the router's count
is the source of truth. Per replica the book keeps:

* ``loaded``: the adapters it holds, each with its last use (LRU order), at most ``cap`` of them
  together with the loads in progress (``loaded + loading <= cap``, always);
* ``inflight``: requests running per adapter (an adapter with one is never unloaded);
* ``loading``: the loads in progress, one per (replica, adapter) at most (single flight: every
  request for a cold adapter waits on the same :class:`Load`);
* ``pinned``: adapters the router must not unload (static ones, loaded at start);
* ``unloading``: adapters being unloaded because the model no longer serves them (removed from
  its declaration, or listed by the engine without one): :meth:`AdapterBook.retire` takes only
  idle ones, and each keeps its slot until :meth:`AdapterBook.unload_done` (the engine holds it
  until then). A failed unload holds the adapter again, not retired before ``backoff_s``.

A failed load is remembered per (replica, adapter) with a backoff that doubles from
``backoff_s`` to ``backoff_max_s``: that pair is not tried again before it ends (no tight loop),
and a request with nowhere else to go gets the engine's reason at once.

A :class:`Load` reserves its slot when it begins; when it unloads an idle adapter to make room,
that adapter's slot becomes the load's. :meth:`AdapterBook.finish` gives the slot back (a failure)
or turns it into a holding (success), exactly once. The shell (``llmgw.daemon.router.adapter_loader``)
does the HTTP calls; the router's core (``dispatch.py``) asks :meth:`AdapterBook.choose`.

Pure: ``now`` is passed in (monotonic seconds)."""

from __future__ import annotations

from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass, field

__all__ = ["AdapterBook", "AdapterSettings", "Load", "LoadFailure", "NoRoom", "Unload", "LATENCY_BUCKETS"]

# Load latency histogram buckets, seconds (a local adapter loads in well under a second; a
# repository download takes minutes).
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
LOAD_OUTCOMES = ("ok", "failed", "timeout", "not_listed")
UNLOAD_OUTCOMES = ("ok", "failed")


@dataclass(frozen=True, slots=True)
class AdapterSettings:
    backoff_s: float = 5.0  # first wait after a failed load of an adapter on a replica
    backoff_max_s: float = 300.0  # the wait doubles per failure up to this


@dataclass(slots=True, eq=False)
class Load:
    """One load in progress: the adapter, the replica, the idle adapter unloaded first (or None)."""

    replica: str
    adapter: str
    unload: str | None
    started: float
    model: str = ""  # the base model (the router's core sets it)
    waiters: int = 0  # requests waiting on it (the one that started it included)
    unload_reported: bool = False  # the shell reported the unload's end (unloaded())
    unload_failed: bool = False  # the idle adapter could not be unloaded: it is held again at the end
    done: bool = False
    error: LoadFailure | None = None  # set when it failed


@dataclass(slots=True, eq=False)
class Unload:
    """One unload in progress of an adapter the model no longer serves (see AdapterBook.retire)."""

    replica: str
    adapter: str
    started: float
    model: str = ""  # the base model (the router's core sets it)
    done: bool = False


@dataclass(slots=True)
class LoadFailure:
    """Why a load failed, and when the pair may be tried again."""

    reason: str  # the engine's words (or ours: a timeout, not listed afterwards)
    status: int  # the HTTP status the requests waiting on it get
    outcome: str  # failed / timeout / not_listed
    at: float
    retry_at: float
    count: int = 1  # failures in a row


@dataclass(frozen=True, slots=True)
class NoRoom:
    """Nothing can be loaded now. ``failure``: every candidate is in backoff (the latest reason)."""

    reason: str
    failure: LoadFailure | None = None


@dataclass(slots=True)
class _Holdings:
    cap: int
    loaded: dict[str, float] = field(default_factory=dict)  # adapter -> last use (insertion = LRU order)
    inflight: dict[str, int] = field(default_factory=dict)
    loading: dict[str, Load] = field(default_factory=dict)
    pinned: frozenset[str] = frozenset()
    unloading: dict[str, Unload] = field(default_factory=dict)
    unload_retry: dict[str, float] = field(default_factory=dict)  # adapter -> no retire before (a failed unload)
    changed_at: float = float("-inf")  # the router's last change: /v1/models asked before is stale

    def used(self) -> int:
        return len(self.loaded) + len(self.loading) + len(self.unloading)


class AdapterBook:
    def __init__(self, settings: AdapterSettings | None = None) -> None:
        self.settings = settings or AdapterSettings()
        self.replicas: dict[str, _Holdings] = {}
        self.failures: dict[tuple[str, str], LoadFailure] = {}
        self.loads_total = dict.fromkeys(LOAD_OUTCOMES, 0)
        self.unloads_total = dict.fromkeys(UNLOAD_OUTCOMES, 0)
        self.latency_counts = [0] * (len(LATENCY_BUCKETS) + 1)  # per bucket, the last one +Inf
        self.latency_sum = 0.0
        self.waits_total = 0  # requests that waited for a load (one that waited for two counts twice)

    # -- replicas ------------------------------------------------------------------------------
    def add_replica(self, rid: str, cap: int, pinned: Iterable[str] = ()) -> None:
        if cap < 1:
            raise ValueError("cap must be >= 1")
        h = self.replicas.get(rid)
        if h is None:
            self.replicas[rid] = _Holdings(cap, pinned=frozenset(pinned))
        else:
            h.cap, h.pinned = cap, frozenset(pinned)

    def remove_replica(self, rid: str) -> None:
        """The replica is gone (or restarted elsewhere): its loads in progress end as failed for
        their waiters when the shell finishes them (finish() ignores an unknown replica)."""
        self.replicas.pop(rid, None)
        for key in [k for k in self.failures if k[0] == rid]:
            del self.failures[key]

    def learned(self, rid: str, names: Iterable[str], asked_at: float) -> bool:
        """The engine's /v1/models, asked at ``asked_at``, lists ``names``: after a restart it holds
        fewer (or others). Ignored when the router changed this replica's holdings since it asked
        (the answer may predate a load or unload). Loads and unloads in progress stay reserved.
        True if used."""
        h = self.replicas.get(rid)
        if h is None or asked_at < h.changed_at:
            return False
        listed = set(names)
        old = h.loaded
        h.loaded = {a: t for a, t in old.items() if a in listed}
        for a in sorted(listed - old.keys() - h.loading.keys() - h.unloading.keys()):
            h.loaded[a] = float("-inf")  # held, never used by us: the first to go when idle
        return True

    # -- reading ---------------------------------------------------------------------------------
    def holds(self, rid: str, adapter: str) -> bool:
        h = self.replicas.get(rid)
        return h is not None and adapter in h.loaded

    def loaded(self, rid: str) -> frozenset[str]:
        h = self.replicas.get(rid)
        return frozenset(h.loaded) if h is not None else frozenset()

    def load_for(self, adapter: str) -> Load | None:
        """A load of ``adapter`` in progress on any replica (the oldest)."""
        best = None
        for h in self.replicas.values():
            ld = h.loading.get(adapter)
            if ld is not None and (best is None or ld.started < best.started):
                best = ld
        return best

    def waiting(self) -> int:
        """Requests waiting for a load, over every replica."""
        return sum(ld.waiters for h in self.replicas.values() for ld in h.loading.values())

    def idle_victim(self, rid: str, evictable: Container[str]) -> str | None:
        """The least recently used idle adapter of the replica that may be unloaded, or None."""
        h = self.replicas.get(rid)
        if h is None:
            return None
        best: tuple[float, str] | None = None
        for a, used in h.loaded.items():
            if a in h.pinned or h.inflight.get(a, 0) or a not in evictable:
                continue
            if best is None or used < best[0]:
                best = (used, a)
        return None if best is None else best[1]

    # -- decisions ---------------------------------------------------------------------------------
    def choose(self, adapter: str, candidates: Sequence[str], now: float, *, evict: bool,
               evictable: Container[str]) -> Load | NoRoom:
        """Begin a load of ``adapter`` on the first candidate (the caller orders them, least loaded
        first) with a free slot, else — with ``evict`` — on the first with an idle adapter to
        unload. Candidates that hold it, load it, or are in backoff for it are skipped."""
        backoff: LoadFailure | None = None
        usable: list[_Holdings] = []
        ids: list[str] = []
        for rid in candidates:
            h = self.replicas.get(rid)
            if h is None or adapter in h.loaded or adapter in h.loading or adapter in h.unloading:
                continue
            f = self.failures.get((rid, adapter))
            if f is not None and now < f.retry_at:
                if backoff is None or f.at > backoff.at:
                    backoff = f
                continue
            usable.append(h)
            ids.append(rid)
        for rid, h in zip(ids, usable):
            if h.used() < h.cap:
                return self._begin(rid, h, adapter, None, now)
        if evict:
            for rid, h in zip(ids, usable):
                victim = self.idle_victim(rid, evictable)
                if victim is not None and h.used() - 1 < h.cap:
                    return self._begin(rid, h, adapter, victim, now)
        if usable:
            return NoRoom(f"no replica has room for adapter {adapter!r}: every loaded adapter has "
                          "requests in flight" if evict else f"no replica has a free adapter slot for {adapter!r}")
        if backoff is not None:
            return NoRoom(f"loading adapter {adapter!r} failed: {backoff.reason}", backoff)
        return NoRoom(f"no replica can take adapter {adapter!r} now")

    def _begin(self, rid: str, h: _Holdings, adapter: str, victim: str | None, now: float) -> Load:
        if victim is not None:
            del h.loaded[victim]  # its slot becomes the load's; no request goes to it any more
        ld = Load(rid, adapter, victim, now)
        h.loading[adapter] = ld
        h.changed_at = now
        return ld

    def unloaded(self, ld: Load, now: float, *, ok: bool) -> None:
        """The shell's unload of ``ld.unload`` ended. Not ok: the adapter may still be there, so
        the load must fail, and :meth:`finish` gives the slot back to that adapter."""
        self.unloads_total["ok" if ok else "failed"] += 1
        ld.unload_failed = not ok
        h = self.replicas.get(ld.replica)
        if h is not None:
            h.changed_at = now

    def finish(self, ld: Load, now: float, failure: tuple[str, int, str] | None = None) -> None:
        """The load ended: ``failure`` None (the engine lists the adapter) or (reason, status,
        outcome). Its slot becomes a holding or is given back. Once; a second call does nothing."""
        if ld.done:
            return
        ld.done = True
        if failure is None and ld.unload_failed:
            failure = (f"could not unload {ld.unload!r} to make room", 503, "failed")
        outcome = "ok" if failure is None else failure[2]
        self.loads_total[outcome] = self.loads_total.get(outcome, 0) + 1
        dt = max(0.0, now - ld.started)
        self.latency_sum += dt
        self.latency_counts[_bucket(dt)] += 1
        h = self.replicas.get(ld.replica)
        key = (ld.replica, ld.adapter)
        if failure is not None:
            prev = self.failures.get(key)
            n = prev.count + 1 if prev is not None else 1
            s = self.settings
            wait = min(s.backoff_max_s, s.backoff_s * 2 ** (n - 1))
            ld.error = LoadFailure(failure[0], failure[1], failure[2], now, now + wait, n)
            if h is not None:  # a replica that left keeps no record
                self.failures[key] = ld.error
        else:
            self.failures.pop(key, None)
        if h is None or h.loading.get(ld.adapter) is not ld:
            return
        del h.loading[ld.adapter]
        h.changed_at = now
        if failure is None:
            h.loaded[ld.adapter] = now
        elif ld.unload_failed and ld.unload is not None and ld.unload not in h.loaded:
            h.loaded[ld.unload] = float("-inf")  # still on the engine: its slot back

    # -- adapters the model no longer serves, and holdings the engine lost -----------------------
    def retire(self, rid: str, unwanted: Container[str], now: float) -> list[Unload]:
        """Begin unloading each idle (no request in flight), unpinned adapter of the replica that is
        in ``unwanted``, unless a failed unload of it is in its backoff. Each leaves routing at
        once and keeps its slot until :meth:`unload_done`."""
        h = self.replicas.get(rid)
        if h is None:
            return []
        out = []
        for a in [a for a in h.loaded if a in unwanted and a not in h.pinned and not h.inflight.get(a, 0)]:
            if now < h.unload_retry.get(a, float("-inf")):
                continue
            del h.loaded[a]
            u = h.unloading[a] = Unload(rid, a, now)
            out.append(u)
        if out:
            h.changed_at = now
        return out

    def unload_done(self, u: Unload, now: float, *, ok: bool) -> None:
        """The shell's unload ended. Ok: the slot is free. Not ok: the engine may still hold the
        adapter, so it is held again (unused: the first to go) and not retired for ``backoff_s``.
        Once; a second call does nothing."""
        if u.done:
            return
        u.done = True
        self.unloads_total["ok" if ok else "failed"] += 1
        h = self.replicas.get(u.replica)
        if h is None or h.unloading.get(u.adapter) is not u:
            return
        del h.unloading[u.adapter]
        h.changed_at = now
        if ok:
            h.unload_retry.pop(u.adapter, None)
        else:
            h.loaded[u.adapter] = float("-inf")
            h.unload_retry[u.adapter] = now + self.settings.backoff_s

    def forget(self, rid: str, adapter: str, now: float) -> bool:
        """The engine does not have ``adapter`` although the book says it holds it (it restarted,
        and answered a request for it 404): drop the holding (its slot is free). True if held."""
        h = self.replicas.get(rid)
        if h is None or adapter not in h.loaded:
            return False
        del h.loaded[adapter]
        h.changed_at = now
        return True

    # -- requests ----------------------------------------------------------------------------------
    def acquire(self, rid: str, adapter: str, now: float) -> None:
        h = self.replicas.get(rid)
        if h is None:
            return
        h.inflight[adapter] = h.inflight.get(adapter, 0) + 1
        if adapter in h.loaded:
            del h.loaded[adapter]
            h.loaded[adapter] = now  # most recently used: to the end

    def release(self, rid: str, adapter: str, now: float) -> None:
        h = self.replicas.get(rid)
        if h is None:
            return
        n = h.inflight.get(adapter, 0) - 1
        if n > 0:
            h.inflight[adapter] = n
        else:
            h.inflight.pop(adapter, None)
        if adapter in h.loaded:
            h.loaded[adapter] = max(h.loaded[adapter], now)

    def snapshot(self, now: float) -> list[dict[str, object]]:
        out: list[dict[str, object]] = []
        for rid, h in sorted(self.replicas.items()):
            rows = []
            for a, used in h.loaded.items():
                rows.append({"adapter": a, "state": "pinned" if a in h.pinned else "loaded",
                             "inflight": h.inflight.get(a, 0),
                             "idle_s": None if used == float("-inf") else round(max(0.0, now - used), 3)})
            for a, ld in h.loading.items():
                rows.append({"adapter": a, "state": "loading", "inflight": 0, "idle_s": None,
                             "waiting": ld.waiters, "unloading": ld.unload})
            for a in h.unloading:
                rows.append({"adapter": a, "state": "unloading", "inflight": 0, "idle_s": None})
            failed = [{"adapter": a, "reason": f.reason, "failures": f.count,
                       "retry_in_s": round(max(0.0, f.retry_at - now), 3)}
                      for (r, a), f in sorted(self.failures.items()) if r == rid]
            out.append({"replica": rid, "cap": h.cap, "used": h.used(), "adapters": rows, "failed": failed})
        return out


def _bucket(dt: float) -> int:
    for i, b in enumerate(LATENCY_BUCKETS):
        if dt <= b:
            return i
    return len(LATENCY_BUCKETS)
