"""The router's core with LoRA adapters on demand (llmgw.route.adapter_routing), driven as the
shell drives it under every order of events a hypothesis state machine finds: requests for
adapters arrive, wait on a load (single flight) or in the queue, loads succeed or fail (their
unload too), engines list their adapters (a restart forgets them), attempts end, clients leave,
time passes. Whatever happens:

- no replica counts more adapters than its cap, and an adapter with a request in flight is held;
- the book's in-flight count per (replica, adapter) is exactly the live attempts;
- one load per (replica, adapter) at a time, and no request waits on a load that has ended;
- every queue place belongs to a waiting request; every ended request is counted exactly once."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from llmgw.config import parse_config
from llmgw.route.adapters import Load
from llmgw.route.admission import Ticket
from llmgw.route.attempt import Attempt
from llmgw.route.breaker import FailureKind
from llmgw.route.cache_stats import CacheStats
from llmgw.route.dispatch import Plan, RouterCore
from llmgw.route.openai_req import ApiError
from llmgw.route.replicas import ReplicaTable

CFG = """
[router]
max_attempts = 2
queue_size = 3
queue_timeout_s = 5.0
adapter_backoff_s = 1.0
adapter_backoff_max_s = 2.0
[[pools]]
name = "default"
max_inflight_per_replica = 2
[[models]]
name = "m"
engine = "vllm"
max_loaded_adapters = 1
[[models.replicas]]
url = "http://127.0.0.1:1"
[[models.replicas]]
url = "http://127.0.0.1:2"
""" + "".join(f'[[models.adapters]]\nname = "{a}"\nsource = "/ad/{a}"\n' for a in "abc")
NAMES = ["a", "b", "c", "m"]


@dataclass
class Req:
    plan: Plan
    attempt: Attempt | None = None
    ticket: Ticket | None = None
    load: Load | None = None


def core_of(cfg_text: str = CFG) -> RouterCore:
    cfg = parse_config(cfg_text)
    return RouterCore(cfg, ReplicaTable(cfg), cache_stats=CacheStats(), wall=lambda: 0.0, rng=random.Random(0))


class AdapterLifecycle(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.core = core_of()
        self.now = 0.0
        self.going: list[Req] = []
        self.loads: list[Load] = []  # begun, not ended (the shell's load tasks)
        self.ended = 0
        self.n = 0

    def _step(self, r: Req) -> None:
        try:
            s = self.core.next(r.plan, self.now, 0.0)
        except ApiError as e:
            assert e.counted and e.status in (429, 502, 503, 504), e.body()
            self._end(r)
            return
        r.attempt = r.ticket = r.load = None
        if isinstance(s, Attempt):
            r.attempt = s
        elif isinstance(s, Load):
            r.load = s
            if s not in self.loads:
                assert not s.done
                self.loads.append(s)
        else:
            r.ticket = s

    def _end(self, r: Req) -> None:
        self.going.remove(r)
        self.ended += 1

    def _wake(self, tickets: list[Ticket]) -> None:
        for t in tickets:
            assert any(r.ticket is t for r in self.going), "a woken ticket belongs to a waiting request"

    @rule(name=st.sampled_from(NAMES))
    def arrive(self, name: str) -> None:
        self.n += 1
        body = json.dumps({"model": name, "prompt": "x"}).encode()
        try:
            r = Req(self.core.plan("completions", body, f"q{self.n}", strategy=None, session=None, now=self.now))
        except ApiError as e:  # an adapter withdrawn from the declaration: 404 (the shell counts it)
            assert e.status == 404 and name != "m" and self.core.table.resolve(name) is None
            return
        self.going.append(r)
        self._step(r)

    @precondition(lambda self: self.loads)
    @rule(pick=st.integers(0, 99), how=st.sampled_from(["ok", "failed", "timeout", "not_listed", "unload_failed"]))
    def a_load_ends(self, pick: int, how: str) -> None:
        """The shell's load task: the unload (if any), the load, then the core; every request
        waiting on it resumes."""
        ld = self.loads.pop(pick % len(self.loads))
        routing = self.core.adapters
        if ld.unload is not None:
            routing.unloaded(ld, self.now, ok=how != "unload_failed")
        self._wake(routing.load_done(ld, self.now, None if how in ("ok", "unload_failed") else ("why", 502, how)))
        for r in [r for r in self.going if r.load is ld]:
            try:
                routing.waited(r.plan, self.now)
            except ApiError as e:
                assert e.counted and ld.error is not None
                self._end(r)
                continue
            self._step(r)

    @precondition(lambda self: any(r.load for r in self.going))
    @rule(pick=st.integers(0, 99))
    def a_client_leaves_while_its_adapter_loads(self, pick: int) -> None:
        waiting = [r for r in self.going if r.load]
        r = waiting[pick % len(waiting)]
        self.core.adapters.waited(r.plan, self.now, cancelled=True)
        self._end(r)

    @precondition(lambda self: any(r.attempt for r in self.going))
    @rule(pick=st.integers(0, 99), how=st.sampled_from([None, FailureKind.CLIENT_CANCEL, FailureKind.CONNECT]))
    def attempt_ends(self, pick: int, how: FailureKind | None) -> None:
        live = [r for r in self.going if r.attempt]
        r = live[pick % len(live)]
        a = r.attempt
        assert a is not None
        self._wake(self.core.finish(r.plan, a, self.now, how, first_byte_at=None, status=200))
        r.attempt = None
        if how is None or how is FailureKind.CLIENT_CANCEL:
            self._end(r)
        else:
            self._step(r)

    @precondition(lambda self: any(r.attempt and r.plan.info.adapter for r in self.going))
    @rule(pick=st.integers(0, 99))
    def a_holder_answers_404_for_its_adapter(self, pick: int) -> None:
        """Its engine restarted on the same URL: the holding is dropped and the request tried
        again (a load, another holder) — or, the second time for a request, the 404 is relayed."""
        live = [r for r in self.going if r.attempt and r.plan.info.adapter]
        r = live[pick % len(live)]
        a = r.attempt
        assert a is not None
        if self.core.adapters.missing(r.plan, a.replica, self.now):
            assert not self.core.adapters.book.holds(a.replica.id, r.plan.info.adapter or "")
            self._wake(self.core.finish(r.plan, a, self.now, FailureKind.CLIENT_4XX, first_byte_at=None, status=404))
            r.attempt = None
            self._step(r)
        else:
            self._wake(self.core.finish(r.plan, a, self.now, None, first_byte_at=self.now, status=404))
            r.attempt = None
            self._end(r)

    @rule(gone=st.sampled_from(["", "a", "b", "c"]))
    def the_model_is_redefined(self, gone: str) -> None:
        """PUT without adapter ``gone`` (or with all three again): it leaves routing at once."""
        text = CFG if not gone else CFG.replace(f'[[models.adapters]]\nname = "{gone}"\nsource = "/ad/{gone}"\n', "")
        self.core.table.add_model(parse_config(text).models[0])
        self.core.adapters.model_changed("m")
        if gone:
            assert self.core.table.resolve(gone) is None

    @rule()
    def withdrawn_adapters_are_retired(self) -> None:
        """The shell's retire loop: unloads begin (idle ones only) and end at once."""
        routing = self.core.adapters
        for u in routing.retire_due(self.now):
            assert not any(r.attempt and r.attempt.replica.id == u.replica and r.plan.info.adapter == u.adapter
                           for r in self.going), "an adapter with a request in flight is never unloaded"
            self._wake(routing.unload_done(u, self.now, ok=True))

    @precondition(lambda self: any(r.ticket for r in self.going))
    @rule(pick=st.integers(0, 99))
    def resume(self, pick: int) -> None:
        waiting = [r for r in self.going if r.ticket]
        self._step(waiting[pick % len(waiting)])

    @precondition(lambda self: any(r.ticket for r in self.going))
    @rule(pick=st.integers(0, 99), timed_out=st.booleans())
    def stops_waiting(self, pick: int, timed_out: bool) -> None:
        waiting = [r for r in self.going if r.ticket]
        r = waiting[pick % len(waiting)]
        try:
            self.core.left_queue(r.plan, self.now, timed_out=timed_out)
            assert not timed_out
        except ApiError as e:
            assert timed_out and e.status == 429 and e.counted
        r.ticket = None
        self._end(r)

    @rule(which=st.sampled_from(["m/0", "m/1"]), restarted=st.booleans())
    def the_engine_lists_its_adapters(self, which: str, restarted: bool) -> None:
        rep = self.core.table.replicas[which]
        names = set() if restarted else set(self.core.adapters.book.loaded(which))
        self._wake(self.core.adapters.listed(rep, names, self.now + 0.001))

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0, 3.0]))
    def tick(self, dt: float) -> None:
        self.now += dt

    # -- what must hold ----------------------------------------------------------------------------
    @invariant()
    def the_cap_holds_and_in_flight_adapters_stay_unless_the_engine_forgot_them(self) -> None:
        book = self.core.adapters.book
        for rid, h in book.replicas.items():
            assert h.used() <= h.cap
            live: dict[str, int] = {}
            for r in self.going:
                if r.attempt and r.attempt.replica.id == rid and r.plan.info.adapter:
                    live[r.plan.info.adapter] = live.get(r.plan.info.adapter, 0) + 1
            assert h.inflight == live

    @invariant()
    def single_flight_and_no_stuck_waiter(self) -> None:
        book = self.core.adapters.book
        pairs = [(ld.replica, ld.adapter) for ld in self.loads]
        assert len(pairs) == len(set(pairs))
        for r in self.going:
            if r.load is not None:
                assert not r.load.done and r.load in self.loads
        for ld in self.loads:
            assert ld.waiters == sum(1 for r in self.going if r.load is ld)
            h = book.replicas.get(ld.replica)
            assert h is not None and h.loading.get(ld.adapter) is ld

    @invariant()
    def permits_match_live_attempts(self) -> None:
        core = self.core
        for rid, rep in core.table.replicas.items():
            live = [r.attempt for r in self.going if r.attempt and r.attempt.replica is rep]
            assert core.caps.inflight(rid) == len(live) == rep.view.inflight

    @invariant()
    def queue_places_belong_to_waiting_requests(self) -> None:
        q = self.core.queues.get("m")
        queued = list(q) if q is not None else []
        assert all(any(r.ticket is t for r in self.going) for t in queued)

    @invariant()
    def every_ended_request_is_counted_once(self) -> None:
        counted = sum(int(n) for n, _ in self.core.counters.requests.values())
        assert counted == self.ended


TestAdapterLifecycle = AdapterLifecycle.TestCase
TestAdapterLifecycle.settings = settings(max_examples=200, stateful_step_count=50, deadline=None, derandomize=True)


def test_a_request_for_a_cold_adapter_waits_on_the_one_load_then_goes_to_its_holder() -> None:
    core = core_of()
    plans = [core.plan("completions", b'{"model": "a", "prompt": "x"}', f"q{i}", strategy=None, session=None,
                       now=0.0) for i in range(3)]
    steps = [core.next(p, 0.0, 0.0) for p in plans]
    assert all(s is steps[0] for s in steps) and isinstance(steps[0], Load) and steps[0].waiters == 3
    assert core.adapters.book.waits_total == 3  # counted once per request that waits (the one that began it too)
    core.adapters.load_done(steps[0], 0.2, None)
    for p in plans[:2]:
        core.adapters.waited(p, 0.2)
        a = core.next(p, 0.2, 0.0)
        assert isinstance(a, Attempt) and a.replica.id == steps[0].replica
    assert core.adapters.book.loads_total["ok"] == 1
    # its holder is at its cap (2 in flight): the third spreads it to the other replica's free slot
    core.adapters.waited(plans[2], 0.2)
    spread = core.next(plans[2], 0.2, 0.0)
    assert isinstance(spread, Load) and spread.replica != steps[0].replica and spread.unload is None
    assert core.adapters.book.waits_total == 4


def test_a_failed_load_is_an_error_for_every_waiter_and_then_backs_off() -> None:
    core = core_of()
    plans = [core.plan("completions", b'{"model": "a", "prompt": "x"}', f"q{i}", strategy=None, session=None,
                       now=0.0) for i in range(2)]
    ld = core.next(plans[0], 0.0, 0.0)
    assert core.next(plans[1], 0.0, 0.0) is ld and isinstance(ld, Load)
    core.adapters.load_done(ld, 0.1, ("Loading lora a failed: No adapter found for /ad/a", 502, "failed"))
    for p in plans:
        try:
            core.adapters.waited(p, 0.1)
            raise AssertionError("no error")
        except ApiError as e:
            assert e.status == 502 and "No adapter found" in e.body()["error"]["message"] and e.counted
    # the other replica is tried once, then both are in backoff: the reason at once, with Retry-After
    p = core.plan("completions", b'{"model": "a", "prompt": "x"}', "q9", strategy=None, session=None, now=0.2)
    ld2 = core.next(p, 0.2, 0.0)
    assert isinstance(ld2, Load) and ld2.replica != ld.replica
    core.adapters.load_done(ld2, 0.3, ("again", 502, "failed"))
    try:
        core.adapters.waited(p, 0.3)
    except ApiError:
        pass
    p = core.plan("completions", b'{"model": "a", "prompt": "x"}', "q10", strategy=None, session=None, now=0.4)
    try:
        core.next(p, 0.4, 0.0)
        raise AssertionError("no error")
    except ApiError as e:
        assert e.status == 503 and ("retry-after", "1") in e.headers and e.counted
    p = core.plan("completions", b'{"model": "a", "prompt": "x"}', "q11", strategy=None, session=None, now=1.2)
    assert isinstance(core.next(p, 1.2, 0.0), Load)  # the backoff is over: tried again


def test_a_redefined_model_s_cap_and_static_adapters_reach_the_book() -> None:
    core = core_of()
    assert {h.cap for h in core.adapters.book.replicas.values()} == {1}
    again = parse_config(CFG.replace("max_loaded_adapters = 1", "max_loaded_adapters = 3")
                         .replace('name = "c"\n', 'name = "c"\nstatic = true\n')).models[0]
    core.table.add_model(again)
    core.adapters.model_changed("m")
    assert {h.cap for h in core.adapters.book.replicas.values()} == {3}
    assert {h.pinned for h in core.adapters.book.replicas.values()} == {frozenset({"c"})}
    assert not core.table.models["m"].on_demand("c") and core.table.models["m"].on_demand("a")


def test_with_every_breaker_open_an_adapter_request_is_not_held_in_the_queue() -> None:
    core = core_of()
    for rep in core.table.replicas.values():
        rep.breaker.trip(0.0)
    p = core.plan("completions", b'{"model": "a", "prompt": "x"}', "q1", strategy=None, session=None, now=0.0)
    try:
        step = core.next(p, 0.0, 0.0)
    except ApiError as e:  # nobody holds it: the usual 503, at once
        assert e.status == 503 and e.counted
    else:
        assert not isinstance(step, (Load, Ticket)), step


def _held(core: RouterCore, name: str, now: float) -> tuple[Plan, Attempt]:
    """A request for ``name`` that loaded it and now runs on its holder."""
    p = core.plan("completions", json.dumps({"model": name, "prompt": "x"}).encode(), f"q-{name}-{now}",
                  strategy=None, session=None, now=now)
    ld = core.next(p, now, 0.0)
    assert isinstance(ld, Load)
    core.adapters.load_done(ld, now, None)
    core.adapters.waited(p, now)
    a = core.next(p, now, 0.0)
    assert isinstance(a, Attempt) and a.replica.id == ld.replica
    return p, a


def test_a_withdrawn_adapter_leaves_routing_at_once_and_is_retired_once_idle() -> None:
    core = core_of()
    pokes: list[int] = []
    core.adapters.on_retire = lambda: pokes.append(1)
    p, a = _held(core, "a", 0.0)
    core.table.add_model(parse_config(CFG.replace('name = "a"\nsource = "/ad/a"\n', 'name = "d"\nsource = "/ad/d"\n'))
                         .models[0])
    core.adapters.model_changed("m")
    assert pokes and core.table.resolve("a") is None and "a" not in core.table.models["m"].adapters
    assert core.table.models["m"].withdrawn == {"a"}
    try:
        core.plan("completions", b'{"model": "a", "prompt": "x"}', "q2", strategy=None, session=None, now=1.0)
        raise AssertionError("no error")
    except ApiError as e:
        assert e.status == 404 and e.body()["error"]["code"] == "model_not_found"
    assert core.adapters.retire_due(1.0) == []  # its request is in flight
    pokes.clear()
    core.finish(p, a, 2.0, None, first_byte_at=1.5, status=200)
    assert pokes  # the last request ended: the shell looks again
    (u,) = core.adapters.retire_due(2.0)
    assert (u.replica, u.adapter, u.model) == (a.replica.id, "a", "m")
    assert core.adapters.book.replicas[u.replica].used() == 1  # until the unload ends
    core.adapters.unload_done(u, 3.0, ok=True)
    assert core.adapters.book.replicas[u.replica].used() == 0 and core.table.models["m"].withdrawn == set()


def test_an_adapter_an_engine_lists_without_a_declaration_is_not_served_and_is_retired() -> None:
    core = core_of()
    rep = core.table.models["m"].replicas[0]
    core.adapters.listed(rep, {"stray", "a"}, 1.0)
    assert core.table.resolve("stray") is None and core.table.resolve("a") is not None
    assert [u.adapter for u in core.adapters.retire_due(1.0)] == ["stray"]


def test_a_model_without_declarations_serves_what_its_engines_list_but_not_a_withdrawn_adapter() -> None:
    bare = CFG.split("[[models.adapters]]")[0]
    core = core_of(bare)
    rep = core.table.models["m"].replicas[0]
    core.adapters.listed(rep, {"hand"}, 1.0)
    assert core.table.resolve("hand") is not None and core.adapters.retire_due(1.0) == []
    core.table.models["m"].withdrawn.add("hand")  # as a redefinition that removed it leaves it
    core.adapters.listed(rep, {"hand"}, 2.0)
    assert core.table.resolve("hand") is None and len(core.adapters.retire_due(2.0)) == 1


def test_a_holder_that_answers_404_for_its_adapter_loses_it_and_the_request_loads_it_again() -> None:
    core = core_of()
    p, a = _held(core, "a", 0.0)
    assert core.adapters.missing(p, a.replica, 1.0)
    assert not core.adapters.book.holds(a.replica.id, "a") and a.replica.id not in p.tried
    core.finish(p, a, 1.0, FailureKind.CLIENT_4XX, first_byte_at=None, status=404)
    assert a.replica.breaker.state == "closed" and not p.counted
    again = core.next(p, 1.0, 0.0)
    assert isinstance(again, Load) and again.adapter == "a"
    core.adapters.load_done(again, 1.1, None)
    core.adapters.waited(p, 1.1)
    assert isinstance(core.next(p, 1.1, 0.0), Attempt)


def test_a_second_404_for_the_same_request_is_the_engine_s_answer() -> None:
    core = core_of()
    p, a = _held(core, "a", 0.0)
    assert core.adapters.missing(p, a.replica, 1.0)
    core.finish(p, a, 1.0, FailureKind.CLIENT_4XX, first_byte_at=None, status=404)
    ld = core.next(p, 1.0, 0.0)
    assert isinstance(ld, Load)
    core.adapters.load_done(ld, 1.1, None)
    core.adapters.waited(p, 1.1)
    again = core.next(p, 1.1, 0.0)
    assert isinstance(again, Attempt) and not core.adapters.missing(p, again.replica, 1.2)
    assert core.adapters.book.holds(again.replica.id, "a")  # still held: the 404 is relayed


def test_every_request_that_got_the_404_retries_not_only_the_first() -> None:
    core = core_of(CFG.replace("max_inflight_per_replica = 2", "max_inflight_per_replica = 4"))
    p1, a1 = _held(core, "a", 0.0)
    p2 = core.plan("completions", b'{"model": "a", "prompt": "x"}', "q2", strategy=None, session=None, now=0.1)
    a2 = core.next(p2, 0.1, 0.0)
    assert isinstance(a2, Attempt) and a2.replica is a1.replica
    assert core.adapters.missing(p1, a1.replica, 1.0) and core.adapters.missing(p2, a2.replica, 1.0)
    for p, a in ((p1, a1), (p2, a2)):
        core.finish(p, a, 1.0, FailureKind.CLIENT_4XX, first_byte_at=None, status=404)
    ld = core.next(p1, 1.0, 0.0)
    assert isinstance(ld, Load) and core.next(p2, 1.0, 0.0) is ld  # one load for both
