"""The adapter book (llmgw.route.adapters): its decisions, and its invariants under random
request / finish / load / unload / failure / restart sequences, adapters withdrawn from the
declaration and retired, and holdings an engine lost (hypothesis state machine)."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from llmgw.route.adapters import AdapterBook, AdapterSettings, Load, NoRoom, Unload

ALL = {"a", "b", "c", "d", "e"}


def book(cap: int = 2, n: int = 1) -> AdapterBook:
    b = AdapterBook(AdapterSettings(backoff_s=5.0, backoff_max_s=20.0))
    for i in range(n):
        b.add_replica(f"r{i}", cap)
    return b


def load(b: AdapterBook, rid: str, name: str, now: float = 0.0) -> None:
    ld = b.choose(name, [rid], now, evict=True, evictable=ALL)
    assert isinstance(ld, Load), ld
    if ld.unload:
        b.unloaded(ld, now, ok=True)
    b.finish(ld, now)


def test_a_cold_adapter_loads_on_the_first_candidate_with_a_free_slot() -> None:
    b = book(cap=1, n=2)
    load(b, "r0", "a")
    ld = b.choose("b", ["r0", "r1"], 1.0, evict=False, evictable=ALL)
    assert isinstance(ld, Load) and ld.replica == "r1" and ld.unload is None
    assert b.load_for("b") is ld


def test_at_the_cap_the_least_recently_used_idle_adapter_is_unloaded() -> None:
    b = book(cap=2)
    load(b, "r0", "a", 0.0)
    load(b, "r0", "b", 1.0)
    b.acquire("r0", "a", 2.0)
    b.release("r0", "a", 3.0)  # a used after b: b is the LRU
    ld = b.choose("c", ["r0"], 4.0, evict=True, evictable=ALL)
    assert isinstance(ld, Load) and ld.unload == "b"
    assert b.loaded("r0") == {"a"}  # b leaves routing at once


def test_an_adapter_with_a_request_in_flight_is_never_unloaded() -> None:
    b = book(cap=2)
    load(b, "r0", "a", 0.0)
    load(b, "r0", "b", 1.0)
    b.acquire("r0", "a", 2.0)
    b.acquire("r0", "b", 2.0)
    got = b.choose("c", ["r0"], 3.0, evict=True, evictable=ALL)
    assert isinstance(got, NoRoom) and "requests in flight" in got.reason
    b.release("r0", "a", 4.0)
    ld = b.choose("c", ["r0"], 5.0, evict=True, evictable=ALL)
    assert isinstance(ld, Load) and ld.unload == "a"


def test_spreading_takes_a_free_slot_only() -> None:
    b = book(cap=1, n=2)
    load(b, "r0", "a")
    load(b, "r1", "b")
    assert isinstance(b.choose("a", ["r1"], 1.0, evict=False, evictable=ALL), NoRoom)


def test_a_failed_load_backs_off_and_names_the_engines_reason() -> None:
    b = book(cap=2)
    ld = b.choose("a", ["r0"], 0.0, evict=True, evictable=ALL)
    assert isinstance(ld, Load)
    b.finish(ld, 0.0, ("No adapter found for /x", 404, "failed"))
    assert b.replicas["r0"].used() == 0 and ld.error is not None
    got = b.choose("a", ["r0"], 4.9, evict=True, evictable=ALL)
    assert isinstance(got, NoRoom) and got.failure is not None and "No adapter found" in got.reason
    ld = b.choose("a", ["r0"], 5.0, evict=True, evictable=ALL)
    assert isinstance(ld, Load)
    b.finish(ld, 5.0, ("again", 404, "failed"))
    assert b.failures[("r0", "a")].retry_at == 15.0  # doubled
    assert b.loads_total == {"ok": 0, "failed": 2, "timeout": 0, "not_listed": 0}


def test_a_failed_unload_fails_the_load_and_keeps_the_adapter() -> None:
    b = book(cap=1)
    load(b, "r0", "a")
    ld = b.choose("b", ["r0"], 1.0, evict=True, evictable=ALL)
    assert isinstance(ld, Load) and ld.unload == "a"
    b.unloaded(ld, 1.0, ok=False)
    b.finish(ld, 1.0)
    assert ld.error is not None and b.loaded("r0") == {"a"} and b.replicas["r0"].used() == 1


def test_a_restart_is_learned_but_an_answer_older_than_a_change_is_not() -> None:
    b = book(cap=2)
    load(b, "r0", "a", 5.0)
    assert not b.learned("r0", [], asked_at=4.0)  # asked before the load: stale
    assert b.learned("r0", ["z"], asked_at=6.0)
    assert b.loaded("r0") == {"z"}
    assert b.idle_victim("r0", ALL | {"z"}) == "z"


def test_pinned_adapters_and_those_not_evictable_are_never_unloaded() -> None:
    b = AdapterBook()
    b.add_replica("r0", 2, pinned=["s"])
    b.learned("r0", ["s", "other"], 0.0)
    assert isinstance(b.choose("a", ["r0"], 1.0, evict=True, evictable=ALL), NoRoom)


def test_an_idle_withdrawn_adapter_is_retired_and_its_slot_freed_when_the_unload_ends() -> None:
    b = book(cap=2)
    load(b, "r0", "a", 0.0)
    load(b, "r0", "b", 0.0)
    b.acquire("r0", "a", 1.0)
    assert b.retire("r0", {"a"}, 1.0) == []  # a request for it is in flight: kept
    b.release("r0", "a", 2.0)
    (u,) = b.retire("r0", {"a"}, 2.0)
    assert b.loaded("r0") == {"b"} and b.replicas["r0"].used() == 2  # out of routing, slot kept
    assert isinstance(b.choose("c", ["r0"], 2.0, evict=False, evictable=ALL), NoRoom)
    assert not b.learned("r0", ["a", "b"], asked_at=1.5)  # an answer from before: ignored
    b.unload_done(u, 3.0, ok=True)
    b.unload_done(u, 3.0, ok=False)  # a second report changes nothing
    assert b.replicas["r0"].used() == 1 and b.unloads_total["ok"] == 1
    assert isinstance(b.choose("c", ["r0"], 3.0, evict=False, evictable=ALL), Load)


def test_a_failed_retirement_holds_the_adapter_again_and_waits_its_backoff() -> None:
    b = book(cap=1)
    load(b, "r0", "a")
    (u,) = b.retire("r0", {"a"}, 1.0)
    b.unload_done(u, 1.0, ok=False)
    assert b.loaded("r0") == {"a"} and b.unloads_total["failed"] == 1
    assert b.retire("r0", {"a"}, 5.9) == [] and len(b.retire("r0", {"a"}, 6.0)) == 1


def test_a_holding_the_engine_lost_is_forgotten() -> None:
    b = book(cap=1)
    load(b, "r0", "a")
    assert b.forget("r0", "a", 1.0) and not b.forget("r0", "a", 1.0)
    assert b.replicas["r0"].used() == 0
    assert isinstance(b.choose("a", ["r0"], 1.0, evict=False, evictable=ALL), Load)  # loaded again


class BookMachine(RuleBasedStateMachine):
    """Random requests, finishes, loads (with and without an unload first), failures, learned
    restarts: the invariants of the issue hold after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.book = AdapterBook(AdapterSettings(backoff_s=1.0, backoff_max_s=4.0))
        self.caps = {"r0": 1, "r1": 2, "r2": 2}
        for rid, cap in self.caps.items():
            self.book.add_replica(rid, cap)
        self.now = 0.0
        self.loads: list[Load] = []
        self.unloads: list[Unload] = []  # retirements begun, not ended
        self.unwanted: set[str] = set()  # withdrawn from the declaration
        self.running: list[tuple[str, str]] = []  # acquired (replica, adapter)

    @rule(name=st.sampled_from(sorted(ALL)), order=st.lists(st.sampled_from(["r0", "r1", "r2"]), min_size=1, max_size=3, unique=True), evict=st.booleans())
    def request_a_cold_adapter(self, name: str, order: list[str], evict: bool) -> None:
        before = {r: self.book.replicas[r].used() for r in self.caps}
        got = self.book.choose(name, order, self.now, evict=evict, evictable=ALL)
        if isinstance(got, Load):
            assert sum(1 for ld in self.loads if ld.replica == got.replica and ld.adapter == name) == 0
            if got.unload is not None:
                assert (got.replica, got.unload) not in self.running
            self.loads.append(got)
        else:
            assert before == {r: self.book.replicas[r].used() for r in self.caps}

    @precondition(lambda self: self.loads)
    @rule(pick=st.integers(0, 99), how=st.sampled_from(["ok", "failed", "timeout", "not_listed", "unload_failed"]))
    def a_load_ends(self, pick: int, how: str) -> None:
        ld = self.loads.pop(pick % len(self.loads))
        if ld.unload is not None:
            self.book.unloaded(ld, self.now, ok=how != "unload_failed")
        self.book.finish(ld, self.now, None if how in ("ok", "unload_failed") else ("why", 502, how))
        self.book.finish(ld, self.now, ("twice", 502, "failed"))  # a second report changes nothing
        ok = how == "ok" or (how == "unload_failed" and ld.unload is None)
        assert ld.done and (ld.error is None) == ok

    @precondition(lambda self: any(h.loaded for h in self.book.replicas.values()))
    @rule(pick=st.integers(0, 99))
    def a_request_starts_where_it_is_held(self, pick: int) -> None:
        held = [(rid, a) for rid, h in sorted(self.book.replicas.items()) for a in h.loaded]
        rid, name = held[pick % len(held)]
        self.book.acquire(rid, name, self.now)
        self.running.append((rid, name))

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 99))
    def a_request_ends(self, pick: int) -> None:
        rid, name = self.running.pop(pick % len(self.running))
        self.book.release(rid, name, self.now)

    @rule(rid=st.sampled_from(["r0", "r1", "r2"]), keep=st.booleans())
    def the_engine_lists_its_adapters(self, rid: str, keep: bool) -> None:
        """A /v1/models answer: the same holdings, or none at all (the engine restarted)."""
        h = self.book.replicas[rid]
        names = list(h.loaded) if keep else []
        if not keep:  # a restart ends the requests running there
            for r in [r for r in self.running if r[0] == rid]:
                self.running.remove(r)
                self.book.release(*r, self.now)
        self.book.learned(rid, names, self.now + 0.001)

    @rule(name=st.sampled_from(sorted(ALL)), back=st.booleans())
    def the_declaration_changes(self, name: str, back: bool) -> None:
        if back:
            self.unwanted.discard(name)
        else:
            self.unwanted.add(name)

    @rule(rid=st.sampled_from(["r0", "r1", "r2"]))
    def withdrawn_adapters_are_retired(self, rid: str) -> None:
        running = {a for r, a in self.running if r == rid}
        used = self.book.replicas[rid].used()
        got = self.book.retire(rid, self.unwanted, self.now)
        for u in got:
            assert u.adapter in self.unwanted and u.adapter not in running  # never one in flight
            assert not self.book.holds(rid, u.adapter)  # out of routing at once
        assert self.book.replicas[rid].used() == used  # each keeps its slot until it ends
        self.unloads += got

    @precondition(lambda self: self.unloads)
    @rule(pick=st.integers(0, 99), ok=st.booleans())
    def an_unload_ends(self, pick: int, ok: bool) -> None:
        u = self.unloads.pop(pick % len(self.unloads))
        self.book.unload_done(u, self.now, ok=ok)
        self.book.unload_done(u, self.now, ok=not ok)  # a second report changes nothing
        assert self.book.holds(u.replica, u.adapter) == (not ok)

    @precondition(lambda self: any(h.loaded for h in self.book.replicas.values()))
    @rule(pick=st.integers(0, 99))
    def the_engine_lost_a_holding(self, pick: int) -> None:
        """It restarted and answered 404: its requests there ended, the holding is dropped."""
        held = [(rid, a) for rid, h in sorted(self.book.replicas.items()) for a in h.loaded]
        rid, name = held[pick % len(held)]
        for r in [r for r in self.running if r == (rid, name)]:
            self.running.remove(r)
            self.book.release(rid, name, self.now)
        assert self.book.forget(rid, name, self.now) and not self.book.holds(rid, name)

    @rule(dt=st.sampled_from([0.0, 0.5, 2.0, 5.0]))
    def tick(self, dt: float) -> None:
        self.now += dt

    @invariant()
    def an_unload_in_progress_is_neither_held_nor_loading(self) -> None:
        for rid in self.caps:
            h = self.book.replicas[rid]
            assert sorted(h.unloading) == sorted(u.adapter for u in self.unloads if u.replica == rid)
            assert not (h.unloading.keys() & (h.loaded.keys() | h.loading.keys()))
            assert all(not u.done for u in h.unloading.values())

    @invariant()
    def count_never_exceeds_the_cap(self) -> None:
        for rid, cap in self.caps.items():
            assert self.book.replicas[rid].used() <= cap

    @invariant()
    def adapters_with_requests_in_flight_stay_held(self) -> None:
        for rid, name in self.running:
            assert self.book.holds(rid, name)

    @invariant()
    def one_load_per_replica_and_adapter_and_no_leaked_slot(self) -> None:
        pairs = [(ld.replica, ld.adapter) for ld in self.loads]
        assert len(pairs) == len(set(pairs))
        for rid in self.caps:
            h = self.book.replicas[rid]
            assert sorted(h.loading) == sorted(a for r, a in pairs if r == rid)
            assert all(not ld.done for ld in h.loading.values())

    @invariant()
    def inflight_matches_running_requests(self) -> None:
        for rid in self.caps:
            want: dict[str, int] = {}
            for r, a in self.running:
                if r == rid:
                    want[a] = want.get(a, 0) + 1
            assert self.book.replicas[rid].inflight == want


TestBookMachine = BookMachine.TestCase
TestBookMachine.settings = settings(max_examples=200, stateful_step_count=60, deadline=None, derandomize=True)


def test_a_replica_that_leaves_mid_load_keeps_no_slot_and_no_failure() -> None:
    b = book(cap=1)
    ld = b.choose("a", ["r0"], 0.0, evict=True, evictable=ALL)
    assert isinstance(ld, Load)
    b.remove_replica("r0")
    b.finish(ld, 1.0, ("gone", 503, "failed"))
    assert ld.error is not None and b.failures == {} and b.waiting() == 0
    b.add_replica("r0", 1)  # back (a new engine): a fresh start
    assert isinstance(b.choose("a", ["r0"], 1.0, evict=True, evictable=ALL), Load)
